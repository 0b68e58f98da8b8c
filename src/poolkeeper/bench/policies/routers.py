"""Every policy the benchmarks compare, behind one small interface.

`make_policy(name, rng, scenario)` builds a fresh policy for one run:

- the baselines of `bench.policies.baselines` (round-robin, random, least-request, power-of-two,
  cache-aware, dynamo-kv, aibrix-prefix);
- `gie-v0.3` and `gie-v1`: poolkeeper's real scheduler configured with the GIE presets (the
  v0.3 decision tree; the v1.x default profile queue 2 / kv-cache 2 / prefix 3);
- `poolkeeper`: poolkeeper's real scheduler with its default profile behind flow control
  (queueing by criticality band, fair sharing between models), exactly as the EPP runs them
  (`bench.policies.flowpolicy`); such a policy also has `offer` and `release` (`QueueingPolicy`);
- `poolkeeper-shed`: the same scheduler with admission's shedding and no queue (poolkeeper
  before flow control, `flowControl.enabled: false`);
- `poolkeeper-proposed`: the default-profile change the tuning suggests
  (bench.policies.schedpolicy);
- `poolkeeper-ttft` / `poolkeeper-backlog`: the same flow control in front of the
  `predicted-ttft` / `prefill-backlog` presets (`-shed`: with admission's shedding instead).
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from typing import Protocol, runtime_checkable

from poolkeeper.bench.policies.baselines import BASELINES
from poolkeeper.bench.policies.kv_event_phase import KV_EVENT_POLICIES
from poolkeeper.bench.policies.learned_phase import LEARNED_PHASE_POLICIES
from poolkeeper.bench.policies.reference_policies import REFERENCE_POLICIES
from poolkeeper.bench.policies.schedpolicy import CANDIDATE_PRESETS, FLOW_PRESETS
from poolkeeper.bench.workload.scenarios import Scenario
from poolkeeper.datastore.endpoint import EndpointState
from poolkeeper.errors import ConfigError
from poolkeeper.flowcontrol.config import FlowControlConfig
from poolkeeper.scheduling.types import LLMRequest


class RoutingPolicy(Protocol):
    name: str

    def pick(
        self, request: LLMRequest, endpoints: Sequence[EndpointState], now: float
    ) -> EndpointState:
        """The chosen endpoint; raises RequestShed / NoReadyEndpoint to refuse the request."""
        ...

    def on_finish(self, request_id: str, server: str, now: float) -> None: ...

    def on_first_token(self, request_id: str, now: float) -> None:
        """The request's first token reached the router (a TTFT observation)."""
        ...


@runtime_checkable
class QueueingPolicy(RoutingPolicy, Protocol):
    """A policy that may hold requests (flow control): `offer` returns None to hold."""

    def offer(
        self, request: LLMRequest, endpoints: Sequence[EndpointState], now: float
    ) -> EndpointState | None: ...

    def release(
        self,
        endpoints: Sequence[EndpointState],
        now: float,
        send: Callable[[str, EndpointState | None, str | None], None],
    ) -> None: ...


SCHEDULER_POLICIES: tuple[str, ...] = (
    "gie-v0.3", "gie-v1", "poolkeeper", "poolkeeper-shed", "poolkeeper-proposed",
    "poolkeeper-ttft", "poolkeeper-ttft-shed", "poolkeeper-backlog", "poolkeeper-backlog-shed",
)  # fmt: skip
ALL_POLICIES: tuple[str, ...] = (*BASELINES, *SCHEDULER_POLICIES)
# Candidates for the default profile (`schedpolicy.CANDIDATE_PRESETS`), with and without flow
# control; like the reference policies, run only when asked for by name.
CANDIDATE_POLICIES: tuple[str, ...] = tuple(n for c in CANDIDATE_PRESETS for n in (c, f"{c}-shed"))
# Run only when asked for by name (never by default: `ref-oracle` takes minutes per point).
REFERENCES = {**REFERENCE_POLICIES, **KV_EVENT_POLICIES, **LEARNED_PHASE_POLICIES}
KNOWN_POLICIES: tuple[str, ...] = (*ALL_POLICIES, *CANDIDATE_POLICIES, *REFERENCES)


def make_policy(
    name: str,
    rng: random.Random,
    scenario: Scenario | None = None,
    flow_control: FlowControlConfig | None = None,
) -> RoutingPolicy:
    """`flow_control`: the `spec.flowControl` of the flow-controlled policies (`poolkeeper`,
    `poolkeeper-ttft`); None = the defaults. The other policies have no flow control."""
    del scenario  # reserved: policies that need fleet facts (none yet)
    baseline = BASELINES.get(name)
    if baseline is not None:
        return baseline(rng)
    if name in FLOW_PRESETS or name in CANDIDATE_PRESETS:
        from poolkeeper.bench.policies.flowpolicy import flow_policy

        return flow_policy(name, rng, flow_control)
    reference = REFERENCES.get(name)
    if reference is not None:
        return reference(rng)
    if name in SCHEDULER_POLICIES or name in CANDIDATE_POLICIES:
        from poolkeeper.bench.policies.schedpolicy import scheduler_policy

        return scheduler_policy(name, rng)
    raise ConfigError(f"unknown policy {name!r}; known: {', '.join(KNOWN_POLICIES)}")
