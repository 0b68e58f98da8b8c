"""`bench flow --grid`: fair sharing between equal-criticality models on fleets of any shape.

Two Standard models share a virtual fleet (`servers` x `slots`, vLLM's max_num_seqs): `alpha`
offers ten times what `beta` offers, in a closed loop (a fixed population of clients, each
sending its next request when its answer, or its refusal, comes back; the issue 35 case is 2
servers x 2 slots, alpha 30 clients, beta 3, 30 output tokens, time scale 5, 25 s) or an open
loop (Poisson arrivals, alpha at 4x and beta at 0.8x the fleet's closed-loop rate, so both are
backlogged). `tokens: weighted` gives beta answers ten times longer than alpha's, so fair
sharing must count tokens, not requests. One Critical request is sent into the run at a third
of its length ("the probe"): it must be served.

Per policy, over the last two thirds of the run: served tokens per model per second (a
request's prompt when its first token comes, its output spread over its decoding:
`served_in`), beta/alpha, Jain's index over the two models' tokens,
goodput (all tokens per second) and output tokens per second alone, the share of the fleet's
batch-slot time held by requests (`slots_busy`: from a request's first token to its end),
Standard refusals by rule, the probe's outcome and TTFT. Output tokens are the fleet's work:
a 32-token prompt costs the engine about a quarter of one decode step, while each output
token holds a batch slot for a whole step, so a policy that serves the short-answer model
more counts more tokens with the same work (token-weighted cells: `format_grid` shows both
ratios, and the slots busy under each: fair sharing idles none).
Policies: `poolkeeper` (the default `spec.flowControl`), `poolkeeper-pre35` (the defaults
before issue 35: `dispatch: saturation`, Standard's `lifoAfterMs` 200 and `overloadTtlMs` 300
applied whenever a queue stands, `onlyWhileGrowing: false`, answers charged at their end
with `outputTokenWeight` 2),
and `poolkeeper-shed` (no queue: admission's shedding, the non-fair baseline).

Deterministic for a seed (virtual time, seeded engines and arrivals). This module owns one
case's run and measurements (`run_case`); the grid of cases and its tables are `fairshare_grid`.
"""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from poolkeeper.api.criticality import Criticality
from poolkeeper.bench.fleet.simrun import route_step
from poolkeeper.bench.policies.flowpolicy import FlowPolicy, flow_policy
from poolkeeper.bench.policies.schedpolicy import SchedulerPolicy
from poolkeeper.datastore.endpoint import EndpointState
from poolkeeper.flowcontrol.config import FlowControlConfig
from poolkeeper.scheduling.types import LLMRequest
from poolkeeper.sim.params import EngineConfig
from poolkeeper.sim.virtual import Send, VirtualFleet
from poolkeeper.sim.virtual_results import Arrival, RequestResult

ALPHA, BETA, PROBE = "alpha", "beta", "probe"
PROMPT_TOKENS = 32
SCRAPE_S = 0.05
RETRY_S = 0.2  # a refused closed-loop client sends again after this long

PRE35: dict[str, Any] = {
    "chargeAnswersAhead": False,
    "outputTokenWeight": 2,
    "bands": {
        "standard": {
            "dispatch": "saturation",
            "lifoAfterMs": 200,
            "overloadTtlMs": 300,
            "onlyWhileGrowing": False,
        },
        "sheddable": {"dispatch": "saturation"},
    },
}
POLICIES: dict[str, dict[str, Any] | None] = {
    "poolkeeper": {},
    "poolkeeper-pre35": PRE35,
    "poolkeeper-shed": None,  # flow control off
}


@dataclass(frozen=True, slots=True)
class FairCase:
    servers: int = 2
    slots: int = 2
    loop: str = "closed"  # closed | open
    tokens: str = "equal"  # equal | weighted (beta's answers 10x alpha's)
    alpha_clients: int = 30  # closed loop
    beta_clients: int = 3
    alpha_rate: float = 0.0  # open loop, requests/s
    beta_rate: float = 0.0
    output_tokens: int = 30
    duration_s: float = 25.0
    time_scale: float = 5.0

    def outputs(self, model: str) -> int:
        if model == BETA and self.tokens == "weighted":
            return self.output_tokens * 10
        return self.output_tokens

    def label(self) -> str:
        return f"{self.servers}x{self.slots} {self.loop} {self.tokens}"


