"""Small builders for scheduler tests: endpoint states, requests, schedulers."""

from __future__ import annotations

import random
from typing import Any

from poolkeeper.api.criticality import Criticality
from poolkeeper.datastore.endpoint import (
    DEFAULT_STALENESS_S,
    Endpoint,
    EndpointMetrics,
    EndpointState,
)
from poolkeeper.scheduling.build import build_scheduler
from poolkeeper.scheduling.config import SchedulingConfig, preset_config
from poolkeeper.scheduling.interfaces import CycleState
from poolkeeper.scheduling.scheduler import Scheduler
from poolkeeper.scheduling.types import LLMRequest

NOW = 100.0


def state(
    i: int,
    *,
    waiting: int = 0,
    running: int = 0,
    kv: float = 0.0,
    active: tuple[str, ...] = (),
    queued_adapters: tuple[str, ...] = (),
    max_adapters: int = 0,
    updated_at: float = NOW - 0.01,
    unseen: int = 0,
    unseen_tokens: int = 0,
    inflight: int = 0,
    inflight_tokens: int = 0,
    num_gpu_blocks: int | None = None,
    block_size: int | None = None,
    served_model: str | None = None,
) -> EndpointState:
    """Endpoint `pod{i}` at 10.0.0.{i}:8000 with the given metrics (fresh by default)."""
    return EndpointState(
        Endpoint(f"pod{i}", f"10.0.0.{i}", 8000),
        EndpointMetrics(
            waiting=waiting,
            running=running,
            kv_cache_usage=kv,
            active_adapters=frozenset(active),
            waiting_adapters=frozenset(queued_adapters),
            max_adapters=max_adapters,
            updated_at=updated_at,
            num_gpu_blocks=num_gpu_blocks,
            block_size=block_size,
            served_model=served_model,
        ),
        inflight_requests=max(inflight, unseen),
        inflight_tokens=max(inflight_tokens, unseen_tokens),
        unseen_requests=unseen,
        unseen_tokens=unseen_tokens,
    )


def key(i: int) -> str:
    return f"10.0.0.{i}:8000"


def request(
    target: str = "base",
    *,
    criticality: Criticality = Criticality.STANDARD,
    prompt: str = "",
    request_id: str = "r1",
    model: str = "m",
) -> LLMRequest:
    return LLMRequest(
        request_id, model, target, criticality=criticality, prompt=prompt,
        prompt_tokens=len(prompt) // 4,
    )  # fmt: skip


def cycle() -> CycleState:
    return CycleState(NOW)


def scheduler(doc: dict[str, Any] | str, seed: int = 1) -> Scheduler:
    """A scheduler from a config dict or a preset name."""
    config = preset_config(doc) if isinstance(doc, str) else SchedulingConfig.model_validate(doc)
    return build_scheduler(config, rng=random.Random(seed))


def single(plugin: dict[str, Any], weight: float | None = None) -> dict[str, Any]:
    """A config with one plugin (plus the default picker) in one profile."""
    ref: dict[str, Any] = {"pluginRef": plugin.get("name", plugin["type"])}
    if weight is not None:
        ref["weight"] = weight
    return {"plugins": [plugin], "schedulingProfiles": [{"name": "p", "plugins": [ref]}]}


def plugin(
    type_: str,
    params: dict[str, Any] | None = None,
    seed: int = 1,
    staleness_s: float = DEFAULT_STALENESS_S,
) -> Any:
    """One built-in plugin instance, built the way the scheduler builds it."""
    from poolkeeper.scheduling.interfaces import TypedName
    from poolkeeper.scheduling.plugins.builtins import builtin_registry
    from poolkeeper.scheduling.registry import BuildContext

    spec = builtin_registry().get(type_)
    assert spec is not None, type_

    def no_refs(name: str) -> Any:
        raise AssertionError(f"unexpected reference to {name}")

    ctx = BuildContext(rng=random.Random(seed), resolve_filter=no_refs, staleness_s=staleness_s)
    return spec.factory(TypedName(type_, type_), spec.params.model_validate(params or {}), ctx)


def scores_of(scorer: Any, req: LLMRequest, cands: list[EndpointState]) -> list[float]:
    """The scorer's scores as a list (a constant expanded to every candidate)."""
    from poolkeeper.scheduling.interfaces import AffineScores

    out = scorer.score(cycle(), req, cands)
    if isinstance(out, float | int):
        return [float(out)] * len(cands)
    if isinstance(out, AffineScores):
        return out.materialize()
    return list(out)
