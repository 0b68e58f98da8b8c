"""The pure model of one continuous-batching inference engine (vLLM V1-like). No I/O, no clock.

Time is whatever the caller says it is (seconds, float). The engine runs one *step* (forward pass)
at a time; a step is planned when it starts and its tokens appear when it ends:

    engine.submit(request, now)          # queue a request (request.arrival is its arrival time)
    t = engine.next_event_time()         # end of the step in progress (plans one if idle), or None
    outcomes = engine.advance(now)       # finish every step that ends at or before `now`
    engine.cancel(request_id, now)       # client went away: free its slots and blocks
    engine.stats()                       # what a /metrics scrape would show now
    engine.first_token_if_submitted(...) # what-if on a copy: when a new request's first token
                                         # would come if nothing else arrived (bench oracle)

Scheduling per step, as vLLM's V1 scheduler does it:
1. Running requests first, in order: each gets its remaining prefill (chunked to the token budget
   `max_num_batched_tokens`) or one decode token. If the KV cache has no block for it, the most
   recently admitted running request is preempted (recompute: its blocks are freed, it goes back
   to the head of the queue and must prefill prompt + generated tokens again).
2. Then waiting requests in FIFO order while there are free running slots (`max_num_seqs`), budget
   and blocks. A request whose LoRA adapter cannot get a slot is skipped (it keeps its place);
   one that does not fit in the KV cache blocks the queue. Cached prefix blocks are reused and
   skip their prefill cost.
3. The step takes  overhead + prefill_token_s * prefill tokens + decode_token_s * decode tokens
   + kv_read_token_s * context tokens + lora_load_s * adapter swaps, x (1 + lora_step_overhead)
   if any adapter runs, x time_scale.
When a request's computed tokens reach its length, the step samples one new token for it.

A step only admits requests whose arrival <= the step's start, so drivers may call in late
(real time) or exactly on time (virtual time) and get the same physics.

The batch mechanics (admission, KV blocks, step costs) are `sim/batch.py` `BatchCore`; several
identical decode steps planned as one event in virtual time are `sim/fused_steps.py`.
"""

from __future__ import annotations

import copy
from collections import deque
from collections.abc import Callable

from poolkeeper.sim.batch import Step
from poolkeeper.sim.fused_steps import FusedStepCore
from poolkeeper.sim.kvcache import prompt_block_hashes
from poolkeeper.sim.params import EngineConfig
from poolkeeper.sim.request import (
    InvalidRequestError,
    RequestStatus,
    SimRequest,
    StepOutcome,
    UnknownModelError,
)
from poolkeeper.sim.stats import EngineStats
from poolkeeper.sim.textgen import stream_seed
from poolkeeper.tokens import count_tokens

STEP_END_HISTORY = 64  # step ends kept for `step_end_before`: well over 100 ms of steps

__all__ = [
    "EngineModel",
    "InvalidRequestError",
    "RequestStatus",
    "SimRequest",
    "StepOutcome",
    "UnknownModelError",
]


