"""Policies that are poolkeeper's real scheduler (and admission controller) on a preset.

- `poolkeeper-shed`: the `default` scheduling preset and the default AdmissionConfig (Sheddable
  shed at pool saturation 1.0, Standard at 8.0, Critical never): `poolkeeper serve` with
  `flowControl.enabled: false`, i.e. poolkeeper before flow control. (`poolkeeper` itself, with
  flow control, is `bench.policies.flowpolicy`.)
- `poolkeeper-ttft-shed` / `poolkeeper-backlog-shed`: the same on the `predicted-ttft` /
  `prefill-backlog` presets.
- `gie-v1`: the `gie-v1-default` preset (queue 2, kv-cache 2, prefix 3, scraped metrics only)
  with GIE v1's admission: only Sheddable requests are shed, when the pool is saturated
  (queue 5 / KV 0.8 thresholds), judged on scraped metrics only.
- `gie-v0.3`: the `gie-v0.3-decision-tree` preset; its tree itself drops non-critical requests
  when no endpoint has capacity (there was no separate admission step in v0.3).
- `poolkeeper-proposed`: the change to poolkeeper's default profile that the benchmark tuning
  suggests (docs/notes/2026-12-02-tuning-the-default-profile.md): no saturation filter (it
  pushed requests away from the endpoints holding their prefix exactly when the fleet was
  busy), plain min-max queue (2) and running-requests (1) scores counting unseen requests, KV
  (2), prefix (3) and LoRA affinity (2); default admission.

Every scheduler-backed policy observes speed as a router would: at `pick` it notes when and
where each request went, at `on_finish` it feeds the elapsed virtual time and the request's
output tokens (its `max_tokens`, which the simulator serves in full) into an `ObservedSpeed`,
and the next decisions see `EndpointState.seconds_per_output_token`.
"""

from __future__ import annotations

import copy
import random
from collections.abc import Sequence
from typing import Any

from poolkeeper.bench.policies.stepfeed import StepFeed
from poolkeeper.datastore.endpoint import EndpointState
from poolkeeper.datastore.speed import ObservedSpeed
from poolkeeper.flowcontrol.admission import AdmissionConfig
from poolkeeper.flowcontrol.shedding import AdmissionController
from poolkeeper.scheduling.build import build_scheduler
from poolkeeper.scheduling.candidate_presets import CANDIDATES, candidate_document
from poolkeeper.scheduling.config import SchedulingConfig
from poolkeeper.scheduling.presets import preset_document
from poolkeeper.scheduling.scheduler import Scheduler
from poolkeeper.scheduling.types import LLMRequest
from poolkeeper.sim.virtual import VirtualFleet

