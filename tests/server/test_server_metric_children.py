"""The remembered-children metric classes export exactly what prometheus_client's do."""

from __future__ import annotations

import pytest
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


def test_values_equal_in_python_but_not_as_labels_stay_apart() -> None:
    """1, 1.0 and True are one dict key but the labels "1", "1.0" and "True", as in
    prometheus_client (which labels by str(value)), whichever is asked for first."""
    registry = CollectorRegistry()
    counter = Counter("c", "c", ["n"], registry=registry)
    for value, times in ((1, 1), (1.0, 2), (True, 3), ("1", 4)):
        for _ in range(times):
            counter.labels(value).inc()
    text = generate_latest(registry).decode()
    assert 'c_total{n="1"} 5.0' in text
    assert 'c_total{n="1.0"} 2.0' in text
    assert 'c_total{n="True"} 3.0' in text


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


def test_a_histogram_observes_into_the_buckets_prometheus_client_would() -> None:
    """Bisection against prometheus_client's own walk: every bound, between them, beyond the
    last, negative, +Inf and NaN (in no bucket), with and without labels, and an exemplar."""
    import prometheus_client

    ours, theirs = CollectorRegistry(), CollectorRegistry()
    buckets = (0.0, 0.001, 0.5, 1, 10, 2048)
    values = [-1.0, 0.0, 1e-9, 0.001, 0.0011, 0.5, 0.75, 1, 9.99, 10, 11, 2048, 1e9]
    values += [float("inf"), float("nan"), 3]
    for registry, cls in ((ours, Histogram), (theirs, prometheus_client.Histogram)):
        labelled = cls("h", "h", ["model"], buckets=buckets, registry=registry)
        plain = cls("p", "p", buckets=buckets, registry=registry)
        for value in values:
            labelled.labels("m").observe(value)
            plain.observe(value)
        labelled.labels("m").observe(0.6, {"trace_id": "abc"})

    def samples(registry: CollectorRegistry) -> list[str]:
        text = generate_latest(registry).decode()
        return [line for line in text.splitlines() if "_created" not in line]  # a timestamp

    assert samples(ours) == samples(theirs)
    assert 'h_bucket{le="1.0",model="m"} 9.0' in samples(ours)  # -1 .. 1 and the 0.6
    unlabelled = Histogram("u", "u", ["model"], registry=CollectorRegistry())
    with pytest.raises(ValueError, match="missing label values"):
        unlabelled.observe(1.0)  # the parent of labelled children refuses, as prometheus_client
