"""`ReleaseClaims`: the room a peer's first byte opened on a server, kept from this replica's
`holdNewPrefixes` for a grace (cross-replica sync's `claimGraceMs`).

Why: when a first byte drops a server's prefill backlog, every EPP replica's hold may release
a held new prefix onto that one freed server, each before it has counted the others' sends
(a pump on a loaded box takes milliseconds, longer than the ~0.3 ms a send takes to reach a
peer): two or three new prefixes land together on it, the replicas' uneven cold starts
(docs/notes/2026-12-07-uneven-start.md). The claim settles who goes first without any replica
waiting for another: the room goes to the replica whose request answered there (it saw the
first byte itself and clears it at once); a replica that learns of that first byte through
sync still counts the cleared prompt tokens on that server, in its hold's view only, until
`until`, by when the owner's release (if any) has reached it as a send
(docs/notes/2026-12-07-release-claim.md).

Pure: no clock (the reader passes `now`). Bounded: at most `max_claims` claims (the oldest
dropped first); an expired one is dropped when read.
"""

from __future__ import annotations

from collections import deque


class ReleaseClaims:
    """Claims as (until, endpoint, tokens), in the order they were made (not thread-safe)."""

    __slots__ = ("_claims", "max_claims")

    def __init__(self, max_claims: int = 4096) -> None:
        if max_claims < 1:
            raise ValueError("max_claims must be >= 1")
        self.max_claims = max_claims
        self._claims: deque[tuple[float, str, int]] = deque()

    def __len__(self) -> int:
        return len(self._claims)

    def add(self, endpoint: str, tokens: int, until: float) -> None:
        """A peer's first byte cleared `tokens` on `endpoint`: count them there until `until`."""
        if tokens <= 0:
            return
        self._claims.append((until, endpoint, tokens))
        if len(self._claims) > self.max_claims:
            self._claims.popleft()

    def tokens(self, now: float) -> dict[str, int]:
        """endpoint -> the tokens still claimed at `now` (empty: none)."""
        claims = self._claims
        while claims and claims[0][0] <= now:
            claims.popleft()
        out: dict[str, int] = {}
        for until, endpoint, tokens in claims:
            if until > now:  # (a later claim may expire first only if `until` was not monotonic)
                out[endpoint] = out.get(endpoint, 0) + tokens
        return out
