"""Seeded benchmark workloads: lists of request arrivals (`generate`).

Seven workloads (five from the benchmarks issue, two from flow control), each a `WorkloadSpec`
with documented parameters:

- `shared-prefix`: chat where groups of requests share a long system prompt (the shape of
  inference-perf's `shared_prefix` data type): `num_groups` groups chosen uniformly, a
  `system_tokens`-token system prompt per group, a short question and answer per request.
- `multi-lora`: tens of LoRA adapters with Zipf popularity (rank k drawn with weight
  1/k^zipf_s); the fleet has few adapter slots per server, so adapter swaps cost capacity.
- `mixed-criticality`: ShareGPT-like requests from three models of different criticality
  (Critical / Standard / Sheddable fractions), meant to be run into overload.
- `heavy-tail`: ShareGPT-like prompt and output lengths, every prompt unique.
- `heterogeneous`: shared-prefix chat with heavy-tailed questions, run on a fleet of servers
  with different speeds (the fleet side lives in `bench.workload.scenarios`).
- `fairness`: two Standard models (`tenant-heavy`, `tenant-light`) of ShareGPT-like requests,
  the heavy one offering `fairness_ratio` (10) times the light one's request rate: fair
  sharing of token throughput between InferenceModels of equal criticality (flow control).
- `criticality-flood`: a Critical trickle under a Sheddable flood (`criticality_mix` 10% /
  0% / 90%): at 3x capacity the Critical share alone is 0.3x. Critical latency must not suffer.

ShareGPT-like lengths are log-normal: prompt median 90 tokens (sigma 1.07), output median 200
tokens (sigma 1.0), clipped to [4, 4096] and [1, 2048]. The means (about 160 and 330 tokens)
match the ShareGPT statistics published in the vLLM paper (Kwon et al., SOSP 2023: mean input
161, mean output 338 tokens); the log-normal shape is the usual fit for such length data.

Determinism: request *contents* come from one random stream and *arrival times* from another,
both seeded from `seed`, so the same seed gives the same i-th request at every load; only the
Poisson arrival times change with the rate. That pairs requests across load points and
policies, so differences come from routing, not from sampling.

Prompt text is real text (random pseudo-words from a seeded vocabulary) so that prefix-cache
hashing in the simulator, the scheduler and the baselines behaves as it would on chat traffic.

This module owns the generation; what a workload and a request are (`WorkloadSpec`,
`Arrival`, the models) is `workload_spec`, their JSONL files `workload_files`.
"""

from __future__ import annotations

import bisect
import math
import random
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

from poolkeeper.api.criticality import Criticality
from poolkeeper.bench.workload.workload_spec import (
    BASE_MODEL,
    CRITICALITY_MODELS,
    FAIRNESS_MODELS,
    Arrival,
    WorkloadKind,
    WorkloadSpec,
)
from poolkeeper.errors import ConfigError
from poolkeeper.tokens import CHARS_PER_TOKEN


