"""`build_director`: the one way a Director is built from a GatewayConfig (runtime and tests).

Wires the real collaborators into the Director's ports: the scheduler the `scheduling` section
describes, the admission controller, the in-flight tracker, flow control's headroom check on
admission's saturation detector (one saturation signal), and the datastore subscription that
wakes waiting requests when fresh metrics may mean headroom.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable

from poolkeeper.config.gateway import GatewayConfig
from poolkeeper.datastore.inflight import InflightTracker
from poolkeeper.datastore.store import Datastore
from poolkeeper.flowcontrol.headroom import Headroom
from poolkeeper.flowcontrol.shedding import AdmissionController
from poolkeeper.requestcontrol.director import Director
from poolkeeper.requestcontrol.flowgate import FlowObserver
from poolkeeper.requestcontrol.ports import SnapshotSource
from poolkeeper.scheduling.build import build_scheduler


def build_director(
    config: GatewayConfig,
    datastore: SnapshotSource,
    *,
    rng: random.Random,
    clock: Callable[[], float] = time.monotonic,
    flow_observer: FlowObserver | None = None,
    responses_observed: bool = False,
) -> Director:
    """The Director `config.spec` describes, with its scheduler, admission controller and
    in-flight tracker: the one way a Director is built (the runtime and tests alike). Raises
    ConfigError for a scheduling section that cannot be built. `responses_observed`: the
    response observer is on (server/runtime.py), so usage is injected only into responses
    that still pass the EPP (those whose model name it rewrites).
    """
    spec = config.spec
    staleness_s = spec.scraping.staleness_s
    admission = AdmissionController(spec.admission, staleness_s=staleness_s)
    director = Director(
        datastore=datastore,
        scheduler=build_scheduler(spec.scheduling, rng=rng, staleness_s=staleness_s),
        inflight=InflightTracker(),
        admission=admission,
        config=spec.request_handling,
        rng=rng,
        clock=clock,
        flow_control=spec.flow_control,
        headroom=Headroom(admission.detector),  # the one saturation signal, shared
        flow_observer=flow_observer,
        responses_observed=responses_observed,
    )
    gate = director.flow
    if gate is not None and isinstance(datastore, Datastore):
        # Fresh metrics may mean headroom: let waiting requests re-check (free when none wait).
        datastore.subscribe(lambda _snapshot, _kind: gate.wake(), metrics=True)
    return director
