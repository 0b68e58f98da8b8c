"""`PrefixHold`: requests held in front of flow control's queue while they would open a new
long prefill on a pool whose every endpoint is already prefill-backlogged (`holdNewPrefixes`).

Why: below capacity on shared prefixes, the cold start (every system prompt's first prefill)
makes each server's first-come-first-served queue a line of 2,000-token prefills, and a request
whose prefix is already placed (100 uncached tokens) waits behind all of them. Holding the
requests that open a new long prefix while every server has a backlog lets the placed ones go
first (shortest job first over the burst; only the router can do it). Virtual time, 8 servers,
`poolkeeper-fade-early`, three seeds: shared-prefix 0.7x 1.04x -> 0.85x the best baseline's
p90 TTFT, 0.9x 1.05x -> 0.57x, goodput within 0.25 % (docs/notes, seventh round).

The rule (`holds`): the request's prompt tokens no endpoint caches are at least
`minPromptTokens`, and every candidate endpoint's prefill backlog (prompt tokens sent without a
first byte back) is at least `backlogTokens`. A held request is not in the dispatcher's queue,
so it blocks nothing behind it (the dispatcher's head-of-line rule does not apply to it). At
each release (the caller's pump: completions, scrape ticks) held requests are asked again in
arrival order (at most `asks` of them) and go to the queue once the rule no longer holds them,
or unasked after `maxHoldMs` whatever the backlog (never starved). With `placeUnderBacklog`,
a released new long prefix goes to one of the endpoints under the backlog (`room`: one more
question per released request, counted against `asks`). The facts
come from the caller (the scheduler's prefix index and backlog); this module is pure and
synchronous, with time passed in.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

from poolkeeper.flowcontrol.config import HoldNewPrefixes

T = TypeVar("T")


@dataclass(slots=True)
class Held(Generic[T]):
    payload: T
    since: float
    capped: bool = False  # released by `maxHoldMs` while the rule still held it (`release`)


class PrefixHold(Generic[T]):
    """Held requests of one pool, in arrival order (see the module docstring)."""

    __slots__ = ("capped", "config", "held", "total")

    def __init__(self, config: HoldNewPrefixes) -> None:
        self.config = config
        self.held: list[Held[T]] = []
        self.total = 0  # requests held so far (reports)
        self.capped = 0  # of those, released by `maxHoldMs` while the rule still held them

    def holds(self, uncached_tokens: int | Callable[[], int], backlogs: Sequence[int]) -> bool:
        """Whether a request with `uncached_tokens` (its prompt less the longest cached prefix
        any endpoint holds) waits, given each candidate endpoint's prefill backlog. A callable
        is asked only when every backlog is long enough: the prefix match is the question's
        dear part, and with the hold on by default most requests meet an idle pool."""
        c = self.config
        if not backlogs or min(backlogs) < c.backlog_tokens:
            return False
        uncached = uncached_tokens() if callable(uncached_tokens) else uncached_tokens
        return uncached >= c.min_prompt_tokens

    def room(
        self, uncached_tokens: int | Callable[[], int], backlogs: Sequence[int]
    ) -> list[int] | None:
        """With `placeUnderBacklog`, for a request released from the hold (the caller asks
        only for those): the indices of the candidates it may go to, those whose backlog is
        under `backlogTokens`, when it is still a new long prefix (as `holds` reads it) and
        some candidates are under and some are not; None: not narrowed (the option is off, its
        prefix is placed by now, or every candidate is under, or none is: a capped release
        goes where the scheduler puts it). Why: the hold lets a new prefix go because some
        endpoint has room; placed elsewhere, it lands behind a long backlog."""
        c = self.config
        if not c.place_under_backlog or len(backlogs) < 2:
            return None
        under = [i for i, b in enumerate(backlogs) if b < c.backlog_tokens]
        if not under or len(under) == len(backlogs):
            return None
        uncached = uncached_tokens() if callable(uncached_tokens) else uncached_tokens
        return under if uncached >= c.min_prompt_tokens else None

    def hold(self, payload: T, now: float) -> None:
        self.held.append(Held(payload, now))
        self.total += 1

    def release(
        self,
        now: float,
        still: Callable[[T], bool],
        go: Callable[[Held[T]], None],
        asks: int | None = None,
    ) -> int:
        """Send to the queue (`go`), in arrival order, those held `maxHoldMs` or longer (not
        asked again) and the held requests that `still` no longer holds; the number sent. `go`
        runs before the next one is asked, so each answer sees the requests released before it
        (a prefix just placed releases the requests that share it). `asks`: ask at most this
        many (the oldest first); the others stay held until a later release or their cap, so
        one release costs a bounded number of scheduler questions however many are held.
        With `placeUnderBacklog` a released request's dispatch asks once more (its placement,
        `room`); that question counts against `asks` too, so a request is asked only while two
        questions are left, and a capped one's placement uses up one (capped requests go
        whatever is left: never starved)."""
        cap = self.config.max_hold_ms / 1000.0
        placing = 1 if self.config.place_under_backlog else 0
        if asks is not None and asks < 1 + placing:
            need = 1 + placing
            why = " with placeUnderBacklog (each release asks twice)" if placing else ""
            raise ValueError(f"asks={asks}: a release{why} needs at least {need}")
        pending, self.held = self.held, []
        sent = 0
        left = len(pending) * (1 + placing) if asks is None else asks
        for entry in pending:
            if now - entry.since >= cap:
                self.capped += 1
                entry.capped = True
            elif left < 1 + placing:
                self.held.append(entry)
                continue
            else:
                left -= 1
                if still(entry.payload):
                    self.held.append(entry)
                    continue
            left -= placing
            go(entry)
            sent += 1
        return sent

    def remove(self, payload: T) -> Held[T] | None:
        """Drop a held request (client gone): its entry, or None if it is not held."""
        for i, entry in enumerate(self.held):
            if entry.payload is payload:
                del self.held[i]
                return entry
        return None

    def waiting(self) -> int:
        return len(self.held)

    def next_release(self) -> float:
        """When the oldest held request reaches the cap (inf: none held)."""
        if not self.held:
            return float("inf")
        return self.held[0].since + self.config.max_hold_ms / 1000.0