class EngineModel(FusedStepCore):
    """One simulated engine. See the module docstring for the protocol."""

    def __init__(
        self, config: EngineConfig, *, name: str = "sim-0", max_fused_steps: int = 1
    ) -> None:
        super().__init__(config, name)
        # Virtual time only: up to this many identical pure-decode steps are planned as one
        # event (split again if a request arrives or leaves meanwhile). Same physics, far
        # fewer events; real-time serving keeps 1 so every token leaves on time.
        self.max_fused_steps = max_fused_steps
        self._pending: list[StepOutcome] = []
        self._step: Step | None = None
        self._free_at = float("-inf")  # end of the last step
        # The ends of the last steps, for a reference policy that sees them late (read only by
        # `bench/policies/reference_policies.py`): bounded, so a long run holds no more.
        self._step_ends: deque[float] = deque(maxlen=STEP_END_HISTORY)
        # Bench only: told of each step as it ends, before its tokens are applied (a reference
        # policy that learns step ends from the KV events some steps publish). None: no cost.
        self.step_observer: Callable[[Step], None] | None = None
        # Told of each step's end after its tokens are applied: the KV-event publisher sends
        # what the step stored (when it was planned, as vLLM's `schedule()` caches the blocks
        # a step fills) and evicted as one batch then, as vLLM does at the end of
        # `update_from_output` (sim/kvpublish.py). None: no cost. Fused steps (virtual
        # time) end once, and store what their later steps filled then.
        self.kv_step_end: Callable[[float], None] | None = None

    # -- requests -------------------------------------------------------------------------

    def create_request(
        self,
        request_id: str,
        model: str,
        prompt: str,
        *,
        arrival: float,
        max_tokens: int | None = None,
        prompt_tokens: int | None = None,
    ) -> SimRequest:
        """Validate and build a request (tokens by poolkeeper.tokens unless given)."""
        config = self.config
        adapter: str | None = None
        if model != config.model:
            if model not in self.adapters:
                raise UnknownModelError(f"The model `{model}` does not exist.")
            if config.max_loras == 0:
                raise InvalidRequestError("LoRA is disabled on this server (max_loras = 0).")
            adapter = model
        n_prompt = count_tokens(prompt) if prompt_tokens is None else prompt_tokens
        if n_prompt < 1:
            raise InvalidRequestError("The prompt must contain at least one token.")
        limit = config.effective_max_model_len
        if max_tokens is not None and max_tokens < 1:
            raise InvalidRequestError("max_tokens must be at least 1.")
        if max_tokens is None:
            wanted = 1 + int(self.rng.expovariate(1.0 / config.default_output_tokens))
            output, reason = max(1, min(wanted, limit - n_prompt)), "stop"
        else:
            output, reason = max_tokens, "length"
        if n_prompt + output > limit:
            raise InvalidRequestError(
                f"This model's maximum context length is {limit} tokens. However, you "
                f"requested {n_prompt + output} tokens ({n_prompt} in the messages, "
                f"{output} in the completion). Please reduce the length of the messages or "
                "completion."
            )
        hashes: list[int] = []
        hash_text: str | None = None
        if config.enable_prefix_caching:
            # An explicit token count bounds the blocks the text may name.
            hashes = prompt_block_hashes(prompt, config.block_size, model)
            del hashes[n_prompt // config.block_size :]
            if prompt_tokens is None or prompt_tokens == count_tokens(prompt):
                hash_text = prompt  # the output's blocks continue the text's chain
        request = SimRequest(
            request_id=request_id,
            model=model,
            adapter=adapter,
            prompt_tokens=n_prompt,
            max_tokens=output,
            arrival=arrival,
            block_hashes=hashes,
            finish_reason=reason,
        )
        if hash_text is not None:
            request.hash_text = hash_text
            request.text_seed = stream_seed(config.seed, request_id)  # the server's text
        return request

    def submit(self, request: SimRequest, now: float) -> None:
        """Queue `request`. Its arrival time is `request.arrival` (normally `now`)."""
        self._split(now)
        self.waiting.append(request)
        self._by_id[request.request_id] = request
        self.counters.requests_submitted += 1

    def cancel(self, request_id: str, now: float) -> SimRequest | None:
        """Abort a request wherever it is; its blocks and slots are freed at once."""
        self._split(now)
        request = self._by_id.pop(request_id, None)
        if request is None or request.done:
            return None
        if request.status is RequestStatus.WAITING:
            self.waiting.remove(request)
        else:
            self.running.remove(request)
            self._free(request)
        request.status = RequestStatus.ABORTED
        request.finish_time = now
        self.counters.requests_cancelled += 1
        self.counters.finished["abort"] += 1
        return request

    def register_adapter(self, name: str, path: str) -> None:
        self.adapters[name] = path

    def unregister_adapter(self, name: str) -> None:
        self.adapters.pop(name, None)
        self.lora.drop(name)

    # -- time -----------------------------------------------------------------------------

    def next_event_time(self) -> float | None:
        """When the current step ends; plans the next step first if the engine is idle."""
        if self._step is None:
            self._plan()
        return None if self._step is None else self._step.end

    def advance(self, now: float) -> list[StepOutcome]:
        """Complete every step that ends at or before `now`, planning the next ones."""
        outcomes, self._pending = self._pending, []
        while True:
            if self._step is None:
                self._plan()
            step = self._step
            if step is None or step.end > now:
                return outcomes
            self._step = None
            self._free_at = step.end
            self._step_ends.append(step.end)
            if self.step_observer is not None:
                self.step_observer(step)
            if step.fused > 1:
                outcomes.append(self._complete_fused(step, step.fused))
            else:
                outcomes.append(self._complete(step))
            if self.kv_step_end is not None:
                self.kv_step_end(step.end)

    @property
    def busy(self) -> bool:
        return self._step is not None

    @property
    def last_step_end(self) -> float:
        """When the last completed step ended (-inf before the first): what a client of a
        stream sees as its last token's time, since every step ends with one token for each
        decoding request (vLLM's default stream interval)."""
        return self._free_at

    def step_end_before(self, when: float) -> float:
        """The end of the last step that ended at or before `when`, among the last
        `STEP_END_HISTORY` (-inf if none): what a router told of step ends `now - when` late
        would know."""
        for end in reversed(self._step_ends):
            if end <= when:
                return end
        return float("-inf")

    def first_token_if_submitted(
        self,
        request_id: str,
        model: str,
        prompt: str,
        now: float,
        *,
        max_tokens: int | None = None,
        prompt_tokens: int | None = None,
    ) -> float | None:
        """When a request submitted at `now` would get its first token if nothing else arrived
        after it: runs a copy of this engine (its own RNG state, blocks and queue; the requests'
        sinks are shared and never written). This engine is unchanged. None: the request would
        be refused (unknown model, too long) or never scheduled."""
        by_id = self._by_id.values()
        memo: dict[int, object] = {id(r.sink): r.sink for r in by_id if r.sink is not None}
        # The twin reports no KV events (a live publisher's socket cannot be copied).
        for hook in (self.kv.sink, self.kv_step_end):
            if hook is not None:
                memo[id(hook)] = None
        twin = copy.deepcopy(self, memo)
        try:
            request = twin.create_request(
                request_id, model, prompt, arrival=now, max_tokens=max_tokens,
                prompt_tokens=prompt_tokens,
            )  # fmt: skip
        except (UnknownModelError, InvalidRequestError):
            return None
        twin.submit(request, now)
        while (t := twin.next_event_time()) is not None:
            for outcome in twin.advance(t):
                if any(r is request for r in outcome.tokens):
                    return outcome.first_time
        return None

    def stats(self) -> EngineStats:
        waiting_adapters = {r.adapter for r in self.waiting if r.adapter is not None}
        lora = self.lora
        return EngineStats(
            waiting=len(self.waiting),
            running=len(self.running),
            kv_cache_usage=self.kv.usage,
            running_adapters=tuple(sorted(lora.running)),
            waiting_adapters=tuple(sorted(waiting_adapters)),
            resident_adapters=lora.resident,
            max_loras=self.config.max_loras,
            block_size=self.config.block_size,
            num_gpu_blocks=self.config.num_gpu_blocks,
            waiting_deferred=sum(
                1 for r in self.waiting if r.adapter is not None and not lora.is_resident(r.adapter)
            ),
        )

    # -- scheduling -----------------------------------------------------------------------

    def _plan(self) -> None:
        if not self.running and not self.waiting:
            return
        start = self._free_at
        if not self.running:
            start = max(start, self.waiting[0].arrival)
        scheduled: list[tuple[SimRequest, int]] = []
        budget = self.config.max_num_batched_tokens
        preempted = self._schedule_running(scheduled, budget)
        budget -= sum(n for _, n in scheduled)
        loads = 0
        if not preempted or not scheduled:
            loads = self._admit_waiting(scheduled, budget, start)
        if not scheduled:
            return  # nothing can run before more time passes
        for request, n in scheduled:  # the output blocks this step fills are cached now
            if request.hash_text is not None:
                self._cache_output_blocks(request, request.num_computed + n)
        duration = self._duration(scheduled, loads)
        if self.max_fused_steps > 1 and not self.waiting and not loads and not preempted:
            fused = self._fuse(start, duration, scheduled)
            if fused is not None:
                self._step = fused
                return
        self._step = Step(start, start + duration, scheduled)
