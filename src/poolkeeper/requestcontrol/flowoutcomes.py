"""What the flow-control gate (`flowgate.py`) answers and records: the queue outcomes it
reports (upstream's `inference_extension_flow_control_*` names), how a `holdNewPrefixes` hold
ended, the observer that receives both (`FlowObserver`, implemented by telemetry), the error a
refused request gets (`refusal`: rule, outcome and message per dispatcher verdict), and how a
decision reaches the request's waiting future (`deliver`, `fail`).

No state of its own: the gate keeps the totals and the observer, and logs each refusal.
"""

from __future__ import annotations

from typing import Protocol

from poolkeeper.api.criticality import Criticality
from poolkeeper.errors import GatewayError, QueueFull, RequestShed
from poolkeeper.flowcontrol.config import FlowControlConfig
from poolkeeper.flowcontrol.dispatcher import FlowDispatcher
from poolkeeper.flowcontrol.flowitem import FlowItem, Submitted
from poolkeeper.requestcontrol.ports import Job
from poolkeeper.requestcontrol.types import RoutingDecision

# Upstream's flow-control queue outcomes (inference_extension_flow_control_* metrics).
DISPATCHED = "Dispatched"
REJECTED_CAPACITY = "RejectedCapacity"
REJECTED_OTHER = "RejectedOther"
EVICTED_TTL = "EvictedTTL"
EVICTED_CANCELLED = "EvictedContextCancelled"

# How a `holdNewPrefixes` hold ended (poolkeeper_flow_control_hold_duration_seconds).
HOLD_RELEASED = "released"  # the rule let it go (a prefix placed, a backlog fell)
HOLD_CAPPED = "capped"  # `maxHoldMs` reached while the rule still held it
HOLD_CANCELLED = "cancelled"  # the client went away (or the caller could not wait)


class FlowObserver(Protocol):
    """Metrics hook (telemetry implements it)."""

    def flow_outcome(
        self,
        *,
        pool: str,
        band: Criticality,
        model: str,
        target: str,
        fairness_id: str,
        priority: int,
        outcome: str,
        waited_s: float,
    ) -> None: ...

    def flow_held(self, *, pool: str, band: Criticality, outcome: str, held_s: float) -> None:
        """A `holdNewPrefixes` hold ended (`HOLD_*`) after `held_s` seconds."""
        ...


def refusal(
    verdict: Submitted,
    item: FlowItem[Job],
    dispatcher: FlowDispatcher[Job],
    config: FlowControlConfig,
) -> tuple[str, str, GatewayError]:
    """The outcome, the rule (logged) and the error of an arrival the dispatcher refused
    (`FULL`, `SATURATED`, or a `shed` band's `SHED`)."""
    job = item.payload
    band = job.criticality
    if verdict is Submitted.FULL:
        return REJECTED_CAPACITY, "band_full", QueueFull(
            f"the {band} queue of pool {job.pool} is full")  # fmt: skip
    if verdict is Submitted.SATURATED:
        wait = dispatcher.expected_wait(item) or 0.0
        return REJECTED_CAPACITY, "cannot_drain", QueueFull(
            f"pool {job.pool} is saturated: the {band} requests ahead of this one would "
            f"take {wait:.1f} s to drain at the measured rate, longer than the "
            f"{config.bands.of(band).ttl_ms} ms it may wait")  # fmt: skip
    return REJECTED_OTHER, "shed_mode", RequestShed(
        f"pool {job.pool} has no endpoint below the {band} saturation limit "
        f"({config.bands.of(band).saturation_limit:g}) and {band} requests do not "
        "queue")  # fmt: skip


def deliver(job: Job, decision: RoutingDecision) -> None:
    """Hand a decision made after the request began to wait to its future (nobody waits any
    more: the in-flight accounting it started ends, `abandon`)."""
    future = job.future
    if future is None or future.done():
        job.abandon(decision)  # nobody waits for it any more
    else:
        future.set_result(decision)


def fail(item: FlowItem[Job], exc: GatewayError) -> None:
    """Fail a waiting request (if it still waits)."""
    future = item.payload.future
    if future is not None and not future.done():
        future.set_exception(exc)
