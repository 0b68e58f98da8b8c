"""The per-client-address connection cap: counts each address's open connections for Envoy.

Envoy 1.40 has no per-source-address connection limit (its connection_limit filter counts one
filter chain, the overload manager the whole process). The managed Envoy asks this service
instead: its network ext_authz filter calls `Check` on a connection's first bytes (a silent
connection is left to the idle timeout), and a listener access log reports every connection's
close (`StreamAccessLogs`, TCP entries), so the count per address is exact while that log
stream runs. A connection over `limit` from one address is refused: Envoy closes it.

Fails open everywhere it cannot be sure: Envoy's filter allows a connection when this service
is unreachable or slow (`failure_mode_allow`); a connection the full table cannot hold is
allowed untracked; and when a log stream ends (Envoy stopped or crashed, its closes lost) the
table is emptied rather than keep addresses locked out by connections that no longer exist.
So that "slow" is rare, `serve` runs the service on a thread and loop of its own
(server/own_loop.py), not behind the EPP's work. A connection Envoy let in anyway (its check
timed out) is counted once found, over the limit too, so such connections do not pile up past
the cap: by its late check if grpc still runs it (`let_in_late`), else from the kernel's list
of open connections (`reconcile`), which also forgets phantoms.

A check and its connection's close come on two gRPC streams, so a check can be handled after
the close (a client that resets right after its first bytes): counted then, the connection
would stay in the table for good, a phantom that, repeated, locks its address out. So a check
past its deadline counts only if the kernel says its connection is open, and the close of
a connection not in the table is remembered a while (`GONE_TTL_S`, at most `max_gone`),
with when it closed: a check for that address and port that *arrived* before that moment is
the closed connection's own and is not counted. A new connection from the same port sends its
first bytes after the close, so its check arrives after it and counts: reusing a port does not
get a client past the cap. When a check arrived is known from its deadline (Envoy sends its
timeout, `check_timeout_s`); without one, every check counts, as before. Envoy's calls
arrive through extproc/conncap_service.py.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

log = logging.getLogger("poolkeeper.extproc")


# How long the close of a connection not in the table is remembered: far beyond the check's
# deadline (`BootstrapParams.conncap_timeout_s`, 1 s), after which a check is not counted.
GONE_TTL_S = 10.0


@dataclass(slots=True)
class ConnectionCounts:
    """Exported figures (poolkeeper_client_connections*)."""

    open: int  # connections counted now
    addresses: int  # distinct client addresses among them
    refused: int  # connections refused at the per-address limit, since start
    untracked: int  # allowed without counting: the table was full, since start
    cleared: int  # times the table was emptied because a log stream ended
    late: int  # checks handled past their deadline, or after their connection's close
    late_counted: int  # of those, connections counted anyway: Envoy had let them in, still open
    reconciled: int  # connections let in uncounted, counted later from the kernel's list
    phantoms: int  # table entries the kernel had no open connection for, forgotten


class ConnectionCounter:
    """Open connections by client address (`ip` -> its connections' source ports).

    Thread-safe: its service runs on a thread of its own (server/own_loop.py), while the main
    thread reads the figures and empties the table when Envoy dies."""

    def __init__(
        self,
        limit: int,
        *,
        max_tracked: int = 65_536,
        max_gone: int = 16_384,  # a check is late by at most its deadline: 16,384 in 1 s
        clock: Callable[[], float] = time.time,  # wall clock: Envoy's timestamps are
    ) -> None:
        self.limit = limit
        self.max_tracked = max_tracked  # connections held in the table, all addresses
        self.max_gone = max_gone
        self._clock = clock
        self._ports: dict[str, set[int]] = {}
        self._open = 0
        # Closes of connections not in the table, oldest first: (ip, port) -> when it closed.
        self._gone: OrderedDict[tuple[str, int], float] = OrderedDict()
        self.refused = 0
        self.untracked = 0
        self.cleared = 0
        self.late = 0
        self.late_counted = 0
        self.reconciled = 0
        self.phantoms = 0
        # From the kernel's previous list (`reconcile`): its connections the table lacked, and
        # the table's connections it lacked.
        self._untabled: set[tuple[str, int]] = set()
        self._unlisted: set[tuple[str, int]] = set()
        self._lock = threading.Lock()

    def opened(
        self,
        ip: str,
        port: int,
        arrived: float | None = None,
        still_open: Callable[[], bool | None] | None = None,
    ) -> bool:
        """A connection sent its first bytes: False if `ip` already holds `limit`.
        `arrived`: when its check arrived (this clock), if known. `still_open`: asks the
        kernel whether this connection is open (None: cannot tell), for a check that came
        after a close from the same address and port: the closed connection's own check,
        delayed on its way, or a new connection's from a reused port."""
        with self._lock:
            closed_at = self._gone.pop((ip, port), None) if self._gone else None
            if closed_at is None:
                return self._admit(ip, port)  # the common case: one pass under the lock
            if arrived is not None and arrived <= closed_at:
                self.late += 1  # the check of a connection already closed: nothing to count
                return True
            cleared = self.cleared
        # A close from this address and port came before the check: ask the kernel outside
        # the lock (a sock_diag query). The check service's own loop waits for it either way;
        # the main thread's readers (`counts`, `exported`, `clear` when Envoy dies) do not.
        gone = still_open is not None and still_open() is False
        with self._lock:
            if gone or self.cleared != cleared:  # closed, or the table was emptied meanwhile
                self.late += 1
                return True
            return self._admit(ip, port)

    def _admit(self, ip: str, port: int) -> bool:
        ports = self._ports.get(ip)
        if ports is not None and len(ports) >= self.limit:
            self.refused += 1
            if self.refused == 1 or self.refused % 1000 == 0:  # never a line per connection
                log.warning(
                    "refused %d connection(s) over %d per client address (latest from %s)",
                    self.refused, self.limit, ip,
                )  # fmt: skip
            return False
        self._count(ip, port)
        return True

    def _count(self, ip: str, port: int) -> bool:
        """Hold a connection in the table (True if it was not), unless the table is full."""
        if self._open >= self.max_tracked:
            self.untracked += 1  # bounded memory first: allowed, not counted
            return False
        ports = self._ports.setdefault(ip, set())
        if port in ports:
            return False
        ports.add(port)
        self._open += 1
        return True

    def closed(self, ip: str, port: int, at: float | None = None) -> None:
        """A connection closed, `at` that moment (this clock; now if not given). One not in
        the table (silent, refused, untracked, or its check not handled yet) is remembered a
        while, in case its check is still to come."""
        with self._lock:
            if not self._forget(ip, port):
                self._remember_gone(ip, port, self._clock() if at is None else at)

    def _forget(self, ip: str, port: int) -> bool:
        """Take a connection out of the table (False if it was not there); under the lock."""
        ports = self._ports.get(ip)
        if ports is None or port not in ports:
            return False
        ports.discard(port)
        self._open -= 1
        if not ports:
            del self._ports[ip]
        return True

    def now(self) -> float:
        return self._clock()

    def closed_unknown(self, ip: str, port: int) -> float | None:
        """When a connection not in the table closed, while that is remembered."""
        with self._lock:
            return self._gone.get((ip, port))

    def let_in_late(
        self, ip: str, port: int, still_open: Callable[[], bool | None] | None = None
    ) -> None:
        """A check handled past its deadline or cancelled: Envoy let the connection in (fails
        open) or closed it. Counted, over the limit too, while the kernel says it is open: its
        close will remove it, and until then its address's next connections are refused, so
        connections let in by late checks do not pile up past the cap. Closed or unknown: not
        counted (counted after its close, it would lock its address out for good)."""
        is_open = still_open is not None and still_open() is True  # the kernel: not locked
        with self._lock:
            self.late += 1
            self._gone.pop((ip, port), None)  # its own close, or a check to come will count
            if is_open and self._count(ip, port):
                self.late_counted += 1

    def _remember_gone(self, ip: str, port: int, at: float) -> None:
        gone = self._gone
        gone[(ip, port)] = at
        gone.move_to_end((ip, port))
        expired = self._clock() - GONE_TTL_S
        while gone and (len(gone) > self.max_gone or next(iter(gone.values())) < expired):
            gone.popitem(last=False)

    def clear(self) -> None:
        """Forget every connection: their closes may never be reported (fail open)."""
        with self._lock:
            if self._open:
                log.warning("connection counts reset: %d connection(s) forgotten", self._open)
            self._ports.clear()
            self._open = 0
            self.cleared += 1
            self._untabled.clear()
            self._unlisted.clear()

    def reconcile(self, sent: set[tuple[str, int]]) -> None:
        """The kernel's list of open connections that have sent bytes (tcpdiag.peers_that_sent),
        taken every `RECONCILE_EXTRA_S` past a check's deadline. Missing from the table in two
        lists in a row, a connection was let in uncounted (its check timed out and grpc dropped
        the call, or it was handled too late to tell): counted now, over the limit too, unless
        its close was already reported. In the table but in neither list (closed, its close
        lost): a phantom, forgotten."""
        with self._lock:
            table = {(ip, port) for ip, ports in self._ports.items() for port in ports}
            untabled, unlisted = sent - table, table - sent
            for ip, port in untabled & self._untabled:
                if (ip, port) not in self._gone and self._open < self.max_tracked:
                    self.reconciled += self._count(ip, port)
            for ip, port in unlisted & self._unlisted:
                self.phantoms += self._forget(ip, port)
            self._untabled, self._unlisted = untabled, unlisted

    def exported(self) -> tuple[int, int, int, int]:
        """(open, addresses, refused, untracked), as telemetry exports them."""
        with self._lock:
            return self._open, len(self._ports), self.refused, self.untracked

    def counts(self) -> ConnectionCounts:
        with self._lock:
            return ConnectionCounts(
                self._open,
                len(self._ports),
                self.refused,
                self.untracked,
                self.cleared,
                self.late,
                self.late_counted,
                self.reconciled,
                self.phantoms,
            )
