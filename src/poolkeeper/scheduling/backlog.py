"""Prefill backlog: the prompt tokens this router sent that have not had their first token yet.

A continuous-batching engine gives a new request its first token at the end of the step that
finishes its prefill, and every prefill already queued or running there is ahead of it (or in
the same step). The scraped queue says how many requests wait, not how long their prompts are,
and it lags the router by a scrape; the router itself knows both: what it sent where, and (from
the first response byte) when each prefill was over. `PrefillBacklog` keeps, per endpoint, the
uncached prompt tokens of the requests sent there whose first byte has not come back:

    backlog.sent(request_id, endpoint, tokens, now)   # at the decision (PostCycle)
    backlog.first_token(request_id, now)              # the first response byte arrived
    backlog.ended(request_id)                         # the request ended (any outcome)
    backlog.tokens(endpoint)                          # what a new request there waits behind
    backlog.seen_snapshot()                           # ... counting only first bytes it will see
    backlog.claims.tokens(now)                        # peers' first bytes' room, claimed a while
    backlog.rates()                                   # endpoint -> measured drain, tokens/s
    backlog.utilisation(endpoint, now)                # share of the last ~1 s with a backlog

The drain rate is what makes token counts comparable across a fleet of unequal servers: while
an endpoint's backlog is not empty, each first byte clears its entry's tokens (plus
`work_tokens`, the fixed part of the step it waited for) in the time since the previous first
byte there (or since the backlog became non-empty). Their ratio, decayed per first byte by
`rate_decay`, is that server's prefill throughput as this router sees it, under whatever
decode load it carries: 2,000 tokens ahead on a server that drains 40,000 tokens/s is a shorter
wait than 1,000 on one that drains 10,000.

Other EPP replicas' sends (cross-replica sync, `scheduling/replicasync/`) are kept under the key
`(origin, request_id)`, a tuple, so they never meet this EPP's own string ids; they count in
every sum, and `drop_origin` removes a replica that went quiet.

A peer's first byte cleared with `claim_until` leaves its tokens claimed on that endpoint until
then (`claims`, `scheduling/releaseclaims.py`), which only flow control's hold reads.

Pure: no clock, no I/O. Bounded: at most `max_entries` requests are held (the oldest is dropped
first), and `sent` forgets entries older than `max_age_s` (a lost first byte and a lost end must
not count forever), so nothing a client does can grow it without bound.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

from poolkeeper.scheduling.releaseclaims import ReleaseClaims

BUSY_WINDOW_S = 1.0  # time constant of the utilisation estimate

# A request's key: this EPP's own request id, or (origin replica, its request id) for a peer's.
RequestKey = str | tuple[str, str]


@dataclass(slots=True)
class _Entry:
    endpoint: str
    tokens: int
    sent_at: float
    seen: bool  # its first byte will be seen (streamed): not only its end


@dataclass(slots=True)
class _Drain:
    """Decayed sums of cleared work (tokens) and busy time (s) of one endpoint."""

    work: float = 0.0
    seconds: float = 0.0
    samples: int = 0
    mark: float | None = None  # last first byte (or start of the busy period), while busy
    busy: float = 0.0  # time-decayed share of time with a backlog (utilisation)
    at: float | None = None  # when `busy` was last brought up to date


class PrefillBacklog:
    """Per-endpoint sums of not-yet-answered prompt tokens (not thread-safe)."""

    __slots__ = (
        "_by_endpoint", "_counts", "_drain", "_entries", "_seen_by_endpoint", "claims",
        "max_age_s", "max_entries", "min_samples", "rate_decay", "work_tokens",
    )  # fmt: skip

    def __init__(
        self,
        *,
        max_entries: int = 65_536,
        max_age_s: float = 60.0,
        work_tokens: int = 128,
        rate_decay: float = 0.98,
        min_samples: int = 8,
    ) -> None:
        if max_entries < 1 or not max_age_s > 0.0:
            raise ValueError("max_entries and max_age_s must be positive")
        if not 0.0 < rate_decay < 1.0 or work_tokens < 0 or min_samples < 1:
            raise ValueError("rate_decay must be in (0, 1), work_tokens >= 0, min_samples >= 1")
        self.max_entries = max_entries
        self.max_age_s = max_age_s
        self.work_tokens = work_tokens
        self.rate_decay = rate_decay
        self.min_samples = min_samples
        self._drain: dict[str, _Drain] = {}  # endpoint -> drain-rate sums
        # request id -> entry, in send order (the clock is monotonic), so the oldest come first
        self._entries: dict[RequestKey, _Entry] = {}
        self._by_endpoint: dict[str, int] = {}  # endpoint -> backlog tokens
        self._counts: dict[str, int] = {}  # endpoint -> entries (tokens may sum to 0)
        # endpoint -> backlog tokens of the entries whose first byte will be seen (non-zero
        # sums only): a non-streamed request's entry lasts its whole answer, decode included.
        self._seen_by_endpoint: dict[str, int] = {}
        self.claims = ReleaseClaims()  # peers' first bytes' room (`first_token`'s `claim_until`)

    def __len__(self) -> int:
        return len(self._entries)

    def sent(
        self, request_id: RequestKey, endpoint: str, tokens: int, now: float, seen: bool = True
    ) -> None:
        """`request_id` went to `endpoint` with `tokens` prompt tokens to prefill there;
        `seen`: its first byte will come back (a streamed answer), not only its end."""
        self._remove(request_id)  # a reused id (a retry re-routed): the newest decision counts
        entries = self._entries
        while entries:
            oldest_id, oldest = next(iter(entries.items()))
            if len(entries) < self.max_entries and oldest.sent_at >= now - self.max_age_s:
                break
            self._remove(oldest_id)
        tokens = max(0, tokens)
        drain = self._drain_of(endpoint)
        self._age(drain, now, endpoint in self._counts)
        if endpoint not in self._counts:  # a busy period starts: the drain clock with it
            drain.mark = now
        entries[request_id] = _Entry(endpoint, tokens, now, seen)
        self._by_endpoint[endpoint] = self._by_endpoint.get(endpoint, 0) + tokens
        if seen and tokens:
            self._seen_by_endpoint[endpoint] = self._seen_by_endpoint.get(endpoint, 0) + tokens
        self._counts[endpoint] = self._counts.get(endpoint, 0) + 1

    def first_token(
        self, request_id: RequestKey, now: float | None = None, claim_until: float | None = None
    ) -> bool:
        """The prefill of `request_id` is over; False if it was not counted. (From whichever
        endpoint: if a fallback served it, the decided one never got that prefill either.)
        With `now`, the cleared tokens and the time since the previous first byte there are a
        drain-rate sample of that endpoint. With `claim_until` (a peer's first byte), the
        cleared tokens of a streamed entry stay claimed there until then (`claims`)."""
        entry = self._entries.get(request_id)
        if entry is not None and claim_until is not None and entry.seen:
            self.claims.add(entry.endpoint, entry.tokens, claim_until)
        if entry is not None and now is not None:
            drain = self._drain_of(entry.endpoint)
            self._age(drain, now, True)
            if drain.mark is not None and now >= drain.mark:
                decay = self.rate_decay
                drain.work = drain.work * decay + entry.tokens + self.work_tokens
                drain.seconds = drain.seconds * decay + (now - drain.mark)
                drain.samples += 1
            drain.mark = now
        return self._remove(request_id)

    def rates(self) -> dict[str, float]:
        """endpoint -> measured drain rate (tokens/s) of every endpoint with `min_samples`
        first bytes measured (see the module docstring)."""
        need = self.min_samples
        return {
            k: d.work / d.seconds
            for k, d in self._drain.items()
            if d.samples >= need and d.seconds > 0.0
        }

    def utilisation(self, endpoint: str, now: float) -> float:
        """Share of the last ~`BUSY_WINDOW_S` seconds `endpoint` had a backlog (0 if unknown)."""
        drain = self._drain.get(endpoint)
        if drain is None:
            return 0.0
        self._age(drain, now, endpoint in self._counts)
        return drain.busy

    @staticmethod
    def _age(drain: _Drain, now: float, busy: bool) -> None:
        """Bring `drain.busy` up to `now`, the endpoint busy (or not) since the last update."""
        if drain.at is not None and now > drain.at:
            keep = math.exp(-(now - drain.at) / BUSY_WINDOW_S)
            drain.busy = drain.busy * keep + (1.0 - keep if busy else 0.0)
        if drain.at is None or now > drain.at:
            drain.at = now

    def _drain_of(self, endpoint: str) -> _Drain:
        drain = self._drain.get(endpoint)
        if drain is None:
            drain = self._drain[endpoint] = _Drain()
        return drain

    def ended(self, request_id: RequestKey) -> bool:
        """The request ended (completed, failed, cancelled) before or after its first byte."""
        return self._remove(request_id)

    def endpoint_of(self, request_id: RequestKey) -> str | None:
        """Where `request_id` was sent, if it is counted."""
        entry = self._entries.get(request_id)
        return None if entry is None else entry.endpoint

    def tokens(self, endpoint: str) -> int:
        """Prompt tokens sent to `endpoint` whose first byte has not come back."""
        return self._by_endpoint.get(endpoint, 0)

    def snapshot(self) -> Mapping[str, int]:
        """endpoint -> backlog tokens of every endpoint with an entry: the live map, read-only
        by type (a mappingproxy's `get` cost a third of a 1,000-endpoint decision)."""
        return self._by_endpoint

    def seen_snapshot(self) -> Mapping[str, int]:
        """As `snapshot`, counting only the entries whose first byte will be seen: what an
        absolute threshold may read (`holdNewPrefixes`), since a non-streamed request's entry
        stays until its end, long after its prefill."""
        return self._seen_by_endpoint

    def counts(self) -> Mapping[str, int]:
        """endpoint -> requests in its backlog (the live map, as `snapshot`)."""
        return self._counts

    def forget_endpoints(self, keep: set[str]) -> None:
        """Drop the entries of endpoints that left the pool."""
        for rid in [r for r, e in self._entries.items() if e.endpoint not in keep]:
            self._remove(rid)
        for gone in [k for k in self._drain if k not in keep]:
            del self._drain[gone]

    def forget_peer_endpoints(self, keep: set[str]) -> int:
        """Drop other replicas' entries for endpoints not in `keep` (cross-replica sync: the
        pool shrank); this EPP's own entries and the drain rates stay (`forget_endpoints`,
        the scheduler's forgetter, decides about those). How many went."""
        gone = [
            k for k, e in self._entries.items() if isinstance(k, tuple) and e.endpoint not in keep
        ]
        for key in gone:
            self._remove(key)
        return len(gone)

    def own_ids(self) -> list[str]:
        """This EPP's own request ids it counts (not peers')."""
        return [k for k in self._entries if isinstance(k, str)]

    def drop_origin(self, origin: str) -> int:
        """Drop every entry another replica `origin` sent (it went quiet); how many."""
        gone = [k for k in self._entries if isinstance(k, tuple) and k[0] == origin]
        for key in gone:
            self._remove(key)
        return len(gone)

    def _remove(self, request_id: RequestKey) -> bool:
        entry = self._entries.pop(request_id, None)
        if entry is None:
            return False
        key = entry.endpoint
        if entry.seen and entry.tokens:
            left = self._seen_by_endpoint[key] - entry.tokens
            if left:
                self._seen_by_endpoint[key] = left
            else:
                del self._seen_by_endpoint[key]
        count = self._counts[key] - 1
        if count:
            self._counts[key] = count
            self._by_endpoint[key] -= entry.tokens
        else:  # the endpoint's last entry: drop its key, so the map holds only backlogs
            del self._counts[key]
            del self._by_endpoint[key]
            drain = self._drain.get(key)
            if drain is not None:  # idle: the time until the next send is not drain time
                drain.mark = None
        return True
