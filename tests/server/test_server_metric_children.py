"""The remembered-children metric classes export exactly what prometheus_client's do."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, generate_latest

from poolkeeper.telemetry.children import Counter, Gauge, Histogram


def test_a_label_set_is_one_child_and_exports_as_before() -> None:
    registry = CollectorRegistry()
    counter = Counter("c", "c", ["model", "priority"], registry=registry)
    gauge = Gauge("g", "g", ["model"], registry=registry)
    histogram = Histogram("h", "h", ["model"], buckets=(1, 10), registry=registry)
    assert counter.labels("m", "0") is counter.labels("m", "0")
    counter.labels("m", "0").inc()
    counter.labels("m", 0).inc()  # another spelling of the same label set: the same series
    counter.labels(model="m", priority="0").inc()
    gauge.labels("m").inc()
    gauge.labels("m").dec(3)
    histogram.labels("m").observe(5)
    text = generate_latest(registry).decode()
    assert 'c_total{model="m",priority="0"} 3.0' in text
    assert 'g{model="m"} -2.0' in text
    assert 'h_bucket{le="10.0",model="m"} 1.0' in text
    assert 'h_bucket{le="1.0",model="m"} 0.0' in text


def test_remove_and_clear_forget_the_remembered_children() -> None:
    registry = CollectorRegistry()
    counter = Counter("c", "c", ["model"], registry=registry)
    counter.labels("a").inc(5)
    counter.remove("a")
    counter.labels("a").inc()
    assert 'c_total{model="a"} 1.0' in generate_latest(registry).decode()
    counter.clear()
    counter.labels("a").inc()
    assert 'c_total{model="a"} 1.0' in generate_latest(registry).decode()
