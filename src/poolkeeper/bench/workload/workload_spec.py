"""What a benchmark workload is: its kind (`WorkloadKind`), its parameters (`WorkloadSpec`,
`default_spec` per kind and fleet size), the client models it names (`BASE_MODEL`,
`FAIRNESS_MODELS`, `CRITICALITY_MODELS`) and one request of it (`Arrival`). The seven
workloads and how their requests are generated: `workloads`; their JSONL files:
`workload_files`."""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from poolkeeper.api.criticality import Criticality
from poolkeeper.tokens import chat_prompt_text, count_tokens

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
