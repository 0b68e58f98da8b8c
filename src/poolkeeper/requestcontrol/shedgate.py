"""`ShedGate`: the Director's gate when flow control is off (`flowControl.enabled: false`).

Nothing waits: a request is admitted and scheduled at once, or shed with 429 by
`flowcontrol/shedding.py`'s `AdmissionController` (criticality against the pool's saturation,
on the candidates the scheduler will see, with this router's in-flight counts). Synchronous;
`wait` and `withdraw` are never reached, because `submit` never queues.
"""

from __future__ import annotations

from collections.abc import Callable

from poolkeeper.api.criticality import Criticality
from poolkeeper.flowcontrol.flowitem import FlowItem
from poolkeeper.flowcontrol.shedding import AdmissionController
from poolkeeper.requestcontrol.ports import Job
from poolkeeper.requestcontrol.types import RoutingDecision


class ShedGate:
    """The `Gate` (requestcontrol/ports.py) that admits or sheds; see the module docstring."""

    __slots__ = ("_clock", "admission")

    def __init__(self, admission: AdmissionController, *, clock: Callable[[], float]) -> None:
        self.admission = admission
        self._clock = clock

    def submit(self, job: Job) -> RoutingDecision:
        """Schedule `job` now, unless admission sheds it (RequestShed, 429)."""
        states = job.states()
        now = self._clock()
        self.admission.admit(job, states, now=now)
        return job.run(states, now)

    async def wait(self, item: FlowItem[Job]) -> RoutingDecision:
        raise AssertionError("ShedGate never queues")  # pragma: no cover

    def withdraw(self, item: FlowItem[Job]) -> None:
        raise AssertionError("ShedGate never queues")  # pragma: no cover

    def completed(self, pool: str, flow: str, band: Criticality, output_tokens: int) -> None:
        """Nothing to account: without a queue there is no fairness to charge."""
