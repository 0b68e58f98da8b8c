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

Neutral where it cannot know: an endpoint with requests outstanding and no batch within
`stale_s` (an engine that publishes no events, or none lately; an idle one publishes none and
keeps its clock: its next step starts when a request arrives), or whose learner has not got
its step counts to agree with the usage counts yet (`require_fit`; a queue in the engine or
chunked prefills keep it there: a shared-prefix pool at 0.9x restarted six times in 15 s), has
no clock (`prefill_done_s` is None), so the scorer gives every such endpoint the same score. The
clock takes the times it is given as the engines' (one clock: live, `steplive.py` maps the
batches' wall-clock `ts` to the decisions' clock).

Live (`back_date`), first bytes come 5-35 ms and ends 15-60 ms after their step, later than the
batches (1.5-5 ms), and the learner takes events in time order only. So:

- a first byte is dated by the batch that stored the request's last prompt block on its
  endpoint (`watch` at the send, `step_ended(..., firsts)` when the batch arrives: the step that
  stored its prompt is the one that produced its first token); its report then does nothing;
- a first byte no batch dated (a prompt shorter than a block, a full cache hit, which store
  nothing; a batch lost) joins the decoding set when it is reported, with no gap learnt from it
  and no count anchored at its end;
- an end is back-dated to `end_late_s` before its report and anchored on the steps counted
  by the last boundary before that (`history`), not grouped (its step is long closed).
"""

from __future__ import annotations

import math
from bisect import bisect_right
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from poolkeeper.scheduling.steplearner import Coefficients, StepLearner

HISTORY = 4096  # boundaries kept per endpoint for back-dating ends (~40 s of 10 ms steps)


@dataclass(slots=True)
class EndpointClock:
    """One endpoint's learner and when its last batch was stamped."""

    learner: StepLearner
    last_batch: float | None = None
    batches: int = 0
    # Live: request id -> the engine block hashes of its prompt, until a batch stores them all.
    watch: dict[str, tuple[int, ...]] = field(default_factory=dict)
    # Live: (boundary, steps counted, log r summed) after each batch, to back-date ends.
    history: deque[tuple[float, int, float]] = field(default_factory=lambda: deque(maxlen=HISTORY))
    dated: int = 0  # first bytes dated by a batch
    undated: int = 0  # first bytes reported with no batch to date them (not learnt from)

    def record(self) -> None:
        learner = self.learner
        if learner.boundary is not None and (
            not self.history or self.history[-1][0] < learner.boundary
        ):
            self.history.append((learner.boundary, learner.steps, learner.log_r))

    def at(self, when: float) -> tuple[int, float] | None:
        """(steps counted, log r) at the last recorded boundary at or before `when`."""
        i = bisect_right(self.history, when, key=lambda h: h[0])
        return None if i == 0 else self.history[i - 1][1:]


