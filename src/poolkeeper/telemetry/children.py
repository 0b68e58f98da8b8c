"""prometheus_client's metric classes with their labelled children remembered.

`labels(...)` of prometheus_client checks the label count, converts every value with `str`
and looks the child up under a lock: about 6 µs a call, and the EPP makes about 20 such calls
per request (its own families and llm-d's, when it routes and when the request ends): a
fifth of its route work (`bench.overhead.route_profile`). These classes keep each child in a
plain dict by the values as given, so a repeated label set costs one dict lookup. What a
child is and how it is exported does not change; `remove` and `clear` forget the remembered
children with the metric's own.
"""

from __future__ import annotations

from bisect import bisect_left
from typing import Any

import prometheus_client

__all__ = ["Counter", "Gauge", "Histogram"]


class _Remembered:
    """Mixed into a prometheus_client metric class before it (`labels` is looked up here)."""

    _children: dict[tuple[object, ...], Any]

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self._children = {}
        super().__init__(*args, **kwargs)

    def labels(self, *values: object, **named: object) -> Any:
        if named:
            return super().labels(*values, **named)  # type: ignore[misc]
        try:
            return self._children[values]
        except KeyError:
            child = super().labels(*values)  # type: ignore[misc]
            # Only strings are remembered: prometheus_client labels by str(value), and 1, 1.0
            # and True are one dict key but three label values ("1", "1.0", "True").
            if all(type(value) is str for value in values):
                self._children[values] = child
            return child

    def remove(self, *values: Any) -> None:
        self._children.clear()
        super().remove(*values)  # type: ignore[misc]

    def clear(self) -> None:
        self._children.clear()
        super().clear()  # type: ignore[misc]


class Counter(_Remembered, prometheus_client.Counter):
    pass


class Gauge(_Remembered, prometheus_client.Gauge):
    pass


class Histogram(_Remembered, prometheus_client.Histogram):
    """`observe` finds the bucket by bisection where prometheus_client walks the bounds in a
    Python loop (tens of them for token and size histograms; ~16 observations per request).
    The same bucket: the first bound >= the value, +Inf last. NaN (in no bucket there), an
    exemplar and the unlabelled parent (which refuses) take prometheus_client's own path."""

    _observable = False

    def _metric_init(self) -> None:  # prometheus_client calls it for observable metrics only
        super()._metric_init()
        self._observable = True

    def observe(self, amount: float, exemplar: dict[str, str] | None = None) -> None:
        if exemplar or not self._observable or amount != amount:
            super().observe(amount, exemplar)
            return
        self._sum.inc(amount)
        self._buckets[bisect_left(self._upper_bounds, amount)].inc(1)
