"""Seeded benchmark workloads: lists of request arrivals, saved and loaded as JSONL files.

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
"""

from __future__ import annotations

import bisect
import json
import math
import random
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from enum import StrEnum
from pathlib import Path
from typing import Any

from poolkeeper.api.criticality import Criticality
from poolkeeper.errors import ConfigError
from poolkeeper.tokens import CHARS_PER_TOKEN, chat_prompt_text, count_tokens

BASE_MODEL = "base-model"


class WorkloadKind(StrEnum):
    SHARED_PREFIX = "shared-prefix"
    MULTI_LORA = "multi-lora"
    MIXED_CRITICALITY = "mixed-criticality"
    HEAVY_TAIL = "heavy-tail"
    HETEROGENEOUS = "heterogeneous"
    FAIRNESS = "fairness"
    CRITICALITY_FLOOD = "criticality-flood"


@dataclass(frozen=True, slots=True)
class Arrival:
    """One request of a workload: when it arrives, what it asks, how long its answer is."""

    request_id: str
    time: float  # seconds since the start of the run
    model: str  # client-facing model name
    target_model: str  # base model or LoRA adapter the request runs on
    criticality: Criticality
    system: str  # system prompt ("" for none); shared between requests of one group
    user: str  # the user's message
    output_tokens: int
    group: str = ""  # prefix group, adapter or other label used in reports

    def messages(self) -> list[dict[str, str]]:
        out: list[dict[str, str]] = []
        if self.system:
            out.append({"role": "system", "content": self.system})
        out.append({"role": "user", "content": self.user})
        return out

    def prompt_text(self) -> str:
        """The chat rendered as poolkeeper renders it (`poolkeeper.tokens.chat_prompt_text`)."""
        return chat_prompt_text(self.messages())

    def prompt_tokens(self) -> int:
        return count_tokens(self.prompt_text())


@dataclass(frozen=True, slots=True)
class WorkloadSpec:
    """Parameters of one workload. Unused fields are ignored by kinds that do not need them."""

    kind: WorkloadKind
    num_groups: int = 16  # shared-prefix / heterogeneous: number of system prompts
    system_tokens: int = 2000  # shared-prefix: system prompt length
    question_tokens: int = 100  # shared-prefix: mean question length (exponential spread)
    output_tokens: int = 150  # shared-prefix: mean answer length (exponential spread)
    num_adapters: int = 32  # multi-lora
    zipf_s: float = 1.0  # multi-lora: popularity exponent
    criticality_mix: tuple[float, float, float] = (0.2, 0.5, 0.3)  # Critical/Standard/Sheddable
    prompt_median: float = 90.0  # ShareGPT-like prompt length median (tokens)
    prompt_sigma: float = 1.07
    output_median: float = 200.0  # ShareGPT-like output length median (tokens)
    output_sigma: float = 1.0
    fairness_ratio: float = 10.0  # fairness: heavy model's request rate / light model's

    def describe(self) -> dict[str, Any]:
        data: dict[str, Any] = {"kind": str(self.kind)}
        for name in _FIELDS_BY_KIND[self.kind]:
            value = getattr(self, name)
            data[name] = list(value) if isinstance(value, tuple) else value
        return data


_SHAREGPT_FIELDS = ("prompt_median", "prompt_sigma", "output_median", "output_sigma")
_FIELDS_BY_KIND: dict[WorkloadKind, tuple[str, ...]] = {
    WorkloadKind.SHARED_PREFIX: ("num_groups", "system_tokens", "question_tokens", "output_tokens"),
    WorkloadKind.MULTI_LORA: ("num_adapters", "zipf_s", *_SHAREGPT_FIELDS),
    WorkloadKind.MIXED_CRITICALITY: ("criticality_mix", *_SHAREGPT_FIELDS),
    WorkloadKind.HEAVY_TAIL: _SHAREGPT_FIELDS,
    WorkloadKind.HETEROGENEOUS: ("num_groups", "system_tokens", *_SHAREGPT_FIELDS),
    WorkloadKind.FAIRNESS: ("fairness_ratio", *_SHAREGPT_FIELDS),
    WorkloadKind.CRITICALITY_FLOOD: ("criticality_mix", *_SHAREGPT_FIELDS),
}

FAIRNESS_MODELS: tuple[str, str] = ("tenant-heavy", "tenant-light")