@dataclass(slots=True)
class StepClock:
    """The step clocks of a pool's endpoints (see the module docstring)."""

    prior: Coefficients
    stale_s: float = 0.5  # no batch within this: no clock (neutral)
    late_s: float = 0.002  # batches reach the router at most this late (the horizon)
    require_fit: bool = True  # no clock until the learner's counts agree (its fit took over)
    back_date: bool = False  # live: first bytes dated by batches, ends back-dated (docstring)
    end_late_s: float = 0.02  # live: an end's report comes this long after its step
    clocks: dict[str, EndpointClock] = field(default_factory=dict)
    where: dict[str, str] = field(default_factory=dict)  # request id -> endpoint
    unanchored: set[str] = field(default_factory=set)  # live: first byte not dated
    # Endpoints forgotten (`forget_endpoints`): a late batch does not revive their clock; a
    # send (the router picked it again) does.
    forgotten: set[str] = field(default_factory=set)

    def __post_init__(self) -> None:
        if len(self.prior) != 4 or min(self.prior) < 0.0 or self.prior[0] <= 0.0:
            raise ValueError(f"prior must be 4 coefficients >= 0, overhead > 0: {self.prior}")
        if self.stale_s <= 0.0 or self.late_s < 0.0:
            raise ValueError(f"stale_s must be > 0 and late_s >= 0: {self.stale_s}, {self.late_s}")
        if self.end_late_s < 0.0:
            raise ValueError(f"end_late_s must be >= 0: {self.end_late_s}")

    def _clock(self, endpoint: str) -> EndpointClock:
        clock = self.clocks.get(endpoint)
        if clock is None:
            clock = self.clocks[endpoint] = EndpointClock(StepLearner(self.prior))
        return clock

    def step_ended(self, endpoint: str, ts: float, firsts: Sequence[str] = ()) -> None:
        """A KV-event batch from `endpoint`, stamped `ts` by its engine: a step ended then,
        with the first tokens of `firsts` (watched requests whose prompt it stored) in it."""
        if endpoint in self.forgotten:
            return
        clock = self._clock(endpoint)
        learner = clock.learner
        learner.step_ended(ts)
        if learner.group_at == ts:  # taken (a batch out of order is not: nor its firsts)
            for request_id in firsts:
                if clock.watch.pop(request_id, None) is not None:
                    learner.observed(request_id, ts, first=True, out=None)
                    clock.dated += 1
        clock.record()
        clock.batches += 1
        if clock.last_batch is None or ts > clock.last_batch:
            clock.last_batch = ts

    def watch(self, endpoint: str, request_id: str, blocks: Sequence[int]) -> None:
        """Live: date the request's first byte by the batch that stores all of `blocks` (the
        engine block hashes of its prompt, not all cached on `endpoint` when it was sent)."""
        if self.where.get(request_id) == endpoint:
            self._clock(endpoint).watch[request_id] = tuple(blocks)

    def watched(self, endpoint: str) -> Mapping[str, tuple[int, ...]]:
        clock = self.clocks.get(endpoint)
        return {} if clock is None else clock.watch

    def sent(
        self,
        endpoint: str,
        request_id: str,
        prompt_tokens: int,
        cached: int,
        now: float,
        extra_prefill: int = 0,
    ) -> None:
        """A request sent to `endpoint` with `cached` of its prompt tokens probably cached and
        `extra_prefill` tokens' worth of work before it (its LoRA adapter's load)."""
        self.forgotten.discard(endpoint)
        uncached = min(max(0, prompt_tokens - cached), prompt_tokens) + max(0, extra_prefill)
        self._clock(endpoint).learner.sent(request_id, prompt_tokens, now, prompt_tokens - uncached)
        self.where[request_id] = endpoint

    def first_token(self, request_id: str, now: float) -> None:
        endpoint = self.where.get(request_id)
        if endpoint is None or endpoint not in self.clocks:
            return
        clock = self.clocks[endpoint]
        if not self.back_date:
            clock.learner.observed(request_id, now, first=True, out=None)
            return
        clock.watch.pop(request_id, None)
        learner = clock.learner
        waiting = learner.waiting.pop(request_id, None)
        if waiting is not None:  # no batch dated it: decoding from now on, nothing learnt
            learner.decoding[request_id] = (waiting[1], learner.steps, learner.log_r)
            self.unanchored.add(request_id)
            clock.undated += 1

    def ended(self, request_id: str, now: float | None, output_tokens: int | None) -> None:
        """The request ended at `now` (a step end; None: when is unknown, so it only leaves
        the batch) with `output_tokens` (the usage; None if unknown)."""
        endpoint = self.where.pop(request_id, None)
        if endpoint is None or endpoint not in self.clocks:
            return
        clock = self.clocks[endpoint]
        learner = clock.learner
        clock.watch.pop(request_id, None)
        unanchored = request_id in self.unanchored
        self.unanchored.discard(request_id)
        if now is not None and not self.back_date and request_id not in learner.waiting:
            learner.observed(request_id, now, first=False, out=output_tokens)
            return
        # No step end to count (time unknown, live, or ended before its first byte: an error
        # or a cancel): just gone, or it would keep the learner busy and its context growing.
        decoding = learner.drop(request_id)
        if decoding is None or now is None or output_tokens is None or unanchored:
            return
        end = clock.at(now - self.end_late_s)
        if end is not None:
            learner.anchor_span(decoding[1:], end, output_tokens)

    def forget_endpoints(self, keep: set[str]) -> None:
        # Only the latest forget's endpoints are kept out (a late batch is one in flight as
        # the subscriber forgot them too): a set of every endpoint ever forgotten would grow
        # with pod churn for good.
        self.forgotten = {e for e in self.clocks if e not in keep}
        for endpoint in self.forgotten:
            del self.clocks[endpoint]
        self.where = {r: e for r, e in self.where.items() if e in keep}
        self.unanchored &= self.where.keys()

    def describe(self) -> dict[str, dict[str, object]]:
        """Per endpoint, the learner's state (a bench and debugging view): batches, first
        bytes dated or not, bootstrap or fitting, resets, the model, and how the steps it
        counted per request compare with the usage (share exact, mean |log ratio|)."""
        out: dict[str, dict[str, object]] = {}
        for endpoint, clock in self.clocks.items():
            learner = clock.learner
            counts = [(c, t) for c, t in learner.counts if c > 0 and t > 0]
            # weighted as the learner weighs them: a short request's count says little
            weights = [min(1.0, t / 50) for _, t in counts]
            logs = [math.log(c / t) for c, t in counts]
            out[endpoint] = {
                "batches": clock.batches,
                "dated": clock.dated,
                "undated": clock.undated,
                "fitting": learner.fitting,
                "resets": learner.resets,
                "coefficients": list(learner.coefficients()),
                "anchors": len(counts),
                "exact_counts": sum(c == t for c, t in counts) / len(counts) if counts else None,
                "miscount": learner.miscount,  # the learner's moving mean |log| (trust < 3 %)
                "weighted_log_count": (
                    sum(w * x for w, x in zip(weights, logs, strict=True)) / sum(weights)
                    if counts
                    else None
                ),  # > 0: it counts more steps than the requests' usage says
                "weighted_abs_log_count": (
                    sum(w * abs(x) for w, x in zip(weights, logs, strict=True)) / sum(weights)
                    if counts
                    else None
                ),
            }
        return out

    def outstanding(self, endpoint: str) -> bool:
        """Whether `endpoint` has requests this router sent that have not ended."""
        clock = self.clocks.get(endpoint)
        return clock is not None and clock.learner.busy()

    def fresh(self, endpoint: str, now: float) -> bool:
        """A clock to trust: the learner fitted (or `require_fit` off) and a batch within
        `stale_s`, or nothing outstanding: an idle engine publishes no batches, and its next
        step starts when a request arrives (it is the cheapest place, not an unknown one)."""
        clock = self.clocks.get(endpoint)
        return (
            clock is not None
            and clock.last_batch is not None
            and (clock.learner.fitting or not self.require_fit)
            and (now - clock.last_batch <= self.stale_s or not clock.learner.busy())
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
