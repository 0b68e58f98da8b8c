"""/metrics as upstream's Go client exposes it: no `_created` series, llm-d-router's second
names for families that have one (`telemetry/llmd.py`, `telemetry/llmd_families.py`), and
(unless `objective_names=False`) every `inference_model_*` family also as
`inference_objective_*`, the v1.1+ name, with the same samples."""

from __future__ import annotations

from collections.abc import Iterator, Mapping

from prometheus_client import CollectorRegistry
from prometheus_client.core import Metric
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
        for family in self.registry.collect():
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
