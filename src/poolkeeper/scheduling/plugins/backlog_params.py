"""The `prefill-backlog-scorer`'s parameters (`PrefillBacklogParams`) and `SendTap`, what it
tells cross-replica sync of this EPP's own sends (`backlog_scorer.py` has the rule).

Options measured as candidates for the default (issue 38; none adopted: each sends work where
the request's own first token comes soonest, selfish routing that piles work onto the fast
servers of a mixed fleet past their capacity; docs/notes/2026-12-06-routing-quality-third-round.md):
`drainRate` divides each cost by the endpoint's measured drain rate (`PrefillBacklog.rates`), a
wait in seconds; `marginal` adds the request's own uncached tokens once per request already in
that backlog (an engine prefills waiting requests together, so each of their first tokens waits
for this prompt too); `busyPenalty` divides each cost by 1 - the endpoint's utilisation (the
queueing marginal cost); `spanTokens` scores span / (span + cost - lowest), 0.5 for that many
tokens more ahead whatever the prompt's length; `meanSpan` takes span = the lowest cost plus
the candidates' mean backlog. `fadeFrom` / `fadeTo` (fourth round) fade the scores towards 1 as
the pool's busy share (time-averaged share of candidates with a backlog) rises from one to the
other: the rule has its say below capacity, where it wins, and none as the pool saturates,
where the selfish effect sets in. `fadeRiseS` (fifth round) averages a rising share faster
than a falling one, so a burst that fills the pool at once (a cold start) is placed without
the backlog; the 1 s average alone reached 0.8 only 1.5 s into such a burst.
"""

from __future__ import annotations

from typing import Protocol

from pydantic import Field

from poolkeeper.scheduling.interfaces import CycleState
from poolkeeper.scheduling.registry import PluginParams
from poolkeeper.scheduling.types import LLMRequest


class PrefillBacklogParams(PluginParams):
    prefix_scorer: str = Field(
        default="",
        description="Name of a prefix-cache-scorer instance whose index gives the expected "
        "prefix hit (default empty: every prompt counts as uncached).",
    )
    base_tokens: int = Field(
        default=128,
        ge=1,
        description="Tokens added to every cost: the fixed part of the step a first token "
        "waits for, in prefill tokens (default 128: a 6 ms step overhead at 45 us per token).",
    )
    adapter_tokens: int = Field(
        default=2048,
        ge=0,
        description="Tokens added where the request's LoRA adapter is not resident (neither "
        "active nor the served base model): loading it, and the adapter it evicts.",
    )
    speed_tolerance: float | None = Field(
        default=0.3,
        ge=0,
        description="Costs on an endpoint the router measured as slower per output token than "
        "(1 + this) x the fastest are scaled by how much slower (a backlog takes longer to "
        "prefill there); null: every endpoint counts as equally fast.",
    )
    marginal: bool = Field(
        default=False,
        description="Add the request's own uncached tokens once per request already in the "
        "endpoint's backlog: the delay it adds to their first tokens (they share steps).",
    )
    span_tokens: int | None = Field(
        default=None,
        ge=1,
        description="Score by span / (span + cost - lowest cost), span in tokens (at the "
        "fastest measured drain rate where `drainRate`); null: lowest cost / cost.",
    )
    busy_penalty: bool = Field(
        default=False,
        description="Divide each cost by 1 - the endpoint's utilisation (the share of the "
        "last second it had a backlog, at most 0.9): the queueing marginal cost, so a busy "
        "fast server is not filled until its waits equal a slow one's.",
    )
    mean_span: bool = Field(
        default=False,
        description="Score by span / (span + cost - lowest cost) with span = the lowest cost "
        "plus the candidates' mean backlog: differences count relative to how busy the pool "
        "is (the plain ratio rule is span = the lowest cost).",
    )
    drain_rate: bool = Field(
        default=False,
        description="Divide each cost by the endpoint's measured drain rate (prompt tokens "
        "its first bytes cleared per second while it had a backlog; an endpoint not measured "
        "yet counts as the fastest measured), making it a wait in seconds.",
    )
    fade_from: float | None = Field(
        default=None,
        ge=0,
        le=1,
        description="Pool busy share (the time-averaged share of candidates with a backlog) "
        "from which the scores fade towards 1 (no say), gone at `fadeTo`; null: no fade. The "
        "adapter term (`adapterTokens`) does not fade: the scores fade towards it alone (by the "
        "ratio rule, whatever `spanTokens`).",
    )
    fade_to: float = Field(
        default=1.0,
        gt=0,
        le=1,
        description="Pool busy share at which a fading scorer has no say left (default 1).",
    )
    fade_rise_s: float | None = Field(
        default=None,
        gt=0,
        description="Time constant (s) of the busy share while it rises (null: the same "
        "1 s as while it falls): a short one fades the scorer out at the start of a burst.",
    )


class SendTap(Protocol):
    """What cross-replica sync hears of this EPP's own backlog (`scheduling/replicasync`)."""

    def sent(self, cycle: CycleState, request: LLMRequest, endpoint: str, tokens: int) -> None:
        """`request` went to `endpoint` with `tokens` uncached prompt tokens (PostCycle)."""

    def answered(self, request_id: str) -> None:
        """The first byte of a request came back (told only if its send was)."""

    def ended(self, request_id: str) -> None:
        """A request ended (told only if its send was and no first byte was told)."""