# The routing-quality set that `bench sim` and `bench all` sweep by default; the flow-control
# workloads are measured by `bench flow` (or `bench sim --workload fairness`).
ROUTING_WORKLOADS: tuple[WorkloadKind, ...] = (
    WorkloadKind.SHARED_PREFIX, WorkloadKind.MULTI_LORA, WorkloadKind.MIXED_CRITICALITY,
    WorkloadKind.HEAVY_TAIL, WorkloadKind.HETEROGENEOUS,
)  # fmt: skip

CRITICALITY_MODELS: dict[Criticality, str] = {
    Criticality.CRITICAL: "chat-critical",
    Criticality.STANDARD: "chat-standard",
    Criticality.SHEDDABLE: "chat-sheddable",
}


def default_spec(kind: WorkloadKind | str, servers: int) -> WorkloadSpec:
    """The documented default parameters of a workload for a fleet of `servers` servers.

    Shared-prefix chat has 32 system prompts of 2,000 tokens per server (at most 4,096): with
    perfect affinity each server keeps ~64k tokens of prefixes, while a server that sees every
    group needs 64k x servers, more than one server's KV cache (~450k tokens) from 8 servers
    up. That is the regime where prefix-aware routing is supposed to pay off. The heterogeneous
    chat uses 16 shorter (800-token) prompts per server so that speed, not only cache, decides.
    Multi-LoRA has 32 adapters (4 per server beyond 8 servers).
    """
    kind = WorkloadKind(kind)
    if kind is WorkloadKind.SHARED_PREFIX:
        return WorkloadSpec(kind, num_groups=min(4096, 32 * servers))
    if kind is WorkloadKind.HETEROGENEOUS:
        return WorkloadSpec(kind, num_groups=min(4096, 16 * servers), system_tokens=800)
    if kind is WorkloadKind.MULTI_LORA:
        return WorkloadSpec(kind, num_adapters=max(32, 4 * servers))
    if kind is WorkloadKind.CRITICALITY_FLOOD:
        return WorkloadSpec(kind, criticality_mix=(0.1, 0.0, 0.9))
    return WorkloadSpec(kind)


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


# -- files -------------------------------------------------------------------------------------

_HEADER_KEY = "poolkeeper_workload"


def save_jsonl(path: Path, arrivals: Iterable[Arrival], meta: dict[str, Any]) -> None:
    """One header line ({"poolkeeper_workload": meta}) then one JSON object per request."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8") as fh:
        fh.write(json.dumps({_HEADER_KEY: meta}) + "\n")
        for a in arrivals:
            row = {
                "request_id": a.request_id,
                "time": round(a.time, 6),
                "model": a.model,
                "target_model": a.target_model,
                "criticality": str(a.criticality),
                "system": a.system,
                "user": a.user,
                "output_tokens": a.output_tokens,
                "group": a.group,
            }
            fh.write(json.dumps(row) + "\n")


def _parse_row(path: Path, lineno: int, row: Any) -> Arrival:
    where = f"{path}:{lineno}"
    if not isinstance(row, dict):
        raise ConfigError(f"{where}: expected a JSON object")
    try:
        return Arrival(
            request_id=str(row["request_id"]),
            time=float(row["time"]),
            model=str(row["model"]),
            target_model=str(row.get("target_model", row["model"])),
            criticality=Criticality(row.get("criticality", "Standard")),
            system=str(row.get("system", "")),
            user=str(row["user"]),
            output_tokens=int(row["output_tokens"]),
            group=str(row.get("group", "")),
        )
    except KeyError as exc:
        raise ConfigError(f"{where}: missing field {exc.args[0]!r}") from exc
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"{where}: bad value: {exc}") from exc


def iter_jsonl(path: Path) -> Iterator[Arrival]:
    with path.open(encoding="utf-8") as fh:
        for lineno, line in enumerate(fh, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ConfigError(f"{path}:{lineno}: invalid JSON: {exc.msg}") from exc
            if isinstance(row, dict) and _HEADER_KEY in row:
                continue
            yield _parse_row(path, lineno, row)


def load_jsonl(path: Path) -> tuple[dict[str, Any], list[Arrival]]:
    """The header's metadata (empty if absent) and the arrivals, sorted by time."""
    meta: dict[str, Any] = {}
    with path.open(encoding="utf-8") as fh:
        first = fh.readline()
    try:
        head = json.loads(first) if first.strip() else None
    except json.JSONDecodeError:
        head = None
    if isinstance(head, dict) and isinstance(head.get(_HEADER_KEY), dict):
        meta = head[_HEADER_KEY]
    arrivals = sorted(iter_jsonl(path), key=lambda a: a.time)
    return meta, arrivals
