"""How an engine's metrics page is read: `MetricSpec`, `EngineMapping`, and the mapping rules.

Each engine module of this package (`vllm.py`, `sglang.py`, `trtllm.py`, `llamacpp.py`) declares
one `EngineMapping` per engine: which Prometheus families mean queue, load, KV and LoRA. The
registry (`registry.py`) picks one per endpoint by `Endpoint.engine` (from the
`inference.networking.k8s.io/engine-type` label, default `vllm`; gie.md §4.1).

Rules (the documented decisions of this module):
- Several matching series (vLLM data parallelism: `engine="0"`, `engine="1"`; several models
  in one server) are combined: queues are summed, KV utilisation is the maximum (the fullest
  engine decides whether a request fits).
- Partial updates are accepted, as upstream: a core signal (waiting, running, KV) that is
  missing or not a finite number keeps its previous value, and the result's `error` says
  `partial: ...` while `updated_at` is still stamped (the other signals are fresh). If no core
  signal is present at all the page is rejected with `MissingMetrics` (wrong engine type, or not
  a metrics page), and the scraper keeps the old metrics and their old `updated_at`.
- An engine that exports no KV signal (llama.cpp) declares no KV families: its KV usage stays
  0.0 and its pages are never partial for the want of one.
- Static cache config (block size, GPU blocks) keeps its previous value when absent; `"None"`
  or a non-integer label reads as unknown (None).
- LoRA (vLLM): `lora_requests_info` is one series per label combination whose value is a unix
  time. Series with both adapter lists empty are ignored (upstream: adapters stay resident after
  their requests finish, so the last non-empty set is the better guess); of the rest the one
  with the largest value wins: `running_lora_adapters` → active_adapters,
  `waiting_lora_adapters` → waiting_adapters, `max_lora` → max_adapters. If every series is
  empty, adapters are empty and max_lora comes from the newest series. An absent family means
  no LoRA: empty sets and 0.
- Served (base) model (vLLM, SGLang): the `model_name` label of the waiting gauge's series, else
  the running gauge's (both engines label every metric with it). Series that disagree (several
  models in one server) or lack the label read as unknown (None); with neither gauge on the
  page the previous value is kept. Other engines: None. Only labels of families already read
  are looked at, so this costs the parser nothing.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Final

from poolkeeper.backend.promtext import FamilyFilter, Sample
from poolkeeper.datastore.endpoint import EndpointMetrics

__all__ = ["EngineMapping", "EngineType", "IntField", "MetricSpec", "MissingMetrics", "specs"]

_EMPTY: Final[Mapping[str, str]] = MappingProxyType({})
_SPEC_RE: Final = re.compile(r"^\s*([a-zA-Z_:][a-zA-Z0-9_:]*)\s*(?:\{(.*)\})?\s*$")


class MissingMetrics(ValueError):
    """A page with none of the engine's core families: wrong engine type, or not metrics."""


@dataclass(frozen=True, slots=True)
class MetricSpec:
    """A family plus label filters that must all match, written `name{label=value,...}`."""

    family: str
    labels: Mapping[str, str] = field(default_factory=lambda: _EMPTY, hash=False)

    @classmethod
    def parse(cls, text: str) -> MetricSpec:
        """Parse the upstream flag syntax, e.g. `nv_trt_llm_request_metrics{request_type=waiting}`.

        Raises ValueError naming the bad part.
        """
        match = _SPEC_RE.match(text)
        if match is None:
            raise ValueError(f"invalid metric spec {text!r}: expected name{{label=value,...}}")
        labels: dict[str, str] = {}
        body = (match.group(2) or "").strip()
        for part in filter(None, (p.strip() for p in body.split(","))):
            label, sep, value = part.partition("=")
            if not sep or not label.strip():
                raise ValueError(f"invalid label filter {part!r} in metric spec {text!r}")
            labels[label.strip()] = value.strip().strip('"')
        return cls(match.group(1), MappingProxyType(labels))

    def select(self, families: Mapping[str, Sequence[Sample]]) -> list[Sample]:
        """The samples of this family whose labels match every filter."""
        samples = families.get(self.family, ())
        if not self.labels:
            return [s for s in samples if s.name == self.family]
        items = self.labels.items()
        return [
            s
            for s in samples
            if s.name == self.family and all(s.labels.get(k) == v for k, v in items)
        ]

    def __str__(self) -> str:
        if not self.labels:
            return self.family
        return self.family + "{" + ",".join(f"{k}={v}" for k, v in self.labels.items()) + "}"


