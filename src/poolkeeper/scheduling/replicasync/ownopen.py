"""This replica's published and still open sends: what its open statement lists.

Why not the backlog's own ids: the backlog drops an own entry for reasons of its own (its
size cap, filled by peers' entries too; the scheduler's forgetter) without a first byte or an
end, so nothing is told; a statement built from the backlog would then make every peer drop an
entry whose request is still prefilling there. The statement must say what was published
(`Sent`) and not yet closed (`Answered` or `Ended` published), whatever this replica's backlog
still holds; the fold (`fold.py`) keeps that here, beside what it publishes.

Each id's digest (`openset.digest`) is computed once, at publish, not at every statement.
Bounded like the backlog it mirrors: at most `max_open` ids (the oldest goes first), and an id
older than `max_age_s` is dropped at the next publish or statement (a lost first byte and a
lost end must not be stated forever, nor by a replica that stopped sending: the peers' trackers
would hold the id toward their cap; their backlogs age their entry out at the same age).

Pure: no clock, no I/O. `now` is the scheduler's clock (the `now` its decisions get, which
stamps each id): the fold's caller passes the same clock to the statement (`fold.py`).
"""

from __future__ import annotations

from poolkeeper.scheduling.replicasync.openset import MAX_TRACKED, digest


class OwnOpen:
    """request id -> (published at, digest), oldest first (the module docstring)."""

    __slots__ = ("_open", "max_age_s", "max_open")

    def __init__(self, *, max_open: int = MAX_TRACKED, max_age_s: float = 60.0) -> None:
        if max_open < 1 or not max_age_s > 0.0:
            raise ValueError("max_open and max_age_s must be positive")
        self.max_open = max_open
        self.max_age_s = max_age_s
        self._open: dict[str, tuple[float, int]] = {}

    def __len__(self) -> int:
        return len(self._open)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._open

    def sent(self, request_id: str, now: float) -> None:
        """`request_id`'s `Sent` is published (a reused id: the newest send counts)."""
        opened = self._open
        opened.pop(request_id, None)
        self._age(now)
        while len(opened) >= self.max_open:
            del opened[next(iter(opened))]
        try:
            value = digest(request_id)
        except UnicodeError:  # not encodable: its `Sent` is not sent either (codec.py)
            return
        opened[request_id] = (now, value)

    def closed(self, request_id: str) -> bool:
        """`request_id` had its first byte or end: True if it was open (tell the peers)."""
        return self._open.pop(request_id, None) is not None

    def digests(self, now: float) -> list[int]:
        """The digests of the ids open at `now`, those older than `max_age_s` dropped first
        (the hub's statement source)."""
        self._age(now)
        return [value for _, value in self._open.values()]

    def _age(self, now: float) -> None:
        """Drop the ids published before `now - max_age_s` (oldest first: in publish order)."""
        opened, horizon = self._open, now - self.max_age_s
        while opened and next(iter(opened.values()))[0] < horizon:
            del opened[next(iter(opened))]
