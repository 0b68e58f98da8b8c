"""Slot dispatch on a LoRA fleet: the EPP's in-flight
requests for adapters a server defers (waiting there with no adapter slot) hold no batch slot;
the others do."""

from __future__ import annotations

from dataclasses import replace

from poolkeeper.datastore.endpoint import EndpointState
from poolkeeper.flowcontrol.admission import AdmissionConfig
from poolkeeper.flowcontrol.config import FlowControlConfig
from poolkeeper.flowcontrol.headroom import Headroom
from poolkeeper.flowcontrol.saturation import SaturationDetector
from poolkeeper.flowcontrol.slots import deferred, holding, queued
from tests.scheduling.sched_factories import NOW, state

STANDARD = FlowControlConfig().bands.standard


def _headroom() -> Headroom:
    return Headroom(SaturationDetector(AdmissionConfig()))


def _lora(
    i: int, models: dict[str, int], *, running: int, waiting: int, **kw: object
) -> EndpointState:
    """A server running lora-a whose queue holds lora-b requests (no adapter slot for lora-b),
    with the EPP's in-flight requests there by model."""
    s = state(
        i, running=running, waiting=waiting, active=("lora-a",),
        queued_adapters=("lora-a", "lora-b"), inflight=sum(models.values()), **kw,  # type: ignore[arg-type]
    )  # fmt: skip
    return replace(s, inflight_models=models)


def test_only_requests_for_adapters_without_a_slot_are_deferred() -> None:
    s = _lora(1, {"lora-a": 3, "lora-b": 5, "base": 1}, running=4, waiting=5)
    assert (deferred(s), holding(s), queued(s)) == (5, 4, 0)
    # Without a per-model count (a router that does not say) nothing is deferred.
    bare = replace(s, inflight_models={})
    assert (deferred(bare), holding(bare), queued(bare)) == (0, 9, 5)
    # No adapter waits without a slot: nothing is deferred, whatever the counts.
    plain = replace(state(2, running=4, waiting=2, inflight=6), inflight_models={"lora-b": 6})
    assert deferred(plain) == 0


def test_slot_dispatch_decides_when_by_the_requests_that_hold_batch_slots() -> None:
    """Seen running 8, a server may take 6 more (the band's allowance): 8 lora-a requests
    in flight and 7 deferred lora-b ones leave room (counted as before, 15 did not); 14
    lora-a ones do not, however few are deferred. Where a request goes stays the
    scheduler's choice among all (adapter affinity)."""
    h = _headroom()
    roomy = _lora(1, {"lora-a": 8, "lora-b": 7}, running=8, waiting=7)
    busy = _lora(2, {"lora-a": 14, "lora-b": 1}, running=8, waiting=1)
    assert h.room([roomy, busy], STANDARD, NOW, "lora-a") == [roomy, busy]
    assert list(h.within([roomy, busy], STANDARD, NOW, adapter="lora-a")) == [roomy, busy]
    assert h.room([roomy], STANDARD, NOW, "lora-a") == [roomy]
    assert h.room([busy], STANDARD, NOW, "lora-a") is None  # held in the EPP's fair order


def test_a_queue_of_only_deferred_requests_is_not_a_queue_for_slot_dispatch() -> None:
    """Sharing flows contend where a server queues (`queueing`): the EPP's own deferred
    requests waiting for an adapter slot do not make a queue; a request waiting beyond them
    does."""
    h = _headroom()
    only_deferred = _lora(1, {"lora-a": 2, "lora-b": 3}, running=2, waiting=3)
    assert not h.queueing([only_deferred])
    assert h.queueing([replace(only_deferred, metrics=replace(only_deferred.metrics, waiting=4))])
