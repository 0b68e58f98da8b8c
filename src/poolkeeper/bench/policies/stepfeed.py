"""The engines' KV-batch step ends, fed to a scheduler's `step-phase-scorer`s in virtual time.

Live, the EPP's KV subscriber receives one batch per engine step that stored or evicted a block,
stamped `ts` by the engine, and is to call `StepPhaseScorer.step_ended(endpoint, ts)`. Here each
engine's step hook (`EngineModel.step_observer`) and KV sink go to a `StepEventRecorder` with
vLLM's publish rule (`kv_event_phase.py`: a step in which some request's computed tokens cross a
block boundary, or that evicted a block), and each publishing step's end reaches the scorers
`late_s` after it (fixed: the batch's transit and the EPP's loop), at the next decision or
report from then on, still stamped with the step's end. Ends are told with their usage (the
simulator serves `max_tokens`), which the scorer's step learner anchors its counts on.

Decode-step fusing is turned off on the engines (`max_fused_steps = 1`, as the reference
policies do: the same results step by step), so that every step's end is seen.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from functools import partial

from poolkeeper.bench.policies.kv_event_phase import StepEventRecorder
from poolkeeper.scheduling.plugins.stepphase_scorer import StepPhaseScorer
from poolkeeper.scheduling.scheduler import Scheduler
from poolkeeper.sim.virtual import VirtualFleet

DEFAULT_LATE_S = 0.001  # the brief's middle case: batches 1 ms late


class StepFeed:
    """Publishing steps' ends, on their way to the scorers (see the module docstring)."""

    __slots__ = ("late_s", "order", "queue", "recorders", "scorers")

    def __init__(self, scorers: Sequence[StepPhaseScorer], late_s: float = DEFAULT_LATE_S) -> None:
        if late_s < 0.0:
            raise ValueError(f"late_s must be >= 0, got {late_s}")
        self.scorers = tuple(scorers)
        self.late_s = late_s
        self.queue: list[tuple[float, int, str, float]] = []  # (seen, order, endpoint, ts)
        self.order = 0
        self.recorders: dict[str, StepEventRecorder] = {}

    @classmethod
    def of(cls, scheduler: Scheduler, late_s: float = DEFAULT_LATE_S) -> StepFeed | None:
        """A feed for the scheduler's step-phase scorers (None if it has none)."""
        scorers = [p for p in scheduler.plugins.values() if isinstance(p, StepPhaseScorer)]
        return cls(scorers, late_s) if scorers else None

    def bind(self, fleet: VirtualFleet) -> None:
        for endpoint, engine in zip(fleet.endpoints, fleet.engines, strict=True):
            engine.max_fused_steps = 1
            recorder = StepEventRecorder(engine.kv.sink, engine.config.block_size, rule="vllm")
            recorder.on_publish = partial(self._published, endpoint.hostport)
            engine.kv.sink = recorder
            engine.step_observer = recorder.step_ended
            self.recorders[endpoint.hostport] = recorder

    def _published(self, endpoint: str, ts: float) -> None:
        self.order += 1
        heapq.heappush(self.queue, (ts + self.late_s, self.order, endpoint, ts))

    def flush(self, now: float) -> None:
        """Deliver every batch seen by `now`, in the order seen."""
        queue = self.queue
        while queue and queue[0][0] <= now:
            _, _, endpoint, ts = heapq.heappop(queue)
            for scorer in self.scorers:
                scorer.step_ended(endpoint, ts)

    def done(self, request_id: str, now: float, output_tokens: int) -> None:
        self.flush(now)
        for scorer in self.scorers:
            scorer.request_done(request_id, now, output_tokens)
