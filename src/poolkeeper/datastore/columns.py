"""Per-endpoint values kept between decisions, recomputed only where an endpoint changed.

Most of what a built-in plugin reads per endpoint (loads, KV, residency, the scrape time) is a
function of the endpoint's `EndpointState` alone, and those objects are immutable and reused:
`InflightTracker.apply` hands back the same object while an endpoint's scrape and in-flight set
are unchanged, a new one when either changes (a scrape every ~50 ms, a request sent or
finished). Between two decisions at 1,000 endpoints a few dozen change. So a `Column` keeps the
values of the previous candidates list and, for the next one of the same length, recomputes
only the positions that hold another object than before (`is`, not `==`: a new object may be
equal and still be recomputed, which is always right). The changed positions are found once
per decision (`changed`, shared by every column through the cycle state): one C-level pass
(`compress` over `map(is_not)`) instead of one interpreted pass per plugin.

Exactness: a column's value at a position is `of_one(state)` for the state now there, whatever
the path (the equality tests compare each column with its plugin's plain comprehension).
A column holds its previous list (strong references), so an `is` test can never match a
recycled object. Lists handed out are never written afterwards (a patch works on a copy).
Below `MIN_CACHED` candidates the plugins keep their plain comprehensions: the bookkeeping
costs more than it saves there.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from itertools import compress
from operator import is_not
from typing import Final, Generic, Protocol, TypeVar

from poolkeeper.datastore.endpoint import EndpointState


class Scratch(Protocol):
    """One decision's scratch space: the scheduler's `CycleState`, or a `LocalScratch`."""

    @property
    def get(self) -> Callable[[str], object | None]: ...

    @property
    def put(self) -> Callable[[str, object], None]: ...


class LocalScratch:
    """A `Scratch` of one's own (a caller outside a scheduling decision: admission)."""

    __slots__ = ("get", "put")

    def __init__(self) -> None:
        data: dict[str, object] = {}
        self.get: Callable[[str], object | None] = data.get
        self.put: Callable[[str, object], None] = data.__setitem__


# Candidates from which a plugin reads its columns through a `Column` (fewer: a comprehension).
MIN_CACHED: Final = 64

# Past n // _PATCH_SHARE changed positions a column is recomputed whole: a patch costs a call
# or two per position, 5-10 times a comprehension's step (measured: 135 of 1,000 patched per
# decision made the default 1.8x slower than the plain passes).
_PATCH_SHARE: Final = 8

_DIFF: Final = f"{__name__}.changed"
_WHERE: Final = f"{__name__}.where"

_T = TypeVar("_T")


def changed(
    cycle: Scratch, before: list[EndpointState] | None, candidates: Sequence[EndpointState]
) -> tuple[list[EndpointState], list[int] | None]:
    """(the snapshot of `candidates` a column keeps for next time, the positions where
    `candidates` holds another object than `before`, or None when they are not comparable:
    no `before`, another length, too many changes). The snapshot is made once per decision
    and candidates list, the positions once per `before` too: the columns of a decision share
    them, and so share one `before` the next time."""
    n = len(candidates)
    done = cycle.get(_DIFF)
    if isinstance(done, tuple) and done[0] is candidates and len(done[1]) == n:
        snapshot, diffs = done[1], done[2]
    else:
        snapshot, diffs = list(candidates), {}
        cycle.put(_DIFF, (candidates, snapshot, diffs))
    key = id(before)  # (unique: the dict keeps each `before` alive while the decision lasts)
    found = diffs.get(key)
    if found is not None:
        return snapshot, found[1]
    positions: list[int] | None = None
    if before is not None and len(before) == n:
        positions = list(compress(range(n), map(is_not, before, snapshot)))
        if len(positions) > n // _PATCH_SHARE:
            positions = None
    diffs[key] = (before, positions)  # (`before` kept alive: its id stays its own)
    return snapshot, positions


class Column(Generic[_T]):
    """`of_one(state)` for each candidate, kept between decisions (module docstring).
    `of_all(candidates)` must equal `[of_one(s) for s in candidates]` (the plugin's
    comprehension, for a whole recompute). One per plugin instance and argument; not
    thread-safe (the scheduler's loop calls it)."""

    __slots__ = ("_before", "_of_all", "_of_one", "_values")

    def __init__(
        self,
        of_all: Callable[[Sequence[EndpointState]], list[_T]],
        of_one: Callable[[EndpointState], _T],
    ) -> None:
        self._of_all = of_all
        self._of_one = of_one
        self._before: list[EndpointState] | None = None
        self._values: list[_T] = []

    def values(self, cycle: Scratch, candidates: Sequence[EndpointState]) -> list[_T]:
        """The values for `candidates`, in order (a list the caller may keep, not write)."""
        snapshot, positions = changed(cycle, self._before, candidates)
        if positions is None:
            values = self._of_all(snapshot)
        else:
            values = self._values
            if positions:
                values = values.copy()
                of_one = self._of_one
                for i in positions:
                    values[i] = of_one(snapshot[i])
        self._before, self._values = snapshot, values
        return values

    def clear(self) -> None:
        """Forget the kept values (the next call recomputes them all)."""
        self._before, self._values = None, []


class Columns(Generic[_T]):
    """A `Column` per argument (a request's target model): at most `limit` kept, all dropped
    beyond (a pool serving many adapters recomputes more often, never wrongly)."""

    __slots__ = ("_columns", "_limit", "_make")

    def __init__(self, make: Callable[[str], Column[_T]], limit: int = 16) -> None:
        self._make = make
        self._limit = limit
        self._columns: dict[str, Column[_T]] = {}

    def of(self, arg: str) -> Column[_T]:
        """The column for `arg` (made on first use)."""
        column = self._columns.get(arg)
        if column is None:
            if len(self._columns) >= self._limit:
                self._columns.clear()
            column = self._columns[arg] = self._make(arg)
        return column


class Positions:
    """Each candidate's position by ip:port, kept between decisions: made again only where a
    changed position holds another ip:port (an endpoint joined, left or moved). Lets a plugin
    whose values are mostly one default (the prefix scorer's 0.0 where nothing is cached, the
    backlog's base cost where none waits) write only the few others. None where an ip:port
    repeats (a position each would be needed). Not thread-safe."""

    __slots__ = ("_before", "_where")

    def __init__(self) -> None:
        self._before: list[EndpointState] | None = None
        self._where: dict[str, int] | None = None

    def of(self, cycle: Scratch, candidates: Sequence[EndpointState]) -> dict[str, int] | None:
        """ip:port -> position in `candidates` (a dict the caller must not write)."""
        before = self._before
        snapshot, positions = changed(cycle, before, candidates)
        where = self._where
        if (
            positions is None
            or where is None
            or any(snapshot[i].endpoint.hostport != before[i].endpoint.hostport for i in positions)  # type: ignore[index]
        ):
            where = where_of(cycle, snapshot)
        self._before, self._where = snapshot, where
        return where


def where_of(cycle: Scratch, snapshot: list[EndpointState]) -> dict[str, int] | None:
    """ip:port -> position in a decision's `snapshot` (`changed`'s), None where an ip:port
    repeats; made once per decision and snapshot (every `Positions` rebuilt shares it)."""
    done = cycle.get(_WHERE)
    if isinstance(done, tuple) and done[0] is snapshot:
        return done[1]  # type: ignore[no-any-return]
    where: dict[str, int] | None = {s.endpoint.hostport: i for i, s in enumerate(snapshot)}
    if len(where) != len(snapshot):  # type: ignore[arg-type]
        where = None
    cycle.put(_WHERE, (snapshot, where))
    return where