# Flow-controlled policy (`flowpolicy`) -> its scheduling preset; `<name>-shed` is the same
# preset with admission's shedding instead of flow control.
FLOW_PRESETS: dict[str, str] = {
    "poolkeeper": "default",
    "poolkeeper-ttft": "predicted-ttft",
    "poolkeeper-backlog": "prefill-backlog",
}
# Candidates for the default profile (issue 38, `scheduling.candidate_presets.CANDIDATES`), each
# named so that it can be compared: run only when named (`bench sim --policies`), like the
# reference policies.
CANDIDATE_PRESETS: dict[str, str] = {
    "poolkeeper-drain": "prefill-backlog-drain",
    "poolkeeper-span": "prefill-backlog-span",
    "poolkeeper-span4k": "prefill-backlog-span4k",
    "poolkeeper-w1": "prefill-backlog-w1",
    "poolkeeper-w0": "prefill-backlog-w0",
    "poolkeeper-drain-span": "prefill-backlog-drain-span",
    "poolkeeper-marginal": "prefill-backlog-marginal",
    "poolkeeper-mean-span": "prefill-backlog-mean-span",
    "poolkeeper-busy": "prefill-backlog-busy",
    "poolkeeper-drain-busy": "prefill-backlog-drain-busy",
    "poolkeeper-drain-marginal": "prefill-backlog-drain-marginal",
    "poolkeeper-fade": "prefill-backlog-fade",
    "poolkeeper-answered-wait": "prefill-backlog-answered-wait",
    "poolkeeper-fade-only": "prefill-backlog-fade-only",
    "poolkeeper-fade-early": "prefill-backlog-fade-early",
    # the same preset with flow control's `holdNewPrefixes` (`flowpolicy.HOLD_POLICIES`)
    "poolkeeper-fade-early-hold": "prefill-backlog-fade-early",
    "poolkeeper-fade-rise": "prefill-backlog-fade-rise",
    "poolkeeper-fade-rise3": "prefill-backlog-fade-rise3",
    "poolkeeper-full-batch": "default-full-batch",
    "poolkeeper-cold-spread": "default-cold-spread",
    "poolkeeper-fade-early-cold-spread": "prefill-backlog-fade-early-cold-spread",
    "poolkeeper-fade-cold-spread": "prefill-backlog-fade-cold-spread",
    "poolkeeper-miss-gate": "default-miss-gate",
    "poolkeeper-miss-gate-aw": "default-miss-gate-aw",
    "poolkeeper-pa-miss-gate": "prefix-affinity-miss-gate",
    "poolkeeper-pa-miss-gate-fade": "prefix-affinity-miss-gate-fade-early",
    "poolkeeper-fade-early-miss-gate": "prefill-backlog-fade-early-miss-gate",
    # the default with its speed scorer at 1.5 (heterogeneous at overload; not the default)
    "poolkeeper-speed15": "default-speed15",
    # the default before issue 38's switch (the `classic` preset, without flow control's
    # `holdNewPrefixes`: `flowpolicy.NO_HOLD_POLICIES`), to compare the switch against
    "poolkeeper-classic": "classic",
    # the default plus the step-phase-scorer fed the engines' KV-batch step ends (`stepfeed`)
    "poolkeeper-stepclock": "default-stepclock",
    "poolkeeper-stepclock-w1": "default-stepclock-w1",
    "poolkeeper-stepclock-w4": "default-stepclock-w4",
    "poolkeeper-stepclock-w8": "default-stepclock-w8",
    "poolkeeper-stepclock-w16": "default-stepclock-w16",
    "poolkeeper-stepclock-late5ms": "default-stepclock-w4",
    # the control for the step-clock policies: the default with decode-step fusing off on the
    # engines as `stepfeed` turns it off (`NO_FUSE_POLICIES`), no step-phase scorer
    "poolkeeper-nofuse": "default",
}
# Policies whose engines run unfused (`max_fused_steps = 1`), as `stepfeed.StepFeed.bind` does.
NO_FUSE_POLICIES: frozenset[str] = frozenset({"poolkeeper-nofuse"})
# KV batches reach the step-phase scorer this late (`stepfeed`; default `DEFAULT_LATE_S`, 1 ms).
STEP_FEED_LATE_S: dict[str, float] = {"poolkeeper-stepclock-late5ms": 0.005}
_PRESET = {
    **{f"{k}-shed": v for k, v in (FLOW_PRESETS | CANDIDATE_PRESETS).items()},
    "gie-v1": "gie-v1-default",
    "gie-v0.3": "gie-v0.3-decision-tree",
}

PROPOSED_PROFILE: dict[str, Any] = {
    "plugins": [
        {"type": "queue-scorer"},
        {"type": "running-requests-size-scorer"},
        {"type": "kv-cache-utilization-scorer"},
        {"type": "prefix-cache-scorer"},
        {"type": "lora-affinity-scorer"},
        {"type": "max-score-picker", "parameters": {"maxNumOfEndpoints": 4}},
    ],
    "schedulingProfiles": [
        {
            "name": "default",
            "plugins": [
                {"pluginRef": "queue-scorer", "weight": 2},
                {"pluginRef": "running-requests-size-scorer", "weight": 1},
                {"pluginRef": "kv-cache-utilization-scorer", "weight": 2},
                {"pluginRef": "prefix-cache-scorer", "weight": 3},
                {"pluginRef": "lora-affinity-scorer", "weight": 2},
                {"pluginRef": "max-score-picker"},
            ],
        }
    ],
}


