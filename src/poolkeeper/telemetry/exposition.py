"""/metrics as upstream's Go client exposes it: no `_created` series, llm-d-router's second
names for families that have one (`telemetry/llmd.py`, `telemetry/llmd_families.py`), and
(unless `objective_names=False`) every `inference_model_*` family also as
`inference_objective_*`, the v1.1+ name, with the same samples."""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping

from prometheus_client import CollectorRegistry
from prometheus_client.core import Metric
from prometheus_client.metrics import MetricWrapperBase
from prometheus_client.registry import Collector
from prometheus_client.samples import Sample

from poolkeeper.telemetry.llmd import ALSO_AS
from poolkeeper.telemetry.llmd_families import ALSO_AS as FAMILIES_ALSO_AS

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
MODEL_PREFIX = "inference_model_"
OBJECTIVE_PREFIX = "inference_objective_"


class Exposition:
    """The registry as upstream's Go client exposes it: no `_created` samples, and the
    `inference_model_*` families repeated as `inference_objective_*` when asked."""

    def __init__(self, registry: CollectorRegistry, *, objective_names: bool) -> None:
        self.registry = registry
        self.objective_names = objective_names

    def collect(self) -> Iterator[Metric]:
        return self._expose(self.registry.collect())

    def snapshot(self) -> Snapshot:
        """The page's families in two parts: the collectors that read the EPP's state (pools,
        queues, the scheduler, connections) collected now, on the caller's thread (the event
        loop, where that state changes); prometheus_client's own instruments left for
        `Snapshot.collect`, which may run on a worker thread: they are thread-safe, and with many
        label values they are nearly all of a page (1,000 fairness ids of one model: 64 MB,
        3 s of rendering that held every request on the loop; outside audit).

        So the page is no longer one instant: the EPP-state families are as of the snapshot, the
        instruments as of their collection a moment later (a histogram's `_sum` may count one
        observation its `_count` does not yet, or the reverse). Where the registry lacks the
        private attributes read here (a prometheus_client other than 0.20-0.26 may), everything
        is collected now, on the caller's thread, and only the text is left for later."""
        # The registry's collectors in registration order, as `CollectorRegistry.collect`
        # copies them (no public accessor exists; present in prometheus_client 0.20 to 0.26).
        lock = getattr(self.registry, "_lock", None)
        names = getattr(self.registry, "_collector_to_names", None)
        if lock is None or names is None:
            return Snapshot(self, [list(self.registry.collect())])
        with lock:
            collectors: list[Collector] = list(names)
        parts: list[Collector | list[Metric]] = [
            c if isinstance(c, MetricWrapperBase) else list(c.collect()) for c in collectors
        ]
        return Snapshot(self, parts)

    def _expose(self, families: Iterable[Metric]) -> Iterator[Metric]:
        for family in families:
            samples = [s for s in family.samples if not s.name.endswith("_created")]
            yield _copy(family, family.name, samples)
            also = ALSO_AS.get(family.name) or _ALSO_AS_MORE.get(family.name)
            if also is None and family.type == "counter":
                also = _ALSO_AS_MORE.get(family.name + "_total")
            if also is not None:
                yield _renamed(family, samples, *also)
            if (
                self.objective_names
                and family.name.startswith(MODEL_PREFIX)
                and family.name not in _OBJECTIVE_OWN
            ):
                renamed = OBJECTIVE_PREFIX + family.name.removeprefix(MODEL_PREFIX)
                yield _copy(
                    family,
                    renamed,
                    [
                        s._replace(name=OBJECTIVE_PREFIX + s.name.removeprefix(MODEL_PREFIX))
                        for s in samples
                    ],
                )


class Snapshot:
    """`Exposition.snapshot`'s page: `collect` may run on any thread."""

    def __init__(self, exposition: Exposition, parts: list[Collector | list[Metric]]) -> None:
        self._exposition = exposition
        self._parts = parts

    def collect(self) -> Iterator[Metric]:
        return self._exposition._expose(self._families())

    def _families(self) -> Iterator[Metric]:
        for part in self._parts:
            yield from part if isinstance(part, list) else part.collect()


# More families under a second name (counters by their `_total` name).
_ALSO_AS_MORE: Mapping[str, tuple[str, Mapping[str, str]]] = FAMILIES_ALSO_AS
# v0.5 families whose v1.x twin is an instrument of its own (labels differ: `priority`).
_OBJECTIVE_OWN = frozenset({"inference_model_request"})


def _renamed(family: Metric, samples: list[Sample], name: str, labels: Mapping[str, str]) -> Metric:
    """`family` under llm-d-router's name (and label names)."""
    base = name.removesuffix("_total") if family.type == "counter" else name
    renamed = [
        s._replace(
            name=base + s.name.removeprefix(family.name),
            labels={labels.get(k, k): v for k, v in s.labels.items()},
        )
        for s in samples
    ]
    return _copy(family, name, renamed)


def _copy(family: Metric, name: str, samples: list[Sample]) -> Metric:
    if family.type == "counter":
        name = name.removesuffix("_total")
    out = Metric(name, family.documentation, family.type, family.unit)
    out.samples = samples
    return out
