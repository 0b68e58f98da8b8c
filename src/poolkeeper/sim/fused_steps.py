"""Fused decode steps (virtual time only): up to `max_fused_steps` identical pure-decode steps
planned as one event, when nothing can change before they end (no prefill in the batch, no
waiting request, no step jitter, enough empty KV blocks); split again at the moment a request
arrives or leaves (`_split`), and applied in one go when they end (`_complete_fused`). Same
physics as step by step, far fewer events. `EngineModel` (`sim/engine.py`) plans and owns the
step state; this class holds what the fused steps do with it."""

from __future__ import annotations

from collections import deque

from poolkeeper.sim.batch import BatchCore, Step
from poolkeeper.sim.request import RequestStatus, SimRequest, StepOutcome


class FusedStepCore(BatchCore):
    """`BatchCore` with fused decode steps; the step state is set by `EngineModel.__init__`."""

    max_fused_steps: int
    _pending: list[StepOutcome]
    _step: Step | None
    _free_at: float
    _step_ends: deque[float]

    def _fuse(
        self, start: float, duration: float, scheduled: list[tuple[SimRequest, int]]
    ) -> Step | None:
        """Plan k identical decode steps as one, if nothing can change before they end."""
        config = self.config
        if config.step_jitter > 0.0:
            return None
        k = self.max_fused_steps
        for request, n in scheduled:
            if n != 1 or request.output_tokens == 0:
                return None  # a prefill in the batch: not a steady state
            k = min(k, request.max_tokens - request.output_tokens)
        bs = config.block_size
        while k >= 2:
            extra = 0
            for request, _ in scheduled:
                held = len(request.held_hashed) + request.held_private
                extra += max(0, -(-(request.num_computed + k) // bs) - held)
            # Only empty blocks: taking cached ones early would evict prefixes that step-by-step
            # allocation might never have needed to evict.
            if extra <= self.kv.empty:
                break
            k //= 2
        if k < 2:
            return None
        for request, _ in scheduled:
            self._grow(request, request.num_computed + k)
        growth = config.kv_read_token_s * len(scheduled) * config.time_scale
        if any(request.adapter is not None for request, _ in scheduled):
            growth *= 1.0 + config.lora_step_overhead
        step = Step(start, 0.0, scheduled, k, duration, growth)
        step.end = step.end_of(k - 1)
        return step

    def _split(self, now: float) -> None:
        """Something happens at `now` during fused steps: finish those already done, keep the
        one in progress as an ordinary step, and give back blocks taken for the rest."""
        step = self._step
        if step is None or step.fused == 1 or now >= step.end:
            return
        done = 0
        while done < step.fused - 1 and step.end_of(done) <= now:
            done += 1
        if done:
            self._pending.append(self._complete_fused(step, done))
            self._free_at = step.end_of(done - 1)
            self._step_ends.append(self._free_at)
        bs = self.config.block_size
        for request, _ in step.scheduled:
            keep = -(-(request.num_computed + 1) // bs) - len(request.held_hashed)
            if request.held_private > keep:
                self.kv.release([], request.held_private - keep)
                request.held_private = keep
        start = step.end_of(done - 1) if done else step.start
        self._step = Step(start, step.end_of(done), step.scheduled)
        for request, n in step.scheduled:  # the step in progress fills blocks too (`_plan`)
            if request.hash_text is not None and request.status is RequestStatus.RUNNING:
                self._cache_output_blocks(request, request.num_computed + n)

    def _complete_fused(self, step: Step, count: int) -> StepOutcome:
        """Apply the first `count` fused steps of `step` (from its start)."""
        counters = self.counters
        first_end = step.start + step.first_duration
        last_end = step.end_of(count - 1)
        itl = counters.itl
        tokens: list[SimRequest] = []
        finished: list[SimRequest] = []
        for request, _ in step.scheduled:
            if request.status is not RequestStatus.RUNNING:
                continue
            itl.observe(first_end - (request.last_token_time or step.start))
            request.num_computed += count
            if request.hash_text is not None:  # the blocks the later fused steps filled
                self._cache_output_blocks(request, request.num_computed)
            request.output_tokens += count
            request.last_token_time = last_end
            tokens.append(request)
            if request.output_tokens >= request.max_tokens:
                self._finish(request, last_end)
                finished.append(request)
        if count > 1:
            first = step.first_duration + step.growth
            itl.observe_linear(first, step.growth, count - 1, len(tokens))
        counters.generation_tokens += count * len(tokens)
        counters.steps += count
        counters.busy_time += last_end - step.start
        if finished:
            self.running = [r for r in self.running if r.status is RequestStatus.RUNNING]
        return StepOutcome(
            last_end, tokens, finished, count, step.start, step.first_duration, step.growth
        )