class _TextSource:
    """Seeded pseudo-word text; slices of one long corpus, cheap to cut at any length."""

    def __init__(self, seed: int) -> None:
        rng = random.Random(f"{seed}:corpus")
        letters = "abcdefghijklmnopqrstuvwxyz"
        vocab = ["".join(rng.choices(letters, k=rng.randint(2, 9))) for _ in range(2000)]
        self._corpus = " ".join(rng.choices(vocab, k=60_000))

    def text(self, rng: random.Random, chars: int) -> str:
        chars = max(1, chars)
        out: list[str] = []
        while chars > 0:
            take = min(chars, len(self._corpus) // 2)
            start = rng.randrange(0, len(self._corpus) - take)
            out.append(self._corpus[start : start + take])
            chars -= take
        return "".join(out)


def _lognormal_tokens(rng: random.Random, median: float, sigma: float, lo: int, hi: int) -> int:
    return min(hi, max(lo, round(median * math.exp(sigma * rng.gauss(0.0, 1.0)))))


def _exp_tokens(rng: random.Random, mean: int, lo: int = 1) -> int:
    return max(lo, round(rng.expovariate(1.0 / mean))) if mean > 0 else lo


@dataclass(slots=True)
class _ContentGenerator:
    spec: WorkloadSpec
    seed: int
    rng: random.Random = field(init=False)
    text: _TextSource = field(init=False)
    systems: list[str] = field(init=False, default_factory=list)
    zipf_cdf: list[float] = field(init=False, default_factory=list)

    def __post_init__(self) -> None:
        self.rng = random.Random(f"{self.seed}:content")
        self.text = _TextSource(self.seed)
        spec = self.spec
        if spec.kind in (WorkloadKind.SHARED_PREFIX, WorkloadKind.HETEROGENEOUS):
            sys_rng = random.Random(f"{self.seed}:systems")
            self.systems = [
                f"You are assistant {g} of tenant {g}. "
                + self.text.text(sys_rng, spec.system_tokens * CHARS_PER_TOKEN)
                for g in range(spec.num_groups)
            ]
        if spec.kind is WorkloadKind.MULTI_LORA:
            weights = [1.0 / (k**spec.zipf_s) for k in range(1, spec.num_adapters + 1)]
            total = sum(weights)
            acc = 0.0
            for w in weights:
                acc += w / total
                self.zipf_cdf.append(acc)

    def _sharegpt(self) -> tuple[int, int]:
        s = self.spec
        prompt = _lognormal_tokens(self.rng, s.prompt_median, s.prompt_sigma, 4, 4096)
        output = _lognormal_tokens(self.rng, s.output_median, s.output_sigma, 1, 2048)
        return prompt, output

    def _user(self, index: int, tokens: int) -> str:
        # The unique tag first, so prompts of different requests diverge right after the
        # shared part (prefix caches must not see false sharing).
        tag = f"[q{index}] "
        return tag + self.text.text(self.rng, tokens * CHARS_PER_TOKEN - len(tag))

    def make(self, index: int, time: float) -> Arrival:
        spec, rng = self.spec, self.rng
        rid = f"r{index:07d}"
        kind = spec.kind
        if kind is WorkloadKind.SHARED_PREFIX:
            g = rng.randrange(spec.num_groups)
            q = _exp_tokens(rng, spec.question_tokens, 4)
            out = _exp_tokens(rng, spec.output_tokens)
            return Arrival(
                rid, time, BASE_MODEL, BASE_MODEL, Criticality.STANDARD,
                self.systems[g], self._user(index, q), out, f"g{g}",
            )  # fmt: skip
        if kind is WorkloadKind.HETEROGENEOUS:
            g = rng.randrange(spec.num_groups)
            q, out = self._sharegpt()
            return Arrival(
                rid, time, BASE_MODEL, BASE_MODEL, Criticality.STANDARD,
                self.systems[g], self._user(index, q), out, f"g{g}",
            )  # fmt: skip
        if kind is WorkloadKind.MULTI_LORA:
            u = rng.random()
            k = min(bisect.bisect_left(self.zipf_cdf, u), spec.num_adapters - 1)
            adapter = f"adapter-{k:03d}"
            q, out = self._sharegpt()
            return Arrival(
                rid, time, adapter, adapter, Criticality.STANDARD, "", self._user(index, q),
                out, adapter,
            )  # fmt: skip
        if kind is WorkloadKind.FAIRNESS:
            heavy = rng.random() < spec.fairness_ratio / (spec.fairness_ratio + 1.0)
            model = FAIRNESS_MODELS[0 if heavy else 1]
            q, out = self._sharegpt()
            return Arrival(
                rid, time, model, BASE_MODEL, Criticality.STANDARD, "", self._user(index, q),
                out, model,
            )  # fmt: skip
        if kind in (WorkloadKind.MIXED_CRITICALITY, WorkloadKind.CRITICALITY_FLOOD):
            crit = rng.choices(list(CRITICALITY_MODELS), weights=spec.criticality_mix)[0]
            q, out = self._sharegpt()
            model = CRITICALITY_MODELS[crit]
            return Arrival(
                rid, time, model, BASE_MODEL, crit, "", self._user(index, q), out, str(crit)
            )
        q, out = self._sharegpt()
        return Arrival(
            rid, time, BASE_MODEL, BASE_MODEL, Criticality.STANDARD, "", self._user(index, q),
            out, "",
        )  # fmt: skip


def generate(spec: WorkloadSpec, *, rate: float, duration: float, seed: int) -> list[Arrival]:
    """Poisson arrivals at `rate` requests/s for `duration` seconds (all arrive before it)."""
    if rate <= 0 or duration <= 0:
        raise ConfigError(f"workload {spec.kind}: rate and duration must be > 0")
    times = random.Random(f"{seed}:arrivals")
    content = _ContentGenerator(spec, seed)
    out: list[Arrival] = []
    t = times.expovariate(rate)
    while t < duration:
        out.append(content.make(len(out), t))
        t += times.expovariate(rate)
    return out


def mean_request_shape(
    spec: WorkloadSpec, *, seed: int, samples: int = 2000
) -> tuple[float, float]:
    """Mean prompt and output tokens of the workload, estimated from `samples` requests."""
    content = _ContentGenerator(spec, seed)
    arrivals = [content.make(i, 0.0) for i in range(samples)]
    prompt = sum(a.prompt_tokens() for a in arrivals) / samples
    output = sum(a.output_tokens for a in arrivals) / samples
    return prompt, output


def retime(arrivals: Sequence[Arrival], factor: float) -> list[Arrival]:
    """The same requests with arrival times multiplied by `factor` (> 1 slows the load)."""
    return [replace(a, time=a.time * factor) for a in arrivals]
