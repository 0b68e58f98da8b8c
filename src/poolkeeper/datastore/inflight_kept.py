"""`InflightTracker.apply`'s previous answer, kept for the next call (`KeptAnswer`).

Between two requests few endpoints change, so `apply` works out only the positions that did:
those whose ip:port the tracker wrote since (a send, a finish, a first byte, a forget), and
those holding another state; where every state is a new object (a caller that makes them per
call; the datastore reuses one per endpoint and scrape), those holding another endpoint or
scrape, and the bare ones (neither in flight nor a speed: answered by the input state itself).
Any other position keeps its previous answer, which the full pass would give again (the same
endpoint, scrape and versions). Below `MIN_CACHED` states the tracker keeps nothing here (one
plain pass is cheaper).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from itertools import compress
from operator import attrgetter, is_not, or_

from poolkeeper.datastore.endpoint import Endpoint, EndpointMetrics, EndpointState


class KeptAnswer:
    """The previous answer of one tracker's `apply` (not thread-safe, as the tracker)."""

    __slots__ = ("_fulls", "_hopeless", "last")

    def __init__(self) -> None:
        self.last: _Last | None = None
        self._fulls = 0  # full passes at MIN_CACHED or more
        self._hopeless = False  # the kept answer could not help lately

    def remember(
        self,
        states: Sequence[EndpointState],
        answer: list[EndpointState],
        lag: float,
        loads: Mapping[str, object],
        speeds: Mapping[str, object],
    ) -> None:
        """After a full pass at `MIN_CACHED` states or more: keep it for the next call unless
        that cannot help: every state a new object and more bare positions (neither in
        flight nor a speed) than a patch takes (a pool whose endpoints are idle and
        unobserved); then tried again every 64th full pass."""
        n = len(states)
        last, self.last = self.last, None
        self._fulls += 1
        where = {s.endpoint.hostport: i for i, s in enumerate(states)}
        bare = {i for k, i in where.items() if k not in loads and k not in speeds}
        if last is not None:
            self._hopeless = last.new and len(bare) > n // 4
        # (an ip:port twice: positions depend on each other, nothing kept)
        if (not self._hopeless or self._fulls % 64 == 0) and len(where) == n:
            self.last = _Last(
                states, list(map(_METRICS, states)), list(map(_ENDPOINT, states)), answer,
                where, lag, bare,
            )  # fmt: skip

    def patched(
        self,
        states: Sequence[EndpointState],
        dirty: set[str],
        loads: Mapping[str, object],
        speeds: Mapping[str, object],
        lag: float,
        fill: Callable[[list[EndpointState]], list[EndpointState]],
    ) -> list[EndpointState] | None:
        """`apply`'s answer from the previous one, where it can be had so: the same length
        and ip:ports at the same positions, at most a quarter of them to work out again.
        Those are the positions whose ip:port the tracker wrote since (`dirty`: every write
        marks it) and those holding another state; where every state is a new object (the
        caller made them anew), those holding another endpoint or scrape, or a
        bare one (its answer is the state itself). They are worked out by the full pass
        (`fill`, in order); any other position keeps the previous answer, which the full pass
        would give again (the same endpoint, scrape and versions: its `_applied` entry)."""
        last = self.last
        if last is None:
            return None
        n = len(states)
        if len(last.states) != n or last.lag != lag:
            return None
        positions = list(compress(range(n), map(is_not, last.states, states)))
        last.new = len(positions) > n // 4
        if last.new and len(last.bare) > n // 4:
            return None  # (new objects, and too many bare ones to work out again)
        if not last.new:  # mostly the same objects (their scrapes and endpoints)
            metrics, endpoints = last.metrics, last.endpoints
            if positions:
                metrics, endpoints = metrics.copy(), endpoints.copy()
                for i in positions:
                    metrics[i], endpoints[i] = states[i].metrics, states[i].endpoint
        else:  # new objects: compare what the answers are made of
            metrics, endpoints = list(map(_METRICS, states)), list(map(_ENDPOINT, states))
            positions = list(
                compress(
                    range(n),
                    map(
                        or_,
                        map(is_not, last.metrics, metrics),
                        map(is_not, last.endpoints, endpoints),
                    ),
                )
            )
            positions += last.bare
        if len(positions) > n // 4:
            return None
        old = last.endpoints
        for i in positions:
            if endpoints[i].hostport != old[i].hostport:
                return None  # an endpoint joined or left: its ip:port's position moved
        todo = set(positions)
        todo.update(i for i in map(last.where.get, dirty) if i is not None)
        out = last.answer
        if todo:
            out = out.copy()  # (the list handed out before stays as it was)
            bare = set(last.bare)
            order = sorted(todo)  # in order, as the full pass
            for i, new in zip(order, fill([states[i] for i in order]), strict=True):
                out[i] = new
                k = new.endpoint.hostport
                if k not in loads and k not in speeds:
                    bare.add(i)
                else:
                    bare.discard(i)
            self.last = _Last(states, metrics, endpoints, out, last.where, last.lag, bare)
        else:
            self.last = _Last(states, metrics, endpoints, out, last.where, last.lag, last.bare)
        return out


_METRICS = attrgetter("metrics")
_ENDPOINT = attrgetter("endpoint")


class _Last:
    """`apply`'s previous input (the states, their scrapes and endpoints), its answer, each
    ip:port's position, the scrape lag then and the bare positions (`remember`)."""

    __slots__ = ("answer", "bare", "endpoints", "lag", "metrics", "new", "states", "where")

    def __init__(
        self,
        states: Sequence[EndpointState],
        metrics: list[EndpointMetrics],
        endpoints: list[Endpoint],
        answer: list[EndpointState],
        where: dict[str, int],
        lag: float,
        bare: set[int] | list[int],
    ) -> None:
        self.states = list(states)
        self.metrics = metrics
        self.endpoints = endpoints
        self.answer = answer
        self.where = where
        self.lag = lag
        self.bare = sorted(bare)
        self.new = False  # every state a new object at the last comparison