class SchedulerPolicy:
    """Admission (optional) then `Scheduler.schedule`; the primary target is the pick."""

    def __init__(
        self, name: str, scheduler: Scheduler, admission: AdmissionController | None
    ) -> None:
        self.name = name
        self.scheduler = scheduler
        self.admission = admission
        self.speed = ObservedSpeed()
        self._learns = scheduler.observes_first_tokens
        self.step_feed = StepFeed.of(scheduler)  # KV-batch step ends for step-phase scorers
        # request id -> (endpoint ip:port, sent at, expected output tokens)
        self._sent: dict[str, tuple[str, float, int]] = {}

    @property
    def observes_first_tokens(self) -> bool:
        """Whether the scheduler learns from first tokens (then `serve` has them reported as
        they happen, and the fleet shows which unseen requests answered)."""
        return self._learns

    def bind(self, fleet: VirtualFleet) -> None:
        if self.name.removesuffix("-shed") in NO_FUSE_POLICIES:
            for engine in fleet.engines:
                engine.max_fused_steps = 1
        if self.step_feed is not None:
            self.step_feed.bind(fleet)

    def pick(
        self, request: LLMRequest, endpoints: Sequence[EndpointState], now: float
    ) -> EndpointState:
        if self.step_feed is not None:
            self.step_feed.flush(now)
        if len(self.speed):
            endpoints = self.speed.apply(endpoints)
        if self.admission is not None:
            self.admission.admit(request, endpoints, now=now)
        chosen = self.scheduler.schedule(request, endpoints, now=now).primary
        self._sent[request.request_id] = (chosen.key, now, request.max_tokens or 0)
        return chosen

    def on_finish(self, request_id: str, server: str, now: float) -> None:
        sent = self._sent.pop(request_id, None)
        if sent is not None:
            key, started, tokens = sent
            self.speed.observe(key, now - started, tokens)
            if self.step_feed is not None:
                self.step_feed.done(request_id, now, tokens)
        if self._learns:
            self.scheduler.request_ended(request_id)

    def on_first_token(self, request_id: str, now: float) -> None:
        if self.step_feed is not None:
            self.step_feed.flush(now)
        if self._learns:
            self.scheduler.observe_first_token(request_id, None, now)


def scheduling_document(name: str) -> dict[str, Any]:
    """The scheduling document (a copy) of a scheduler-backed policy `name` (`-shed` or not:
    both run the same preset); KeyError naming the known presets for any other name."""
    if name == "poolkeeper-proposed":
        return copy.deepcopy(PROPOSED_PROFILE)
    preset = _PRESET.get(name, _PRESET.get(f"{name}-shed", ""))
    if not preset:
        known = ", ".join(sorted({*_PRESET, "poolkeeper-proposed"}))
        raise KeyError(f"{name!r} is not a scheduler-backed policy (those are: {known})")
    if preset in CANDIDATES:
        return candidate_document(preset)
    return preset_document(preset)


def scheduler_policy(
    name: str, rng: random.Random, document: dict[str, Any] | None = None
) -> SchedulerPolicy:
    """`document`: the scheduling document to run instead of the policy's own (a variant of
    it, e.g. with one more filter); admission is still the policy's."""
    doc = scheduling_document(name) if document is None else document
    scheduler = build_scheduler(SchedulingConfig.model_validate(doc), rng=rng)
    admission: AdmissionController | None
    if name.startswith("poolkeeper-") and (name.endswith("-shed") or name == "poolkeeper-proposed"):
        admission = AdmissionController(AdmissionConfig())
    elif name == "gie-v1":
        admission = AdmissionController(
            AdmissionConfig(standard_overload_level=None, count_unseen=False)
        )
    else:
        admission = None
    policy = SchedulerPolicy(name, scheduler, admission)
    late = STEP_FEED_LATE_S.get(name.removesuffix("-shed"))
    if policy.step_feed is not None and late is not None:
        policy.step_feed.late_s = late
        for scorer in policy.step_feed.scorers:  # the horizon: batches may be this late
            scorer.clock.late_s = max(scorer.clock.late_s, late)
    return policy