def issue35_case() -> FairCase:
    """The case of issue 35 (its live run: `poolkeeper sim --max-num-seqs 2 --time-scale 5`)."""
    return FairCase()


class _Clients:
    """The arrivals: closed-loop clients (each sends again on an answer) or an open loop."""

    def __init__(self, case: FairCase, seed: int) -> None:
        self.case = case
        self.rng = random.Random(f"{seed}:clients")
        self.seq = 0
        self.client_of: dict[str, str] = {}

    def _make(self, model: str, client: str, at: float, criticality: Criticality) -> Arrival:
        self.seq += 1
        rid = f"{client}-{self.seq}"
        self.client_of[rid] = client
        prompt = f"{client} request {self.seq} " + "tok " * PROMPT_TOKENS
        request = LLMRequest(
            request_id=rid, model=model, target_model=EngineConfig().model,
            criticality=criticality, prompt=prompt, prompt_tokens=PROMPT_TOKENS,
            max_tokens=self.case.outputs(model), stream=True,
        )  # fmt: skip
        return Arrival(at, rid, EngineConfig().model, prompt=prompt,
                       max_tokens=self.case.outputs(model), prompt_tokens=PROMPT_TOKENS,
                       payload=request)  # fmt: skip

    def initial(self) -> list[Arrival]:
        case, out = self.case, []
        if case.loop == "closed":
            for model, n in ((ALPHA, case.alpha_clients), (BETA, case.beta_clients)):
                for c in range(n):
                    at = self.rng.uniform(0.0, 0.5)
                    out.append(self._make(model, f"{model}{c}", at, Criticality.STANDARD))
        else:
            for model, rate in ((ALPHA, case.alpha_rate), (BETA, case.beta_rate)):
                t = 0.0
                while rate > 0:
                    t += self.rng.expovariate(rate)
                    if t >= case.duration_s:
                        break
                    out.append(self._make(model, model, t, Criticality.STANDARD))
        out.append(self._make(PROBE, PROBE, case.duration_s / 3, Criticality.CRITICAL))
        out.sort(key=lambda a: a.time)
        return out

    def follow(self, result: RequestResult, now: float) -> Iterable[Arrival]:
        if self.case.loop != "closed" or now >= self.case.duration_s:
            return ()
        request: LLMRequest = result.payload  # type: ignore[assignment]
        if request.model == PROBE:
            return ()
        at = now if result.status == "ok" else now + RETRY_S
        return (self._make(request.model, self.client_of[result.request_id], at,
                           Criticality.STANDARD),)  # fmt: skip


def _policy(name: str, seed: int) -> FlowPolicy | SchedulerPolicy:
    spec = POLICIES[name]
    config = (
        FlowControlConfig(enabled=False) if spec is None else FlowControlConfig.model_validate(spec)
    )
    return flow_policy("poolkeeper", random.Random(f"{seed}:policy"), config)


