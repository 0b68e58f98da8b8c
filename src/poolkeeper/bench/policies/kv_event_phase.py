"""Reference policies that learn step ends from the engines' KV-event batches (issue #38).

`ref-first-byte-phase` (`reference_policies.py`) estimates each server's step phase from the
step ends the EPP sees today: the first bytes and the ends of its own requests. A router in
exact-prefix mode (`kvEvents: true`) also subscribes to the engines' KV events, and vLLM
publishes one `KVEventBatch` per engine step that had events, stamped `ts` right after the
step (`Scheduler.update_from_output`: `kv_cache_manager.take_events()` then
`kv_event_publisher.publish`). Each batch is then the end of one step. Which steps publish:

- `prompt` rule, what this simulator's KV cache reports (`sim/kvcache.py`): a step that
  stored a new hashed *prompt* block or evicted a cached one (SGLang-like, or vLLM with
  decode blocks left out).
- `vllm` rule, what vLLM with prefix caching reports: a step in which some request's computed
  tokens cross a block boundary (`allocate_slots` -> `cache_blocks` caches every block that is
  full after the step, prompt or output: `Request.append_output_token_ids` hashes each output
  block as it fills), or that evicted a cached block (`BlockRemoved`). A decoding request
  publishes once every `block_size` (16) steps, so with a dozen decoding requests most steps do.

`ref-kv-phase-<rule>-<delay>` learns the end of every publishing step `delay` late (the
batch's transit: 0, 0.5, 1 or 2 ms), at its `ts` (the engine's clock taken as the router's),
plus every first byte and end at once, like `ref-first-byte-phase`; between known ends, steps
are taken to follow back to back with the step-time model's length, whose coefficients are
still read from the engine (a real router would learn them). Same score as
`ref-first-byte-phase`; only the last known step end differs.
"""

from __future__ import annotations

import random
from collections import deque

from poolkeeper.bench.policies.reference_policies import FirstBytePhase
from poolkeeper.sim.batch import Step
from poolkeeper.sim.engine import STEP_END_HISTORY, EngineModel
from poolkeeper.sim.kvcache import KVEventSink
from poolkeeper.sim.virtual import VirtualFleet


class StepEventRecorder:
    """One engine's KV-event sink (forwarding to the one it replaces) and step observer:
    remembers the ends of the steps that would have published a KV-event batch."""

    __slots__ = ("block_size", "inner", "publishing_ends", "removed_now", "stored_now", "vllm")

    def __init__(self, inner: KVEventSink | None, block_size: int, *, vllm: bool) -> None:
        self.inner = inner
        self.block_size = block_size
        self.vllm = vllm
        # The cache's events happen while the next step is planned (its allocations), and
        # vLLM publishes them when that step ends: flags for the step now planned.
        self.stored_now = False
        self.removed_now = False
        self.publishing_ends: deque[float] = deque(maxlen=STEP_END_HISTORY)

    def stored(self, hashes: list[int], parent: int | None) -> None:
        self.stored_now = True
        if self.inner is not None:
            self.inner.stored(hashes, parent)

    def removed(self, hashes: list[int]) -> None:
        self.removed_now = True
        if self.inner is not None:
            self.inner.removed(hashes)

    def fills_a_block(self, step: Step) -> bool:
        """Some request's computed tokens cross a block boundary in `step` (its tokens are not
        applied yet: `num_computed` is still the count before it)."""
        bs = self.block_size
        return any((r.num_computed + n) // bs > r.num_computed // bs for r, n in step.scheduled)

    def step_ended(self, step: Step) -> None:
        published = self.removed_now or (self.fills_a_block(step) if self.vllm else self.stored_now)
        self.stored_now = self.removed_now = False
        if published:
            self.publishing_ends.append(step.end)

    def published_before(self, when: float) -> float | None:
        """The end of the last publishing step that ended at or before `when` (None if none
        among the last `STEP_END_HISTORY`)."""
        for end in reversed(self.publishing_ends):
            if end <= when:
                return end
        return None


class KVEventPhase(FirstBytePhase):
    """`ref-kv-phase-<rule>-<delay>` (see the module docstring)."""

    name = "ref-kv-phase"
    vllm_rule = False
    report_delay_s = 0.0

    def __init__(self, rng: random.Random) -> None:
        super().__init__(rng)
        self.recorders: dict[str, StepEventRecorder] = {}

    def bind(self, fleet: VirtualFleet) -> None:
        super().bind(fleet)
        for endpoint, engine in zip(fleet.endpoints, fleet.engines, strict=True):
            self.recorders[endpoint.hostport] = self.record(engine)

    def record(self, engine: EngineModel) -> StepEventRecorder:
        recorder = StepEventRecorder(engine.kv.sink, engine.config.block_size, vllm=self.vllm_rule)
        engine.kv.sink = recorder
        engine.step_observer = recorder.step_ended
        return recorder

    def known_step_end(self, endpoint: str, now: float) -> float | None:
        seen = super().known_step_end(endpoint, now)
        published = self.recorders[endpoint].published_before(now - self.report_delay_s)
        if published is None:
            return seen
        return published if seen is None else max(seen, published)


def _variant(rule: str, delay_ms: float) -> type[KVEventPhase]:
    label = f"{delay_ms:g}ms".replace(".", "p")
    return type(
        f"KVEventPhase_{rule}_{label}",
        (KVEventPhase,),
        {
            "name": f"ref-kv-phase-{rule}-{label}",
            "vllm_rule": rule == "vllm",
            "report_delay_s": delay_ms / 1000,
            "__doc__": f"`ref-kv-phase-{rule}-{label}` (see the module docstring).",
        },
    )


KV_EVENT_POLICIES: dict[str, type[KVEventPhase]] = {
    cls.name: cls
    for cls in (
        _variant(rule, delay) for rule in ("prompt", "vllm") for delay in (0.0, 0.5, 1.0, 2.0)
    )
}
