"""The continuous-batching core of the engine model: one step's admissions, KV growth,
preemptions and duration, and completing a step. EngineModel (sim/engine.py) builds the request
API, the clock protocol and fused decode steps on top of it; see its docstring for the rules.
"""

from __future__ import annotations

import random
from collections import deque
from dataclasses import dataclass

from poolkeeper.sim.kvcache import PrefixKVCache, output_block_hash
from poolkeeper.sim.lora import LoraSlots
from poolkeeper.sim.params import EngineConfig
from poolkeeper.sim.request import RequestStatus, SimRequest, StepOutcome
from poolkeeper.sim.stats import EngineCounters


@dataclass(slots=True)
class Step:
    start: float
    end: float
    scheduled: list[tuple[SimRequest, int]]
    fused: int = 1  # decode steps fused into this one (all of `scheduled` decode)
    first_duration: float = 0.0
    growth: float = 0.0  # each fused step is longer by this (context grows by one per request)

    def end_of(self, j: int) -> float:
        """End of fused step j (0-based)."""
        return self.start + (j + 1) * self.first_duration + self.growth * j * (j + 1) / 2


class BatchCore:
    """State of one engine's batch and the per-step mechanics (no notion of "now")."""

    def __init__(self, config: EngineConfig, name: str) -> None:
        self.config = config
        self.name = name
        self.rng = random.Random(f"{config.seed}:{name}")
        self.kv = PrefixKVCache(config.num_gpu_blocks, caching=config.enable_prefix_caching)
        self.lora = LoraSlots(config.max_loras)
        self.adapters: dict[str, str] = {a: a for a in config.lora_adapters}  # name -> path
        self.counters = EngineCounters()
        self.waiting: deque[SimRequest] = deque()
        self.running: list[SimRequest] = []
        self._by_id: dict[str, SimRequest] = {}

    def _schedule_running(self, scheduled: list[tuple[SimRequest, int]], budget: int) -> bool:
        """Give each running request its next chunk; preempt from the tail when KV is full."""
        running = self.running
        preempted = False
        bs = self.config.block_size
        i = 0
        while i < len(running):
            request = running[i]
            n = min(request.prompt_tokens + request.output_tokens - request.num_computed, budget)
            if n <= 0:
                i += 1
                continue
            upto = request.num_computed + n
            if upto <= (len(request.held_hashed) + request.held_private) * bs:
                scheduled.append((request, n))  # its blocks already cover this step
                budget -= n
                i += 1
                continue
            while not self._grow(request, upto):
                victim = running.pop()
                self._preempt(victim)
                preempted = True
                if victim is request:
                    break
            else:
                scheduled.append((request, n))
                budget -= n
                i += 1
        return preempted

    def _admit_waiting(
        self, scheduled: list[tuple[SimRequest, int]], budget: int, start: float
    ) -> int:
        """Move waiting requests into the batch; returns the number of adapter swaps."""
        config = self.config
        waiting = self.waiting
        skipped: list[SimRequest] = []
        loads = 0
        while waiting and budget > 0 and len(self.running) < config.max_num_seqs:
            request = waiting[0]
            if request.arrival > start:
                break
            hit_blocks = self.kv.cached_prefix(request.block_hashes)
            total = request.num_tokens
            if hit_blocks * config.block_size >= total:
                hit_blocks = (total - 1) // config.block_size  # always compute >= 1 token
            computed = hit_blocks * config.block_size
            n = min(total - computed, budget)
            hashes, private = self._blocks_between(request, 0, computed + n)
            if not self.kv.can_allocate(hashes, private):
                break  # head-of-line: a request that does not fit blocks the queue (FCFS)
            if request.adapter is not None:
                swapped = self.lora.acquire(request.adapter)
                if swapped is None:
                    skipped.append(waiting.popleft())
                    continue
                if swapped:
                    loads += 1
                    request.adapter_loaded = True
                    self.counters.lora_loads += 1
            waiting.popleft()
            self._take(hashes, None)
            self.kv.take_private(private)
            request.held_hashed = hashes
            request.held_private = private
            request.num_computed = computed
            request.status = RequestStatus.RUNNING
            counters = self.counters
            counters.prefix_queries += total
            counters.prefix_hits += computed
            if not request.admitted:
                request.admitted = True
                request.cached_tokens = computed
                counters.prompt_tokens += request.prompt_tokens
            self.running.append(request)
            scheduled.append((request, n))
            budget -= n
        waiting.extendleft(reversed(skipped))
        return loads

    def _blocks_between(
        self, request: SimRequest, held: int, upto_tokens: int
    ) -> tuple[list[int], int]:
        """New blocks (hashed, private count) to cover `upto_tokens` given `held` blocks."""
        bs = self.config.block_size
        needed = -(-upto_tokens // bs)
        if needed <= held:
            return [], 0
        full = request.block_hashes
        hashed = full[held:needed] if held < len(full) else []
        return list(hashed), needed - held - len(hashed)

    def _grow(self, request: SimRequest, upto_tokens: int) -> bool:
        held = len(request.held_hashed) + request.held_private
        hashes, private = self._blocks_between(request, held, upto_tokens)
        if not hashes and not private:
            return True
        if not self.kv.can_allocate(hashes, private):
            return False
        self._take(hashes, request.held_hashed[-1] if request.held_hashed else None)
        self.kv.take_private(private)
        request.held_hashed.extend(hashes)
        request.held_private += private
        return True

    def _take(self, hashes: list[int], parent: int | None) -> None:
        """Reference a run of chained blocks; `parent` precedes the first (None at the start)."""
        take = self.kv.take_hashed
        for h in hashes:
            take(h, parent)
            parent = h

    def _cache_output_blocks(self, request: SimRequest, computed: int) -> None:
        """Name the request's blocks that `computed` tokens fill (its output's: the prompt's
        are named at allocation), as vLLM's `allocate_slots` caches the blocks a step will
        fill when it schedules the step. The text decides: a prompt whose length is not a
        multiple of 4 characters shifts the output, so a block is named once all its
        characters are computed."""
        text = request.hash_text
        over = computed - request.prompt_tokens
        if text is None or over < 0:
            return
        bs = self.config.block_size
        full = (len(text) + 4 * over) // (4 * bs)
        held = request.held_hashed
        if len(held) >= full or not request.held_private:
            return
        hashes = request.block_hashes
        cache = self.kv.cache_private
        while len(held) < full and request.held_private:
            k = len(held)
            parent = held[-1] if held else None
            if k < len(hashes):
                h = hashes[k]  # computed before a preemption
            else:
                h = output_block_hash(request.model, text, request.text_seed, k, parent, bs)
                hashes.append(h)
            cache(h, parent)
            held.append(h)
            request.held_private -= 1

    def _preempt(self, request: SimRequest) -> None:
        self._free(request)
        request.num_computed = 0
        request.status = RequestStatus.WAITING
        request.preemptions += 1
        self.counters.preemptions += 1
        self.waiting.appendleft(request)

    def _free(self, request: SimRequest) -> None:
        self.kv.release(request.held_hashed, request.held_private)
        request.held_hashed = []
        request.held_private = 0
        if request.adapter is not None and request.status is RequestStatus.RUNNING:
            self.lora.release(request.adapter)

    def _duration(self, scheduled: list[tuple[SimRequest, int]], loads: int) -> float:
        config = self.config
        prefill = decode = context = 0
        with_adapter = False
        for request, n in scheduled:
            if (
                n == 1
                and request.output_tokens > 0
                and request.num_computed == request.num_tokens - 1
            ):
                decode += 1
            else:
                prefill += n
            context += request.num_computed + n
            if request.adapter is not None:
                with_adapter = True
        seconds = (
            config.step_overhead_s
            + config.prefill_token_s * prefill
            + config.decode_token_s * decode
            + config.kv_read_token_s * context
        )
        if with_adapter:
            seconds *= 1.0 + config.lora_step_overhead
        seconds += config.lora_load_s * loads
        if config.step_jitter > 0.0:
            seconds *= max(0.1, self.rng.gauss(1.0, config.step_jitter))
        return seconds * config.time_scale

    def _finish(self, request: SimRequest, end: float) -> None:
        self._free(request)
        request.status = RequestStatus.FINISHED
        request.finish_time = end
        self.counters.finished[request.finish_reason] += 1
        self.counters.e2e.observe(end - request.arrival)
        del self._by_id[request.request_id]

    def _complete(self, step: Step) -> StepOutcome:
        end = step.end
        counters = self.counters
        counters.steps += 1
        counters.busy_time += end - step.start
        tokens: list[SimRequest] = []
        finished: list[SimRequest] = []
        itl_hist = counters.itl
        running_status = RequestStatus.RUNNING
        for request, n in step.scheduled:
            if request.status is not running_status:
                continue  # cancelled during the step
            computed = request.num_computed + n
            request.num_computed = computed
            if computed < request.prompt_tokens + request.output_tokens:
                continue  # a prefill chunk that did not reach the end of the sequence
            request.output_tokens += 1
            last = request.last_token_time
            if last is None:
                request.first_token_time = end
                counters.ttft.observe(end - request.arrival)
            else:
                itl_hist.observe(end - last)
            request.last_token_time = end
            tokens.append(request)
            if request.output_tokens >= request.max_tokens:
                self._finish(request, end)
                finished.append(request)
        counters.generation_tokens += len(tokens)
        if finished:
            self.running = [r for r in self.running if r.status is RequestStatus.RUNNING]
        return StepOutcome(end, tokens, finished)
