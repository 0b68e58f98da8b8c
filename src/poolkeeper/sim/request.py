"""Values the engine model works with: a request inside an engine, and what a step produced.

Kept apart from sim/engine.py (the scheduling and timing logic) so that drivers, the HTTP layer
and the virtual fleet can import the values without the machinery.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum


class RequestStatus(Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"
    ABORTED = "aborted"


class UnknownModelError(LookupError):
    """The request names neither the base model nor a registered adapter."""


class InvalidRequestError(ValueError):
    """The request can never be served as asked (too long, LoRA disabled, ...)."""


@dataclass(slots=True, eq=False)
class SimRequest:
    """One request inside the engine. Times are the caller's clock (seconds)."""

    request_id: str
    model: str  # what the client asked for: the base model or an adapter name
    adapter: str | None  # None when `model` is the base model
    prompt_tokens: int
    max_tokens: int  # output tokens this request will produce
    arrival: float
    # Full blocks' chained hashes: the prompt's, then its output's as they are computed
    # (vLLM's `Request.block_hashes`; kept across a preemption so the recompute hits them).
    block_hashes: list[int] = field(repr=False)
    finish_reason: str = "length"  # "length" if max_tokens was given, else "stop"
    status: RequestStatus = RequestStatus.WAITING
    output_tokens: int = 0
    num_computed: int = 0  # tokens whose KV is computed in this incarnation
    cached_tokens: int = 0  # prefix-cache hit at first admission (reported in usage)
    first_token_time: float | None = None
    last_token_time: float | None = None
    finish_time: float | None = None
    preemptions: int = 0
    adapter_loaded: bool = False  # its admission swapped its adapter in
    admitted: bool = False
    held_hashed: list[int] = field(default_factory=list, repr=False)
    held_private: int = 0
    sink: object = field(default=None, repr=False)  # the driver's handle (stream, result)
    # Output blocks are hashed (sim/kvcache.py `output_block_hash`) when the prompt text is
    # known and its token count is the text's (None: they stay private); `text_seed` names the
    # output text (sim/textgen.py).
    hash_text: str | None = field(default=None, repr=False)
    text_seed: int = 0

    @property
    def num_tokens(self) -> int:
        return self.prompt_tokens + self.output_tokens

    @property
    def done(self) -> bool:
        return self.status in (RequestStatus.FINISHED, RequestStatus.ABORTED)


@dataclass(slots=True)
class StepOutcome:
    """What one step produced, at time `time` (the step's end).

    With fused decode steps (see EngineModel.max_fused_steps) one outcome stands for `steps`
    consecutive decode steps that each gave every request in `tokens` one token: step j
    (0-based) ends at `start + (j + 1) * first_duration + growth * j * (j + 1) / 2`.
    """

    time: float
    tokens: list[SimRequest]  # requests that received a new token (first tokens included)
    finished: list[SimRequest]  # of those, the ones that are now complete
    steps: int = 1
    start: float = 0.0
    first_duration: float = 0.0
    growth: float = 0.0

    @property
    def first_time(self) -> float:
        """End of the first step of this outcome."""
        return self.time if self.steps == 1 else self.start + self.first_duration

    @property
    def longest_step(self) -> float:
        return self.first_duration + self.growth * (self.steps - 1) if self.steps > 1 else 0.0

    def step_ends(self) -> list[float]:
        if self.steps == 1:
            return [self.time]
        a, d, s = self.first_duration, self.growth, self.start
        return [s + (j + 1) * a + d * j * (j + 1) / 2 for j in range(self.steps)]