@dataclass(frozen=True, slots=True)
class IntField:
    """An optional integer read from a label of the first matching series, or from its value."""

    spec: MetricSpec
    label: str | None = None


def _count(number: float) -> int | None:
    return int(number) if math.isfinite(number) and number >= 0 else None


def _ints(text: str) -> int | None:
    try:
        number = float(text)
    except ValueError:
        return None
    return _count(number)


def _adapters(value: str | None) -> frozenset[str]:
    if not value:
        return frozenset()
    return frozenset(name for part in value.split(",") if (name := part.strip()))


@dataclass(frozen=True, slots=True)
class EngineMapping:
    """How to read one engine's metrics page into `EndpointMetrics`."""

    name: str
    waiting: tuple[MetricSpec, ...]  # alternatives in order of preference
    running: tuple[MetricSpec, ...]
    kv_usage: tuple[MetricSpec, ...]  # empty: the engine exports none (KV reads 0.0)
    lora_info: MetricSpec | None = None
    block_size: IntField | None = None
    num_gpu_blocks: IntField | None = None
    served_model_label: str | None = None  # label naming the base model on the queue gauges
    reader: FamilyFilter = field(init=False, compare=False, hash=False, repr=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "reader", FamilyFilter(self.wanted))

    @property
    def wanted(self) -> frozenset[str]:
        """Every family this mapping reads (the parser skips all others)."""
        specs: list[MetricSpec] = [*self.waiting, *self.running, *self.kv_usage]
        if self.lora_info is not None:
            specs.append(self.lora_info)
        specs.extend(f.spec for f in (self.block_size, self.num_gpu_blocks) if f is not None)
        return frozenset(s.family for s in specs)

    def read(self, text: bytes | str, previous: EndpointMetrics, now: float) -> EndpointMetrics:
        """Parse a page and map it (raises PromParseError or MissingMetrics)."""
        return self.to_metrics(self.reader.parse(text), previous, now)

    def to_metrics(
        self, families: Mapping[str, Sequence[Sample]], previous: EndpointMetrics, now: float
    ) -> EndpointMetrics:
        """Map parsed families to metrics stamped `now` (see the module rules)."""
        notes: list[str] = []
        waiting = self._gauge(self.waiting, families, "waiting", notes, total=True)
        running = self._gauge(self.running, families, "running", notes, total=True)
        kv = (
            self._gauge(self.kv_usage, families, "KV usage", notes, total=False)
            if self.kv_usage
            else None  # not exported (llama.cpp): not a partial page, KV stays 0.0
        )
        if waiting is None and running is None and kv is None:
            raise MissingMetrics(
                f"no usable {self.name} metrics on the page ({'; '.join(notes)}); "
                "is the endpoint's engine type right?"
            )
        active, waiting_adapters, max_adapters = self._lora(families, notes)
        served = self._served_model(families, previous.served_model)
        return EndpointMetrics(
            waiting=previous.waiting if waiting is None else max(0, round(waiting)),
            running=previous.running if running is None else max(0, round(running)),
            kv_cache_usage=previous.kv_cache_usage if kv is None else min(1.0, max(0.0, kv)),
            active_adapters=active,
            waiting_adapters=waiting_adapters,
            max_adapters=max_adapters,
            block_size=self._int_field(self.block_size, families, previous.block_size),
            num_gpu_blocks=self._int_field(self.num_gpu_blocks, families, previous.num_gpu_blocks),
            updated_at=now,
            error=("partial: " + "; ".join(notes)) if notes else None,
            served_model=served,
        )

    def _served_model(
        self, families: Mapping[str, Sequence[Sample]], previous: str | None
    ) -> str | None:
        label = self.served_model_label
        if label is None:
            return None
        for spec in (*self.waiting, *self.running):
            samples = spec.select(families)
            if not samples:
                continue
            names = {s.labels.get(label) for s in samples}
            # One name on every series, or unknown: a wrong guess would pin a base-model
            # request's affinity to a server that does not serve it.
            if len(names) != 1:
                return None
            return names.pop() or None  # a missing or empty label is unknown too
        return previous

    @staticmethod
    def _gauge(
        specs: tuple[MetricSpec, ...],
        families: Mapping[str, Sequence[Sample]],
        what: str,
        notes: list[str],
        *,
        total: bool,
    ) -> float | None:
        for spec in specs:
            samples = spec.select(families)
            if not samples:
                continue
            values = [s.value for s in samples]
            if not all(math.isfinite(v) for v in values):
                notes.append(f"{spec} is not a finite number")
                return None
            return sum(values) if total else max(values)
        notes.append(f"{what} missing ({' or '.join(str(s) for s in specs)})")
        return None

    def _lora(
        self, families: Mapping[str, Sequence[Sample]], notes: list[str]
    ) -> tuple[frozenset[str], frozenset[str], int]:
        if self.lora_info is None:
            return frozenset(), frozenset(), 0
        series = [s for s in self.lora_info.select(families) if not math.isnan(s.value)]
        if not series:
            return frozenset(), frozenset(), 0
        newest = max(series, key=lambda s: s.value)
        busy = [
            s
            for s in series
            if s.labels.get("running_lora_adapters") or s.labels.get("waiting_lora_adapters")
        ]
        chosen = max(busy, key=lambda s: s.value) if busy else newest
        max_lora_text = chosen.labels.get("max_lora", "")
        max_lora = _ints(max_lora_text) if max_lora_text else 0
        if max_lora is None:
            notes.append(f"{self.lora_info.family} has an invalid max_lora {max_lora_text!r}")
            max_lora = 0
        return (
            _adapters(chosen.labels.get("running_lora_adapters")),
            _adapters(chosen.labels.get("waiting_lora_adapters")),
            max_lora,
        )

    @staticmethod
    def _int_field(
        spec: IntField | None, families: Mapping[str, Sequence[Sample]], previous: int | None
    ) -> int | None:
        if spec is None:
            return previous
        samples = spec.spec.select(families)
        if not samples:
            return previous
        first = samples[0]
        if spec.label is None:
            return _count(first.value)
        text = first.labels.get(spec.label)
        return None if text is None else _ints(text)


def specs(*texts: str) -> tuple[MetricSpec, ...]:
    """Parse each `name{label=value,...}` text (alternatives, in order of preference)."""
    return tuple(MetricSpec.parse(t) for t in texts)


@dataclass(frozen=True, slots=True)
class EngineType:
    """One model-server engine: the name endpoints use for it, and how its page is read."""

    name: str  # canonical: what labels and config resolve to, and what endpoints carry
    title: str  # the product's own spelling, for docs and messages
    mapping: EngineMapping
    aliases: tuple[str, ...] = ()  # other accepted spellings (lower case)
    # The server answers every request under its own model name, whatever the request's
    # `model` said (llama.cpp), so the gateway gives each response the client's name back even
    # when no split or rewrite renamed the request (requestcontrol `RoutingDecision`).
    names_responses_itself: bool = False

    def __post_init__(self) -> None:
        if self.mapping.name != self.name:
            raise ValueError(f"engine {self.name!r} has the mapping of {self.mapping.name!r}")
        if any(a != a.strip().lower() or a == self.name for a in self.aliases):
            raise ValueError(f"engine {self.name!r}: aliases must be lower case and new")
