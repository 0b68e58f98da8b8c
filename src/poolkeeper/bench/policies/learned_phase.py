"""Reference policies that learn each server's step model from what the EPP sees (issue #38).

`ref-kv-phase-none-0ms-sent-ctx` (`kv_event_phase.py`) reached 0.85x round-robin's p90 TTFT
from first bytes and ends alone, but read two things from the engine no router has: the
step-time coefficients and each running request's context (`num_computed`). These policies
use only the router's own sends (time, prompt tokens, server, `max_tokens`), each request's
first byte and end (both step ends on that server) and the output token count at the end
(the usage the EPP reads from the response; in the simulator it equals `max_tokens`), and
the engines' block size, a deployment setting (the prompt blocks it hashes). The recorder and
step hook its base class installs (rule `none`) feed it nothing.

Per server, a `StepLearner` (`scheduling/steplearner.py`) counts the steps between observed
step ends and fits the four-term step model to them, anchored by the usage counts; the prompt blocks
the router sent a server before are taken as cached there (its prefill is the rest).

Variants: `ref-learned-phase` (fit from a prior 2x the simulator's default coefficients;
in the heterogeneous fleet 4x, 2x and 1x per server), `-half` (prior 0.5x), `-oracle` (the
engine's coefficients, given; the context still estimated), `-late1ms`, `-oracle-late1ms` and
`-late0p25ms` (each first byte and end reaches the router 0-1 ms or 0-0.25 ms late, uniform:
Envoy and the network; a step's reports within that of its first are one group);
`ref-learned-kv-phase-<late>` (rule `vllm`: each publishing step's KV-event batch is a step end
at its `ts`; batches, first bytes and ends all reach the router exactly `late` after the step, at
the step's time, and the `late` estimator's horizon; `-none-<late>`: no batches), in
docs/notes/2026-12-07-kv-step-clock.md. Scoring is
`ref-kv-phase-none-0ms-sent-ctx`'s with the learnt model and context."""

from __future__ import annotations

import heapq
import math
import random
from collections.abc import Sequence
from functools import partial

from poolkeeper.bench.policies.kv_event_phase import KVEventPhase
from poolkeeper.datastore.endpoint import EndpointState
from poolkeeper.scheduling.steplearner import Coefficients, StepLearner
from poolkeeper.scheduling.types import LLMRequest
from poolkeeper.sim.kvcache import prompt_block_hashes
from poolkeeper.sim.params import EngineConfig
from poolkeeper.sim.virtual import VirtualFleet

FIRST, END, BATCH = 0, 1, 2  # kinds of report


def default_coefficients(factor: float = 1.0) -> Coefficients:
    """The simulator's default coefficients (time_scale 1) times `factor`: a generic prior."""
    c = EngineConfig()
    return (
        factor * c.step_overhead_s,
        factor * c.prefill_token_s,
        factor * c.decode_token_s,
        factor * c.kv_read_token_s,
    )


