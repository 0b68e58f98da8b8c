"""Per-endpoint step clocks: when a new request's prefill would finish, from the engines' own
step timestamps (issue #38; docs/notes/2026-12-07-kv-step-clock.md).

A continuous-batching engine gives a request its first token at the end of the step that ran
its prefill, and a request that arrives mid-step waits for that step to end. So on an idle-ish
pool the wait a router can still choose is the *phase* of each server's forward pass: the time
left in the step in progress, then one step with the new prefill in it. vLLM publishes one
KV-event batch per engine step that stored or evicted a block (95 % of steps below capacity),
stamped `ts` by the engine as the step ends: the step clock. A batch that reaches the router
late only delays when it learns of that end, not where the end was.

Per endpoint, a `StepLearner` (`steplearner.py`, pure) counts the steps between the known step
ends (batches, first bytes, ends) and learns the four-term step model from them, anchored by
each request's output tokens at its end; `prefill_done_s` then gives:

- the last known step end K (the learner's boundary: a batch, a first byte or an end, or a send
  to an endpoint the clock had idle);
- the step that began at K holds the prefill of only what was sent by K; it ends at K + its
  modelled length, and not before the horizon `now - late_s` (it would have been reported);
- past that, steps of the model's length for all that is outstanding follow back to back;
- the answer: the end of the step in progress - now + one modelled step with the new
  request's uncached prefill in it.

Neutral where it cannot know: an endpoint with no batch within `stale_s` (an engine that
publishes no events, or none lately), or whose learner has not got its step counts to agree
with the usage counts yet (`require_fit`; a queue in the engine or chunked prefills keep it
there: a shared-prefix pool at 0.9x restarted six times in 15 s), has no clock
(`prefill_done_s` is None), so the scorer gives every such endpoint the same score. The
clock takes the times it is given as the engines' (one clock: live, the subscriber maps the
batches' wall-clock `ts` to the loop's).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from poolkeeper.scheduling.steplearner import Coefficients, StepLearner


@dataclass(slots=True)
class EndpointClock:
    """One endpoint's learner and when its last batch was stamped."""

    learner: StepLearner
    last_batch: float | None = None
    batches: int = 0


@dataclass(slots=True)
class StepClock:
    """The step clocks of a pool's endpoints (see the module docstring)."""

    prior: Coefficients
    stale_s: float = 0.5  # no batch within this: no clock (neutral)
    late_s: float = 0.002  # batches reach the router at most this late (the horizon)
    require_fit: bool = True  # no clock until the learner's counts agree (its fit took over)
    clocks: dict[str, EndpointClock] = field(default_factory=dict)
    where: dict[str, str] = field(default_factory=dict)  # request id -> endpoint

    def __post_init__(self) -> None:
        if len(self.prior) != 4 or min(self.prior) < 0.0 or self.prior[0] <= 0.0:
            raise ValueError(f"prior must be 4 coefficients >= 0, overhead > 0: {self.prior}")
        if self.stale_s <= 0.0 or self.late_s < 0.0:
            raise ValueError(f"stale_s must be > 0 and late_s >= 0: {self.stale_s}, {self.late_s}")

    def _clock(self, endpoint: str) -> EndpointClock:
        clock = self.clocks.get(endpoint)
        if clock is None:
            clock = self.clocks[endpoint] = EndpointClock(StepLearner(self.prior))
        return clock

    def step_ended(self, endpoint: str, ts: float) -> None:
        """A KV-event batch from `endpoint`, stamped `ts` by its engine: a step ended then."""
        clock = self._clock(endpoint)
        clock.learner.step_ended(ts)
        clock.batches += 1
        if clock.last_batch is None or ts > clock.last_batch:
            clock.last_batch = ts

    def sent(
        self, endpoint: str, request_id: str, prompt_tokens: int, cached: int, now: float
    ) -> None:
        """A request sent to `endpoint` with `cached` of its prompt tokens probably cached."""
        uncached = min(max(0, prompt_tokens - cached), prompt_tokens)
        self._clock(endpoint).learner.sent(request_id, prompt_tokens, now, prompt_tokens - uncached)
        self.where[request_id] = endpoint

    def first_token(self, request_id: str, now: float) -> None:
        endpoint = self.where.get(request_id)
        if endpoint is not None and endpoint in self.clocks:
            self.clocks[endpoint].learner.observed(request_id, now, first=True, out=None)

    def ended(self, request_id: str, now: float | None, output_tokens: int | None) -> None:
        """The request ended at `now` (a step end; None: when is unknown, so it only leaves
        the batch) with `output_tokens` (the usage; None if unknown)."""
        endpoint = self.where.pop(request_id, None)
        if endpoint is None or endpoint not in self.clocks:
            return
        learner = self.clocks[endpoint].learner
        if now is not None:
            learner.observed(request_id, now, first=False, out=output_tokens)
        else:  # no step end to count: just no longer waiting or decoding
            learner.waiting.pop(request_id, None)
            learner.decoding.pop(request_id, None)

    def forget_endpoints(self, keep: set[str]) -> None:
        for endpoint in [e for e in self.clocks if e not in keep]:
            del self.clocks[endpoint]
        self.where = {r: e for r, e in self.where.items() if e in keep}

    def fresh(self, endpoint: str, now: float) -> bool:
        clock = self.clocks.get(endpoint)
        return (
            clock is not None
            and clock.last_batch is not None
            and now - clock.last_batch <= self.stale_s
            and (clock.learner.fitting or not self.require_fit)
        )

    def prefill_done_s(self, endpoint: str, uncached: int, prompt: int, now: float) -> float | None:
        """Seconds from `now` until a request with `uncached` of `prompt` tokens to prefill
        would have its first token on `endpoint`; None without a fresh clock there."""
        if not self.fresh(endpoint, now):
            return None
        learner = self.clocks[endpoint].learner
        learner.advance(now)
        decoding, context = len(learner.decoding), learner.context()
        prefill_all, prompt_all = learner.prefill_sent(math.inf), learner.prompt_sent(math.inf)
        own = learner.step_s(prefill_all + uncached, decoding, context + prompt_all + prompt)
        if not learner.busy():
            return own  # an idle engine starts a step when the request arrives
        known = learner.boundary if learner.group_at is None else learner.group_at
        if known is None or known > now:
            return learner.step_s(prefill_all, decoding, context + prompt_all) / 2 + own
        held = learner.step_s(
            learner.prefill_sent(known), decoding, context + learner.prompt_sent(known)
        )
        end = max(known + held, now - self.late_s)  # not reported by the horizon: not ended
        if end < now:  # later steps hold everything sent, back to back
            step = learner.step_s(prefill_all, decoding, context + prompt_all)
            end += step * (1 + (now - end) // step)
        return end - now + own
