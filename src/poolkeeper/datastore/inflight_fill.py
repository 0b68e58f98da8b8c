"""`InflightTracker.apply`'s pass over states: what the tracker counts per endpoint
(`InflightEntry`, `EndpointLoad`) and how it fills them into `EndpointState`s (`fill`).

One loop over the states, each endpoint inline (no call per endpoint: at a few endpoints the
calls cost more than the work, ~2 µs a decision). An endpoint with neither requests in
flight nor an observed speed ("bare") is answered by its input state itself (its former
counts cleared where it carried any); any other by a state made anew only where its scrape,
endpoint or in-flight set and speed changed since the last time (`applied`), else the same
object as then. So a caller that hands the same state objects while nothing changed (the
datastore makes one per endpoint and scrape, `snapshot.py`) gets the same objects back, and
the values kept downstream (`columns.py`) see them unchanged.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType

from poolkeeper.datastore.endpoint import (
    Endpoint,
    EndpointMetrics,
    EndpointState,
    empty_counts,
)
from poolkeeper.datastore.speed import EndpointSpeed


@dataclass(frozen=True, slots=True)
class InflightEntry:
    request_id: str
    endpoint_key: str
    tokens: int
    started_at: float
    model: str | None = None  # the target model (base or adapter), when the caller says


class EndpointLoad:
    """One endpoint's requests in flight (the tracker's, written by it alone)."""

    __slots__ = ("answered", "entries", "models", "tokens", "version")

    def __init__(self) -> None:
        self.version = 0  # the tracker's change counter at this endpoint's last change
        # request_id -> entry, in start order (times are monotonic), so the entries newer than
        # a scrape are a suffix and `unseen` only walks that suffix.
        self.entries: dict[str, InflightEntry] = {}
        self.tokens = 0
        self.answered: set[str] = set()  # request ids whose first byte came back
        self.models: dict[str, int] = {}  # target model -> requests in flight (those named)

    def unseen(self, since: float) -> tuple[int, int, int]:
        """(requests, tokens, requests answered) started after `since`."""
        answered = self.answered
        n = tokens = done = 0
        for entry in reversed(self.entries.values()):
            if entry.started_at <= since:
                break
            n += 1
            tokens += entry.tokens
            if answered and entry.request_id in answered:
                done += 1
        return n, tokens, done


# key -> (metrics, endpoint, version, the state `fill` made of them)
Applied = dict[str, tuple[EndpointMetrics, Endpoint, int, EndpointState]]


def fill(
    states: Sequence[EndpointState],
    loads: Mapping[str, EndpointLoad],
    speeds: Mapping[str, EndpointSpeed],
    owners: dict[str, str],
    applied: Applied,
    lag: float,
    forget: Callable[[str], object],
) -> list[EndpointState]:
    """The states with their counts and speed filled in. `owners`:
    key -> name of the endpoint last seen there; another one there (pod IP reuse) is
    `forget`-ed first (which drops its load, speed and `applied` entry). The name alone: a
    standalone server without a namespace takes each pool's namespace, so the one server read
    through pools of two namespaces must not look like two pods taking turns at its ip:port."""
    if not loads and not speeds:  # nothing to carry over: just note who is where
        for s in states:
            owners[s.endpoint.hostport] = s.endpoint.name
        return [s if not (s.inflight_requests or s.unseen_requests) else cleared(s)
                for s in states]  # fmt: skip
    # (no `.get`s bound ahead: each is an object made per call, which costs a small pool more
    # than it saves, and every allocation brings the next garbage collection nearer)
    out: list[EndpointState] = []
    for s in states:
        ep = s.endpoint
        key = ep.hostport
        owner = owners.get(key)
        if owner != ep.name:
            if owner is not None:  # another endpoint took this ip:port (pod IP reuse)
                forget(key)
            owners[key] = ep.name
        load = loads.get(key)
        speed = speeds.get(key)
        if load is None and speed is None:
            out.append(s if not (s.inflight_requests or s.unseen_requests) else cleared(s))
            continue
        # Every change takes a fresh number from one counter, so the larger of the two
        # versions changes whenever either does (and the tracker drops the `applied` entry
        # of an endpoint whose in-flight set empties).
        if speed is None:
            assert load is not None  # not both None (above)
            version = load.version
        elif load is None or speed.version > load.version:
            version = speed.version
        else:
            version = load.version
        m = s.metrics
        c = applied.get(key)
        if c is not None and c[0] is m and c[1] is ep and c[2] == version:
            out.append(c[3])
            continue
        spt = None if speed is None else speed.seconds_per_token
        if load is None:
            new = EndpointState(ep, m, seconds_per_output_token=spt)
        else:
            n_unseen, t_unseen, n_answered = load.unseen(m.updated_at - lag)
            models = MappingProxyType(dict(load.models)) if load.models else empty_counts()
            new = EndpointState(
                ep, m, len(load.entries), load.tokens, n_unseen, t_unseen, spt, n_answered,
                models,
            )  # fmt: skip
        applied[key] = (m, ep, version, new)
        out.append(new)
    return out


def cleared(state: EndpointState) -> EndpointState:
    """The state without the router's figures (the endpoint and its scrape alone)."""
    return EndpointState(state.endpoint, state.metrics)