class LearnedPhase(KVEventPhase):
    """`ref-learned-phase*` (see the module docstring)."""

    name = "ref-learned-phase"
    rule = "none"
    sent_model = True
    context_model = True
    prior_factor: float | None = 2.0  # None: the engine's own coefficients (the oracle)
    report_late_s = 0.0  # each first byte and end reaches the router 0 to this late (uniform)
    stamped_late_s = 0.0  # `-kv`: batches, first bytes and ends this late, at their step's ts

    def __init__(self, rng: random.Random) -> None:
        super().__init__(rng)
        self.learners: dict[str, StepLearner] = {}
        self.out: dict[str, int | None] = {}  # id -> output tokens (the usage at the end)
        self.blocks: dict[str, set[int]] = {}  # endpoint -> prompt blocks sent there
        # Reports on their way: (time seen, order, kind, request id, server, time to handle at).
        self.late: list[tuple[float, int, int, str, str, float]] = []
        self.first_seen: dict[str, float] = {}
        self.late_order = 0
        self.late_rng = random.Random(f"{self.name}:late")

    def bind(self, fleet: VirtualFleet) -> None:
        super().bind(fleet)
        for endpoint, engine in zip(fleet.endpoints, fleet.engines, strict=True):
            # A step's reports arrive spread over `report_late_s` (steps are longer): one group.
            merge = self.report_late_s
            if self.prior_factor is None:
                c, ts = engine.config, engine.config.time_scale
                oracle = (c.step_overhead_s * ts, c.prefill_token_s * ts, c.decode_token_s * ts,
                          c.kv_read_token_s * ts)  # fmt: skip
                learner = StepLearner(oracle, learn=False, merge_s=merge)
            else:
                learner = StepLearner(default_coefficients(self.prior_factor), merge_s=merge)
            self.learners[endpoint.hostport] = learner
            if self.rule != "none":  # each publishing step's batch, at the engine's ts
                self.recorders[endpoint.hostport].on_publish = partial(
                    self.batch, endpoint.hostport
                )

    def pick(
        self, request: LLMRequest, endpoints: Sequence[EndpointState], now: float
    ) -> EndpointState:
        self._flush(now)
        for learner in self.learners.values():
            learner.advance(now)
        chosen = super().pick(request, endpoints, now)
        cached = self._cached(chosen.key, request)
        self.learners[chosen.key].sent(request.request_id, request.prompt_tokens, now, cached)
        self.out[request.request_id] = request.max_tokens
        return chosen

    def on_first_token(self, request_id: str, now: float) -> None:
        if not self._defer(FIRST, request_id, "", now):
            self._first_token(request_id, now)

    def on_finish(self, request_id: str, server: str, now: float) -> None:
        if not self._defer(END, request_id, server, now):
            self._finish(request_id, server, now)

    def batch(self, endpoint: str, ts: float) -> None:
        """A KV-event batch stamped `ts` by the engine at `endpoint` (rule `vllm` variants)."""
        if not self._defer(BATCH, "", endpoint, ts):
            self.learners[endpoint].step_ended(ts)

    def _first_token(self, request_id: str, now: float) -> None:
        where = self._where.get(request_id)
        if where is not None:
            self.learners[where[0]].observed(request_id, now, first=True, out=None)
        super().on_first_token(request_id, now)

    def _finish(self, request_id: str, server: str, now: float) -> None:
        where = self._where.get(request_id)
        out = self.out.pop(request_id, None)
        if where is not None:
            self.learners[where[0]].observed(request_id, now, first=False, out=out)
        super().on_finish(request_id, server, now)

    def _defer(self, kind: int, request_id: str, server: str, now: float) -> bool:
        """Queue a report to be seen later; False: handle it now. `report_late_s`: seen 0 to
        that late (uniform), at the time seen, a request's end never before its first byte.
        `stamped_late_s`: seen exactly that late, at the step's own time (`now`)."""
        if not self.report_late_s and not self.stamped_late_s:
            return False
        self._flush(now)
        if self.stamped_late_s:
            seen, stamp = now + self.stamped_late_s, now
        else:
            seen = stamp = now + self.late_rng.uniform(0.0, self.report_late_s)
            if kind == FIRST:
                self.first_seen[request_id] = seen
            elif kind == END:
                seen = stamp = max(seen, self.first_seen.pop(request_id, seen))
        self.late_order += 1
        heapq.heappush(self.late, (seen, self.late_order, kind, request_id, server, stamp))
        return True

    def _flush(self, now: float) -> None:
        while self.late and self.late[0][0] <= now:
            _, _, kind, request_id, server, stamp = heapq.heappop(self.late)
            if kind == FIRST:
                self._first_token(request_id, stamp)
            elif kind == END:
                self._finish(request_id, server, stamp)
            else:
                self.learners[server].step_ended(stamp)

    def _cached(self, endpoint: str, request: LLMRequest) -> int:
        """Prompt tokens the server probably has cached: the leading blocks of prompts this
        router sent it before (no eviction: the simulated caches rarely evict in 15 s)."""
        size = self.engines[endpoint].config.block_size
        hashes = prompt_block_hashes(request.prompt, size, request.target_model)
        sent = self.blocks.setdefault(endpoint, set())
        hit = next((i for i, h in enumerate(hashes) if h not in sent), len(hashes))
        sent.update(hashes)
        return min(hit * size, max(0, request.prompt_tokens - 1))

    def known_step_end(self, endpoint: str, now: float) -> float | None:
        # The learner's last step boundary: the earliest report of the last step seen (the
        # closest to its end when reports come late), or a send to an idle server.
        learner = self.learners[endpoint]
        start = learner.boundary if learner.group_at is None else learner.group_at
        if start is None or start > now:
            return super().known_step_end(endpoint, now)
        return start

    def context_s(self, endpoint: str) -> float:
        return 0.0  # in `_model_s`

    def _model_s(self, endpoint: str, prefill: int, prompt: int) -> float:
        learner = self.learners[endpoint]
        decoding = self.decoding.get(endpoint, 0)
        return learner.step_s(prefill, decoding, learner.context() + prompt)

    def next_step_s(self, endpoint: str) -> float:
        learner = self.learners[endpoint]
        return self._model_s(
            endpoint, learner.prefill_sent(math.inf), learner.prompt_sent(math.inf)
        )

    def step_after_s(self, endpoint: str, known: float) -> float:
        learner = self.learners[endpoint]
        return self._model_s(endpoint, learner.prefill_sent(known), learner.prompt_sent(known))


def _variant(
    label: str, prior_factor: float | None, late_s: float = 0.0, **kv: object
) -> type[LearnedPhase]:
    name = f"ref-learned{label}" if kv else f"ref-learned-phase{label}"
    return type(
        f"LearnedPhase{label.replace('-', '_')}",
        (LearnedPhase,),
        {
            "name": name,
            "prior_factor": prior_factor,
            "report_late_s": late_s,
            "__doc__": f"`{name}` (module docstring).",
            **kv,
        },
    )


def _kv_variant(rule: str, ms: str) -> type[LearnedPhase]:
    """`ref-learned-kv-phase[-none]-<ms>ms`: KV batches (rule `vllm`; `none`: no batches), first
    bytes and ends reach the router exactly `ms` late, stamped with their step's end."""
    late = float(ms.replace("p", ".")) / 1000
    label = f"-kv-phase{'-none' if rule == 'none' else ''}-{ms}ms"
    return _variant(
        label, 2.0, rule=rule, stamped_late_s=late, report_delay_s=late, late_model=True
    )


LEARNED_PHASE_POLICIES: dict[str, type[LearnedPhase]] = {
    cls.name: cls
    for cls in (
        _variant("", 2.0),
        _variant("-half", 0.5),
        _variant("-oracle", None),
        _variant("-late0p25ms", 2.0, 0.00025),
        _variant("-late1ms", 2.0, 0.001),
        _variant("-oracle-late1ms", None, 0.001),
        # As late as the EPP hears step ends live (docs/notes/2026-12-07-step-signal-timing.md).
        *(
            _variant(f"-late{ms}ms", 2.0, float(ms.replace("p", ".")) / 1000)
            for ms in ("2p5", "5", "10", "20")
        ),
        *(_kv_variant("vllm", ms) for ms in ("0", "0p5", "1", "2", "5")),
        *(_kv_variant("none", ms) for ms in ("1", "5")),
    )
}
