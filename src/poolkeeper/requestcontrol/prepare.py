"""What the Director makes of a request before the gate: its target model and band, the
`Prepared` request, the scheduler's `LLMRequest` built from it (client control headers
dropped), and the questions flow control asks the scheduler's facts about it.

Decisions (see docs/configuration.md, "Request handling"):
- Which InferenceModel a modelName means is the datastore's answer (`DatastoreSnapshot.resolve`,
  `datastore/models.py`): oldest wins, within a pool and across pools.
- Target model, first that applies: the InferenceModel's targetModels split; the pool's
  InferenceModelRewrite rule for the name (exact, else generic); the trusted
  `x-gateway-model-name-rewrite` header; the name itself.
- Band: the InferenceObjective named by a trusted `x-gateway-inference-objective` header (in
  the request's pool; priority > 0 Critical, 0 Standard, < 0 Sheddable), else the
  InferenceModel's criticality, else Standard at priority 0 (a rewrite-routed name, policy
  Passthrough) or Sheddable (policy PassthroughSheddable). Unknown objective names are
  ignored, as upstream does (priority 0).
- Bodyless requests (e.g. GET /v1/models) go to a random endpoint of the default pool
  (`requestHandling.defaultPool`, else the only pool, else the first pool by key); no model
  lookup, no gate, no in-flight accounting.
- The subset hint comes from proxy metadata, never from client headers; entries match endpoints
  by IP (upstream behaviour). Client `x-gateway-*` headers are dropped before the scheduler sees
  the request, so no plugin can be steered by them.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from poolkeeper.api.criticality import (
    Criticality,
    criticality_of_priority,
    effective_criticality,
)
from poolkeeper.api.model import InferenceModel
from poolkeeper.api.objective import DEFAULT_PRIORITY
from poolkeeper.datastore.endpoint import EndpointState
from poolkeeper.requestcontrol.body import ParsedRequest
from poolkeeper.requestcontrol.config import UnknownModelPolicy
from poolkeeper.requestcontrol.ports import PrefillFactsLike, SnapshotView
from poolkeeper.requestcontrol.sends import DirectorObserver
from poolkeeper.requestcontrol.split import choose_rewrite_target, choose_target_model
from poolkeeper.requestcontrol.types import IncomingRequest
from poolkeeper.scheduling.types import LLMRequest

log = logging.getLogger("poolkeeper.requestcontrol.director")  # the Director's lines, as before

_CONTROL_HEADER_PREFIX = "x-gateway-"
_CONTROL_NAME_START = "\n" + _CONTROL_HEADER_PREFIX


@dataclass(slots=True)
class Prepared:
    """A request once the Director knows what it is: parsed, resolved and split, banded. What
    scheduling it needs, now or (after waiting in flow control) later. Read-only by
    convention (not `frozen`: its `__init__` would cost 2-3x, per request)."""

    request: IncomingRequest
    parsed: ParsedRequest
    pool_key: str
    target: str  # the model sent to the server
    criticality: Criticality
    priority: int | None  # the objective's priority, when one decided the band


def trusted(request: IncomingRequest, names: tuple[str, ...]) -> str | None:
    """A control header's value in one of `names` (its spellings the operator trusts, the
    llm-d one first), else None."""
    for name in names:
        value = request.headers.get(name, "").strip()
        if value:
            return value
    return None


def target_model(
    request: IncomingRequest,
    snapshot: SnapshotView,
    pool_key: str,
    name: str,
    model: InferenceModel | None,
    rng: random.Random,
    observer: DirectorObserver | None,
    rewrite_names: tuple[str, ...],
) -> str:
    """The model sent to the server (see the module docstring for the order); `rewrite_names`:
    the trusted spellings of the model-name rewrite header."""
    if model is not None and model.spec.target_models:
        return choose_target_model(model, rng)
    rule = snapshot.rewrite_rule(pool_key, name)
    if rule is not None:
        target = choose_rewrite_target(rule, rng)
        if observer is not None:
            observer.model_rewritten(rule.rewrite, name, target)
        return target
    return trusted(request, rewrite_names) or name


def band(
    request: IncomingRequest,
    snapshot: SnapshotView,
    pool_key: str,
    model: InferenceModel | None,
    passthrough: bool,
    objective_names: tuple[str, ...],
    policy: UnknownModelPolicy | None,
) -> tuple[Criticality, int | None]:
    """(criticality band, objective priority or None) of the request; `objective_names`: the
    trusted spellings of the objective header, `policy`: `unknownModelPolicy`."""
    wanted = trusted(request, objective_names)
    objective = snapshot.objective(pool_key, wanted) if wanted is not None else None
    if objective is not None:
        return objective.criticality, objective.priority
    if model is not None:
        return effective_criticality(model.spec.criticality), None
    if passthrough and policy is UnknownModelPolicy.PASSTHROUGH_SHEDDABLE:
        return Criticality.SHEDDABLE, None
    return criticality_of_priority(DEFAULT_PRIORITY), DEFAULT_PRIORITY


def scheduler_request(prepared: Prepared, subset: frozenset[str] | None, key: str) -> LLMRequest:
    """The request as the scheduler sees it (`subset`: the proxy's hint, when honoured;
    `key`: the send's key)."""
    request, parsed = prepared.request, prepared.parsed
    return LLMRequest(
        request_id=request.request_id,
        model=parsed.model,
        target_model=prepared.target,
        criticality=prepared.criticality,
        priority=prepared.priority,
        prompt=parsed.prompt,
        prompt_tokens=parsed.prompt_tokens,
        max_tokens=parsed.max_tokens,
        stream=parsed.stream,
        headers=scheduler_headers(request.headers),
        subset=subset,
        send_key=key,
    )


def scheduler_headers(headers: Mapping[str, str]) -> Mapping[str, str]:
    """Request headers without the gateway's control headers (never trusted from clients)."""
    # One C-level search over the names joined, not a `startswith` per header on every
    # request; a name that only looks like one after a newline just takes the exact path.
    if _CONTROL_NAME_START not in "\n" + "\n".join(headers):
        return headers
    return {k: v for k, v in headers.items() if not k.startswith(_CONTROL_HEADER_PREFIX)}


def prefill_question(
    facts: PrefillFactsLike | None, clock: Callable[[], float], llm_request: LLMRequest
) -> Callable[[list[EndpointState]], tuple[Callable[[], int], list[int]]]:
    """`Job.prefill`: the scheduler's two facts for `holdNewPrefixes`, asked afresh each
    time (the prefix index and the backlogs move while the request is held); the prefix
    match only when the backlogs call for it (`PrefixHold.holds`)."""
    assert facts is not None

    def uncached() -> int:
        try:
            return facts.uncached_tokens(llm_request, clock())
        except Exception:  # a bug in a plugin must not hold (or kill the pump): let it go
            log.exception("internal error asking whether to hold %s", llm_request.request_id)
            return 0

    def ask(candidates: list[EndpointState]) -> tuple[Callable[[], int], list[int]]:
        return uncached, facts.backlogs(candidates, clock())  # (claims expire on the clock)

    return ask


def cached_question(
    facts: PrefillFactsLike | None, clock: Callable[[], float], llm_request: LLMRequest
) -> Callable[[], dict[str, int]]:
    """`Job.cached`: the request's prefix match per endpoint, asked afresh each time (a
    band's `avoidPrefillUnlessCached`)."""
    assert facts is not None

    def cached() -> dict[str, int]:
        try:
            return facts.cached_tokens(llm_request, clock())
        except Exception:  # a bug in a plugin must not kill the pump: avoid as without it
            rid = llm_request.request_id
            log.exception("internal error reading the prefix match of %s", rid)
            return {}

    return cached
