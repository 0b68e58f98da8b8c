"""What every connection of one lean-transport server shares: its methods, limits and
counters, the open connections (for the drain), and the refused-connection warning's pace."""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field
from typing import Protocol

from poolkeeper.extproc.auth import TOKEN_HEADER
from poolkeeper.extproc.h2.limits import Limits, TransportStats
from poolkeeper.extproc.h2.rpc import Method

log = logging.getLogger("poolkeeper.extproc.h2")

REFUSAL_LOG_EVERY_S = 10.0  # connections closed over the limit: one warning at most this often


class OpenConnection(Protocol):
    """An open connection as the server's drain sees it (`connection.Connection`)."""

    @property
    def active(self) -> int: ...

    def goaway(self) -> None: ...

    def close(self) -> None: ...


@dataclass(slots=True)
class Shared:
    """What every connection of one server shares."""

    methods: dict[bytes, Method]
    limits: Limits
    stats: TransportStats
    token: bytes | None = None  # required in `token_header` on every call but open ones
    token_header: bytes = TOKEN_HEADER.encode()  # the one grpcio's EnvoyOnly checks
    connections: set[OpenConnection] = field(default_factory=set)
    draining: bool = False
    idle: asyncio.Event = field(default_factory=asyncio.Event)  # set when none is open
    refusals_logged: int = 0  # `stats.refused_connections` at the last warning
    refusal_logged_at: float = float("-inf")  # the loop's clock at that warning
    refusal_tail: asyncio.TimerHandle | None = None  # the warning for those since, when due

    def refused_connection(self, loop: asyncio.AbstractEventLoop) -> None:
        """Count a connection closed on accept over `max_connections`, and say so at most
        every REFUSAL_LOG_EVERY_S (a flood of them must not flood the log); those refused
        after a warning are told when the interval is over, not at the next refusal."""
        self.stats.refused_connections += 1
        due = self.refusal_logged_at + REFUSAL_LOG_EVERY_S
        now = loop.time()
        if now >= due:
            self._warn_refusals(now)
        elif self.refusal_tail is None:
            self.refusal_tail = loop.call_at(due, lambda: self._warn_refusals(loop.time()))

    def flush_refusals(self, now: float) -> None:
        """Tell the refusals not yet told now (the server stops)."""
        if self.refusal_tail is not None:
            self._warn_refusals(now)

    def _warn_refusals(self, now: float) -> None:
        if self.refusal_tail is not None:
            self.refusal_tail.cancel()
            self.refusal_tail = None
        log.warning(
            "closed %d ext_proc connection(s) on accept: %d were open (the limit)",
            self.stats.refused_connections - self.refusals_logged,
            self.limits.max_connections,
        )
        self.refusals_logged = self.stats.refused_connections
        self.refusal_logged_at = now
