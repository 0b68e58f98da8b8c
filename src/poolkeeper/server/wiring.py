"""Wiring: the one place the request path is composed from a GatewayConfig (runtime and tests).

`build_director` reads the config's sections and hands each part only its own: the Director
gets `requestHandling`, the scheduler `scheduling` (and the freshness of `scraping`), the gate
`admission` and `flowControl`. It wires the real collaborators into the Director's ports
(`requestcontrol/ports.py`): the scheduler, the in-flight tracker (`datastore/inflight.py`), the
gate (`build_gate`), the datastore subscription that wakes waiting requests when fresh
metrics may mean headroom, the one that tells the scheduler's endpoint followers (KV-event
subscriptions) the pool's endpoints, the KV-event batches into the step-phase scorers' clocks
(`_feed_step_clocks`), and the one that makes the scheduler forget what it keeps
per endpoint (prefix index, prefill backlog, TTFT model) for the endpoints that left the pool
for good (server/forgetting.py: absent past a grace, or replaced at the same ip:port).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import random
import time
from collections.abc import Callable
from pathlib import Path

from poolkeeper.config.gateway import GatewayConfig
from poolkeeper.datastore.inflight import InflightTracker
from poolkeeper.datastore.snapshot import DatastoreSnapshot
from poolkeeper.datastore.store import ChangeKind, Datastore, Listener
from poolkeeper.flowcontrol.admission import AdmissionConfig
from poolkeeper.flowcontrol.config import FlowControlConfig
from poolkeeper.flowcontrol.dispatcher import FlowPolicies
from poolkeeper.flowcontrol.headroom import Headroom
from poolkeeper.flowcontrol.shedding import AdmissionController
from poolkeeper.requestcontrol.director import Director
from poolkeeper.requestcontrol.flowgate import FlowGate
from poolkeeper.requestcontrol.flowoutcomes import FlowObserver
from poolkeeper.requestcontrol.ports import Gate, SnapshotSource
from poolkeeper.requestcontrol.shedgate import ShedGate
from poolkeeper.scheduling.build import build_scheduler
from poolkeeper.scheduling.prefillfacts import PrefillFacts
from poolkeeper.scheduling.scheduler import Scheduler
from poolkeeper.scheduling.steplive import StepBatchFeed, feeds
from poolkeeper.server.forgetting import FORGET_AFTER_S, EndpointForgetter

log = logging.getLogger(__name__)
# Bench only (scripts/live_stepclock.py): where to write the step clocks' state at the stop.
STEPCLOCK_LOG_ENV = "POOLKEEPER_BENCH_STEPCLOCK_LOG"


def build_director(
    config: GatewayConfig,
    datastore: SnapshotSource,
    *,
    rng: random.Random,
    clock: Callable[[], float] = time.monotonic,
    flow_observer: FlowObserver | None = None,
    responses_observed: bool = False,
    forget_after_s: float = FORGET_AFTER_S,
    on_stop: list[Callable[[], None]] | None = None,
) -> Director:
    """The Director `config.spec` describes, with its scheduler, gate and in-flight tracker:
    the one way a Director is built (the runtime and tests alike). Raises ConfigError for a
    scheduling section that cannot be built. `responses_observed`: the response observer is
    on (server/runtime.py), so usage is injected only into responses that still pass the EPP
    (those whose model name it rewrites). `forget_after_s`: how long an endpoint stays absent
    from the pool before the scheduler forgets it (server/forgetting.py). `on_stop`: where
    the runtime collects what to call when it stops (the forgetter's pending sweep, the
    KV-event follower's listener).
    """
    spec = config.spec
    staleness_s = spec.scraping.staleness_s
    gate = build_gate(
        spec.admission,
        spec.flow_control,
        staleness_s=staleness_s,
        clock=clock,
        flow_observer=flow_observer,
    )
    scheduler = build_scheduler(spec.scheduling, rng=rng, staleness_s=staleness_s, clock=clock)
    _feed_step_clocks(scheduler, clock, on_stop)
    # `holdNewPrefixes` and `avoidPrefillUnlessCached` ask the scheduler's plugins (prefix
    # index, prefill backlog) before dispatch; without them the Director asks nothing.
    hold = spec.flow_control.asks_prefill_facts and isinstance(gate, FlowGate)
    tracker = InflightTracker()
    director = Director(
        datastore=datastore,
        scheduler=scheduler,
        inflight=tracker,
        gate=gate,
        config=spec.request_handling,
        rng=rng,
        clock=clock,
        responses_observed=responses_observed,
        prefill_facts=PrefillFacts(scheduler) if hold else None,
    )
    if isinstance(gate, FlowGate) and isinstance(datastore, Datastore):
        # Fresh metrics may mean headroom: let waiting requests re-check (free when none wait).
        datastore.subscribe(lambda _snapshot, _kind: gate.wake(), metrics=True)
    if isinstance(datastore, Datastore):
        # Without it, an endpoint gone for good keeps its blocks, backlog and TTFT samples
        # until the caps push them out (memory and index room taken, and a new server at the
        # same ip:port would inherit them). Before the follower: a replaced endpoint's KV-event
        # subscription, dropped here, is made again by the follower on the same change.
        forgetter = EndpointForgetter(
            scheduler, datastore.snapshot(), clock=clock, grace_s=forget_after_s, tracker=tracker
        )
        unsubscribe = datastore.subscribe(forgetter)
        if on_stop is not None:
            on_stop.extend((unsubscribe, forgetter.stop))
    if scheduler.follows_endpoints and isinstance(datastore, Datastore):
        # KV-event subscriptions connect when the endpoints are known, not at a first decision.
        unfollow = datastore.subscribe(_endpoint_follower(scheduler), metrics=True)
        if on_stop is not None:
            on_stop.append(unfollow)
    return director


def _feed_step_clocks(
    scheduler: Scheduler, clock: Callable[[], float], on_stop: list[Callable[[], None]] | None
) -> None:
    """Each `step-phase-scorer` whose `prefixScorer` subscribes to exact KV events gets that
    subscriber's batches, on the decisions' clock (`scheduling/steplive.py`); one without
    them stays neutral (no batch, no clock), said once here. Bench only: with
    `STEPCLOCK_LOG_ENV` set, their clocks' state is written there (JSON) at the stop."""
    fed, neutral = feeds(scheduler.plugins)
    for prefix, scorers in fed.values():
        subscriber = prefix.subscriber
        assert subscriber is not None  # (`feeds` pairs only subscribing prefix scorers)
        subscriber.on_batch = StepBatchFeed(scorers, clock=clock, then=subscriber.on_batch)
    dump = os.environ.get(STEPCLOCK_LOG_ENV)
    if dump and fed and on_stop is not None:
        scorers = [s for _, group in fed.values() for s in group]

        def write() -> None:
            state = {s.typed_name.name: s.clock.describe() for s in scorers}
            Path(dump).write_text(json.dumps(state, indent=1))

        on_stop.append(write)
    for name in neutral:
        log.warning(
            "step-phase-scorer %r: its prefixScorer does not subscribe to exact KV events "
            "(kvEvents: true), so it gets no step clock and scores every endpoint alike",
            name,
        )


def _endpoint_follower(scheduler: Scheduler) -> Listener:
    """A datastore listener telling `scheduler` the endpoints after each change of them, on
    the running loop (the first metrics write after a change where none ran: files and
    watches may write before the loop starts; scrapes run on it)."""
    pending = True

    def listener(snapshot: DatastoreSnapshot, kind: ChangeKind) -> None:
        nonlocal pending
        if kind is not ChangeKind.METRICS:
            pending = True
        if not pending:
            return
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            return
        pending = False
        scheduler.follow_endpoints(e.hostport for e in snapshot.all_endpoints())

    return listener


def build_gate(
    admission: AdmissionConfig,
    flow_control: FlowControlConfig,
    *,
    staleness_s: float,
    clock: Callable[[], float] = time.monotonic,
    flow_observer: FlowObserver | None = None,
    policies: FlowPolicies | None = None,
) -> Gate:
    """The gate the sections describe: flow control's queue (`flowControl.enabled`) or admit
    or shed at once. Both judge saturation with admission's detector (one saturation signal).
    `policies`: flow control's fairness and ordering policies (default: today's)."""
    controller = AdmissionController(admission, staleness_s=staleness_s)
    if flow_control.enabled:
        headroom = Headroom(controller.detector)
        return FlowGate(
            flow_control, headroom, clock=clock, observer=flow_observer, policies=policies
        )
    return ShedGate(controller, clock=clock)