def run_case(case: FairCase, policy_name: str, seed: int = 1) -> dict[str, Any]:
    """One policy on one case: the measurements of the module docstring."""
    engine = EngineConfig(max_num_seqs=case.slots, time_scale=case.time_scale)
    fleet = VirtualFleet([engine] * case.servers, seed=seed, scrape_interval=SCRAPE_S)
    index_of = {e.hostport: i for i, e in enumerate(fleet.endpoints)}
    policy = _policy(policy_name, seed)
    queueing = policy if isinstance(policy, FlowPolicy) else None
    clients = _Clients(case, seed)

    def route(a: Arrival, states: Sequence[EndpointState], now: float) -> int | None:
        request: LLMRequest = a.payload  # type: ignore[assignment]
        return route_step(policy, request, states, now, index_of)

    def release(states: Sequence[EndpointState], now: float, send: Send) -> None:
        assert queueing is not None

        def to_fleet(rid: str, chosen: EndpointState | None, error: str | None) -> None:
            send(rid, None if chosen is None else index_of[chosen.key], error)

        queueing.release(states, now, to_fleet)

    def finished(result: RequestResult) -> None:
        policy.on_finish(result.request_id, result.server_name, result.finish or 0.0)

    result = fleet.run(
        _sorted(clients.initial()), route, on_finish=finished,
        release=release if queueing is not None else None, follow=clients.follow,
    )  # fmt: skip
    lo, hi = case.duration_s / 3, case.duration_s
    served = dict.fromkeys((ALPHA, BETA), 0.0)
    output = busy = 0.0
    probe: dict[str, Any] = {"status": "missing"}
    refused: Counter[str] = Counter()
    ok: Counter[str] = Counter()
    for r in result.requests:
        request: LLMRequest = r.payload  # type: ignore[assignment]
        if request.model == PROBE:
            probe = {"status": r.status, "ttft_s": r.ttft}
            continue
        if r.status == "ok":
            ok[request.model] += 1
        else:  # the rule: what flow control recorded, else admission's shedding
            ends = queueing.ends if queueing is not None else {}
            refused[ends.get(r.request_id, r.error or "shed")] += 1
        if r.status == "ok" and r.finish is not None:
            first = r.finish if r.first_token is None else r.first_token
            served[request.model] += served_in(
                lo, hi, first, r.finish, r.prompt_tokens, r.completion_tokens
            )
            output += served_in(lo, hi, first, r.finish, 0, r.completion_tokens)
            busy += max(0.0, min(hi, r.finish) - max(lo, first))
    summary = case_summary(served, hi - lo, ok, refused, probe, len(result.requests))
    slot_s = case.servers * case.slots * (hi - lo)
    return (
        {"policy": policy_name}
        | summary
        | {
            "output_tok_s": output / (hi - lo),
            "slots_busy": busy / slot_s,
        }
    )


def served_in(lo: float, hi: float, first: float, finish: float, prompt: int, output: int) -> float:
    """The tokens of one request served within [lo, hi): its prompt when its first token
    came (the prefill is done), its output spread evenly from the first token to the end.
    Counting a request's tokens at its end instead made the measurement lumpy where answers
    are long against the window (300-token answers took a second of a 4 s window: beta/alpha
    moved by a tenth with one request more or less)."""
    tokens = float(prompt) if lo <= first < hi else 0.0
    if finish <= first:
        return tokens + (output if lo <= finish < hi else 0.0)
    overlap = max(0.0, min(hi, finish) - max(lo, first))
    return tokens + output * overlap / (finish - first)


def case_summary(
    served: dict[str, float],
    window_s: float,
    ok: Counter[str],
    refused: Counter[str],
    probe: dict[str, Any],
    requests: int,
) -> dict[str, Any]:
    """One case's measurements from the tokens each model was served in the measured window:
    the one shape the virtual run here and the live run (`bench.live.fairlive`) both report."""
    rates = {m: v / window_s for m, v in served.items()}
    return {
        "served_tok_s": rates,
        "beta_to_alpha": rates[BETA] / max(rates[ALPHA], 1e-9),
        "jain": jain(list(rates.values())),
        "goodput_tok_s": sum(rates.values()),
        "completed": dict(ok),
        "standard_refused": sum(refused.values()),
        "refused": dict(refused),
        "probe": probe,
        "requests": requests,
    }


def _sorted(arrivals: list[Arrival]) -> Iterator[Arrival]:
    yield from sorted(arrivals, key=lambda a: a.time)


def jain(values: Sequence[float]) -> float:
    """Jain's fairness index: 1 when all are equal, 1/n when one takes everything."""
    total, squares = sum(values), sum(v * v for v in values)
    return 1.0 if squares == 0 else total * total / (len(values) * squares)
