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
  publishes once every `block_size` (16) steps; heavy-tail at 0.7x runs 60-70 decoding
  requests a step, so 95 % of its steps publish (the prompt rule: 8-15 %).

`ref-kv-phase-<rule>-<delay>[-<estimator>][-ctx][-err<p|m>3]` learns the end of every
publishing step `delay` late (the batch's transit: 0, 0.5, 1 or 2 ms) at its `ts` (the
engine's clock taken as the router's), plus every first byte and end at once, like
`ref-first-byte-phase`. Rules `none` (no step publishes: first bytes and ends only) and `all`
(every step does: `ref-observed-phase`'s signal) bound the two real ones. The step-time
coefficients are still read from the engine (a real router would learn them). Estimators of
the end of the step in progress, from the last known end K:

- (none) `ref-first-byte-phase`'s: steps of the model's length for all the router has
  outstanding follow back to back from K (the phase is the time since K modulo that length).
- `sent`: the step that began at K holds the prefill of only the requests sent by K; later
  steps, as above.
- `late`: `sent`, and that step had not ended by the horizon (`now - delay`), since it would
  have been reported (`ref-observed-phase-late`'s rule; wrong for a silent step).
- `count`: `sent`, and the router knows which steps after K publish (as it could by following
  each request's block chain: a decoding request fills a block every 16 steps): a publishing
  one not reported by the horizon had not ended by then; silent ones take the model's length.
- `-ctx`: the model also counts the context read (44 ns a token of the running requests,
  which the chains tell to a block), which the other references leave out: with 60-70
  decoding requests of a few hundred tokens it is about 2 ms of a 9 ms step.
- `-errp3` / `-errm3`: the router's step lengths 3 % too long / too short (learnt, not given)."""

from __future__ import annotations

import random
from collections import deque
from collections.abc import Callable, Sequence

from poolkeeper.bench.policies.reference_policies import FirstBytePhase
from poolkeeper.datastore.endpoint import EndpointState
from poolkeeper.scheduling.types import LLMRequest
from poolkeeper.sim.batch import Step
from poolkeeper.sim.engine import STEP_END_HISTORY, EngineModel
from poolkeeper.sim.kvcache import KVEventSink
from poolkeeper.sim.virtual import VirtualFleet


class StepEventRecorder:
    """One engine's KV-event sink (forwarding to the one it replaces) and step observer:
    remembers the ends of the steps that would have published a KV-event batch under `rule`
    (`prompt`, `vllm`; `none`: no step publishes; `all`: every step does)."""

    __slots__ = (
        "block_size", "inner", "on_publish", "publishing_ends", "removed_now", "rule", "steps",
        "stored_now",
    )  # fmt: skip

    def __init__(self, inner: KVEventSink | None, block_size: int, *, rule: str) -> None:
        if rule not in RULES:
            raise ValueError(f"unknown rule {rule!r}; known: {', '.join(RULES)}")
        self.inner = inner
        self.block_size = block_size
        self.rule = rule
        # The cache's events happen while the next step is planned (its allocations), and
        # vLLM publishes them when that step ends: flags for the step now planned.
        self.stored_now = False
        self.removed_now = False
        self.publishing_ends: deque[float] = deque(maxlen=STEP_END_HISTORY)
        self.steps: deque[tuple[float, bool]] = deque(maxlen=STEP_END_HISTORY)  # (end, published)
        # Called with each publishing step's end: the batch a subscriber receives (`ts`).
        self.on_publish: Callable[[float], None] | None = None

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

    def publishes(self, step: Step) -> bool:
        rule = self.rule
        if rule == "all" or (rule != "none" and self.removed_now):
            return True
        if rule == "vllm":
            return self.fills_a_block(step)
        return rule == "prompt" and self.stored_now

    def step_ended(self, step: Step) -> None:
        published = self.publishes(step)
        self.stored_now = self.removed_now = False
        self.steps.append((step.end, published))
        if published:
            self.publishing_ends.append(step.end)
            if self.on_publish is not None:
                self.on_publish(step.end)

    def flags_after(self, known: float, current: Step | None) -> list[bool]:
        """Whether each step after `known` publishes, in order, up to the one in progress:
        what a router could predict by following each request's block chain (a decoding
        request fills a block every `block_size` steps; `-count`, an upper bound of that)."""
        flags = [published for end, published in self.steps if end > known]
        if current is not None:
            flags.append(self.publishes(current))
        return flags

    def published_before(self, when: float) -> float | None:
        """The end of the last publishing step that ended at or before `when` (None if none
        among the last `STEP_END_HISTORY`)."""
        for end in reversed(self.publishing_ends):
            if end <= when:
                return end
        return None


class KVEventPhase(FirstBytePhase):
    """`ref-kv-phase-*` (see the module docstring)."""

    name = "ref-kv-phase"
    rule = "prompt"
    report_delay_s = 0.0
    sent_model = False  # the step after the last known end holds only what was sent before it
    count_model = False  # which steps publish is known (`flags_after`): a silent wait means overrun
    late_model = False  # every step is taken to publish: one not reported yet has not ended
    context_model = False  # the model also counts the context read (44 ns a token)
    model_error = 0.0  # the router's step lengths are this much too long (learnt coefficients)

    def __init__(self, rng: random.Random) -> None:
        super().__init__(rng)
        self.recorders: dict[str, StepEventRecorder] = {}
        self.sent: dict[str, dict[str, tuple[float, int]]] = {}  # endpoint -> id -> (t, tokens)

    def bind(self, fleet: VirtualFleet) -> None:
        super().bind(fleet)
        for endpoint, engine in zip(fleet.endpoints, fleet.engines, strict=True):
            self.recorders[endpoint.hostport] = self.record(engine)

    def record(self, engine: EngineModel) -> StepEventRecorder:
        recorder = StepEventRecorder(engine.kv.sink, engine.config.block_size, rule=self.rule)
        engine.kv.sink = recorder
        engine.step_observer = recorder.step_ended
        return recorder

    def known_step_end(self, endpoint: str, now: float) -> float | None:
        seen = super().known_step_end(endpoint, now)
        published = self.recorders[endpoint].published_before(now - self.report_delay_s)
        if published is None:
            return seen
        return published if seen is None else max(seen, published)

    def pick(
        self, request: LLMRequest, endpoints: Sequence[EndpointState], now: float
    ) -> EndpointState:
        chosen = super().pick(request, endpoints, now)
        self.sent.setdefault(chosen.key, {})[request.request_id] = (now, request.prompt_tokens)
        return chosen

    def on_first_token(self, request_id: str, now: float) -> None:
        self._answered(request_id)
        super().on_first_token(request_id, now)

    def on_finish(self, request_id: str, server: str, now: float) -> None:
        self._answered(request_id)
        super().on_finish(request_id, server, now)

    def _answered(self, request_id: str) -> None:
        where = self._where.get(request_id)
        if where is not None:
            self.sent.get(where[0], {}).pop(request_id, None)

    def context_s(self, endpoint: str) -> float:
        """The context-read part of a step: the running requests' tokens so far, which a
        router can follow to a block (16 tokens) from the stored blocks' chains."""
        if not self.context_model:
            return 0.0
        engine = self.engines[endpoint]
        c = engine.config
        return c.kv_read_token_s * sum(r.num_computed for r in engine.running) * c.time_scale

    def next_step_s(self, endpoint: str) -> float:
        return (super().next_step_s(endpoint) + self.context_s(endpoint)) * (1 + self.model_error)

    def step_after_s(self, endpoint: str, known: float) -> float:
        """The step-time model's length of the step that began at `known`: the prefill of
        only the requests sent by then (a later one waits for the next step)."""
        c = self.engines[endpoint].config
        sent = sum(n for t, n in self.sent.get(endpoint, {}).values() if t <= known)
        step = c.step_overhead_s + c.prefill_token_s * sent
        step += c.decode_token_s * self.decoding.get(endpoint, 0)
        return (step * c.time_scale + self.context_s(endpoint)) * (1 + self.model_error)

    def score(self, endpoint: str, now: float) -> tuple[float, ...]:
        known = self.known_step_end(endpoint, now) if self.sent_model else None
        if known is None or not self.busy(endpoint):
            return super().score(endpoint, now)
        step = self.next_step_s(endpoint)
        end = known + self.step_after_s(endpoint, known)
        if self.count_model:
            return (self._walk(endpoint, known, end, now, step) - now + step,)
        if self.late_model:  # not reported by the horizon: it had not ended by then
            end = max(end, now - self.report_delay_s)
        if end < now:  # later steps hold every request sent, back to back
            end += step * (1 + (now - end) // step)
        return (end - now + step,)

    def _walk(self, endpoint: str, known: float, end: float, now: float, step: float) -> float:
        """The end of the step in progress, walking the steps after `known` with their
        modelled lengths: a publishing step not reported by the horizon ends after it."""
        horizon = now - self.report_delay_s
        engine = self.engines[endpoint]
        # The step in progress, planned but not applied: whether it will publish is known
        # (a reference policy may read the engine; the docstring says what a router could).
        flags = self.recorders[endpoint].flags_after(known, engine._step)
        for i, published in enumerate(flags):
            if i:
                end += step
            if published:
                end = max(end, horizon)
            if end >= now:
                return end
        if end < now:  # past every step predicted: silent ones, back to back
            end += step * (1 + (now - end) // step)
        return end


RULES = ("none", "prompt", "vllm", "all")


def _variant(
    rule: str, delay_ms: float, model: str = "", ctx: bool = False, error: float = 0.0
) -> type[KVEventPhase]:
    """`model`: "" (modulo from the last known end), "sent", "count" or "late"; `ctx`: the
    step model counts the context read."""
    label = f"{rule}-{delay_ms:g}ms".replace(".", "p")
    label += (f"-{model}" if model else "") + ("-ctx" if ctx else "")
    label += f"-err{'p' if error > 0 else 'm'}{abs(error) * 100:g}" if error else ""
    return type(
        f"KVEventPhase_{label.replace('-', '_')}",
        (KVEventPhase,),
        {
            "name": f"ref-kv-phase-{label}",
            "rule": rule,
            "report_delay_s": delay_ms / 1000,
            "sent_model": bool(model),
            "count_model": model == "count",
            "late_model": model == "late",
            "context_model": ctx,
            "model_error": error,
            "__doc__": f"`ref-kv-phase-{label}` (see the module docstring).",
        },
    )


DELAYS_MS = (0.0, 0.5, 1.0, 2.0)
KV_EVENT_POLICIES: dict[str, type[KVEventPhase]] = {
    cls.name: cls
    for cls in (
        *(_variant(rule, d) for rule in ("prompt", "vllm") for d in DELAYS_MS),
        *(_variant("vllm", d, model) for d in DELAYS_MS for model in ("sent", "count", "late")),
        *(_variant("vllm", d, model, ctx=True) for d in DELAYS_MS for model in ("count", "late")),
        _variant("none", 0.0, "sent"),
        _variant("none", 0.0, "sent", ctx=True),
        _variant("all", 0.0, "sent"),
        *(_variant("all", d, "late", ctx=True) for d in DELAYS_MS),
        *(_variant("none", 0.0, "sent", True, e) for e in (0.03, -0.03)),
        *(_variant("vllm", d, "late", True, e) for d in (0.5, 1.0) for e in (0.03, -0.03)),
        *(_variant("vllm", d, "count", True, e) for d in (0.5, 1.0) for e in (0.03, -0.03)),
    )
}
