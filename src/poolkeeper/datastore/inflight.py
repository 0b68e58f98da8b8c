"""Router-side in-flight accounting: requests (and tokens) sent and not yet finished.

Scraped metrics lag the router by up to one scrape interval. Between two scrapes, every
decision would otherwise see the same "idle" endpoint and a burst would herd onto it. The
tracker records each request when it is sent (`start`) until it ends (`finish`, idempotent:
call it on completion, error and client disconnect alike), and `apply` fills the counts into
the endpoint snapshots the scheduler reads:

- `inflight_requests` / `inflight_tokens`: everything this router has outstanding there;
- `unseen_requests` / `unseen_tokens`: the part started after the endpoint's metrics were
  scraped (`metrics.updated_at`), which the scraped queue cannot contain yet;
- `inflight_models`: `inflight_requests` by the target model given to `start` (base model or
  LoRA adapter), so flow control can tell requests a server defers for an adapter slot;
- `unseen_answered`: of those, the ones whose first response byte came back (`first_token`,
  the Director at the first byte): running, not queued, so the queue estimates leave them out;
- `seconds_per_output_token`: the endpoint's observed speed (`speed.ObservedSpeed`), fed by
  `finish(..., now=, output_tokens=)` when a request completed successfully (elapsed time
  since its `start`); plain `finish(request_id)` (errors, disconnects) observes nothing.

Times are the caller's monotonic clock (the same one that stamps `updated_at`). Pure: no I/O,
no clock of its own. `sweep` drops entries older than a bound, a safety net for a lost finish.

Counts belong to the endpoint, not to its `ip:port`: when `apply` sees a different endpoint
(another pod name or namespace) at an `ip:port` it counted for, as after a pod IP is reused,
it forgets that address's in-flight entries and observed speed first (`forget`), so the new
pod starts clean, as its scraped metrics do in the datastore.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from types import MappingProxyType

from poolkeeper.datastore.columns import MIN_CACHED
from poolkeeper.datastore.endpoint import (
    Endpoint,
    EndpointMetrics,
    EndpointState,
    empty_counts,
)
from poolkeeper.datastore.inflight_kept import BARE, KeptAnswer, plain
from poolkeeper.datastore.speed import DEFAULT_SPEED_ALPHA, ObservedSpeed


@dataclass(frozen=True, slots=True)
class InflightEntry:
    request_id: str
    endpoint_key: str
    tokens: int
    started_at: float
    model: str | None = None  # the target model (base or adapter), when the caller says


class _EndpointLoad:
    __slots__ = ("answered", "entries", "models", "tokens", "version")

    def __init__(self) -> None:
        self.version = 0  # the tracker's change counter at this endpoint's last change
        # request_id -> entry, in start order (times are monotonic), so the entries newer than
        # a scrape are a suffix and `apply` only walks that suffix.
        self.entries: dict[str, InflightEntry] = {}
        self.tokens = 0
        self.answered: set[str] = set()  # request ids whose first byte came back
        self.models: dict[str, int] = {}  # target model -> requests in flight (those named)


class InflightTracker:
    """In-flight requests per endpoint (ip:port). One per EPP; not thread-safe."""

    __slots__ = (
        "_applied",
        "_by_endpoint",
        "_by_request",
        "_changes",
        "_dirty",
        "_kept",
        "_owners",
        "scrape_lag_s",
        "speed",
    )

    def __init__(
        self, *, scrape_lag_s: float = 0.0, speed_alpha: float = DEFAULT_SPEED_ALPHA
    ) -> None:
        """`scrape_lag_s`: requests started up to this long *before* a scrape still count as
        unseen (the server may not have queued them yet when it was scraped). Default 0.
        `speed_alpha`: EWMA weight of the newest request in the speed estimate."""
        if scrape_lag_s < 0:
            raise ValueError("scrape_lag_s must be >= 0")
        self.scrape_lag_s = scrape_lag_s
        self.speed = ObservedSpeed(alpha=speed_alpha)
        self._by_request: dict[str, InflightEntry] = {}
        self._by_endpoint: dict[str, _EndpointLoad] = {}
        self._changes = 0
        # key -> (metrics, endpoint, version, the state `apply` produced for them): an
        # endpoint whose metrics and in-flight set did not change since the previous decision
        # gets the same object back instead of a new one (1,000 constructions cost ~1 ms).
        self._applied: dict[str, tuple[EndpointMetrics, Endpoint, int, EndpointState]] = {}
        # key -> (namespace, name) of the endpoint `apply` last saw there (IP reuse detection)
        self._owners: dict[str, tuple[str, str]] = {}
        # The previous `apply` at MIN_CACHED endpoints or more (`_Last`), and the ip:ports
        # whose in-flight set or speed changed since (every write marks them). The next
        # `apply` of a list of the same length works out only the positions that changed
        # (`_patched`).
        self._kept = KeptAnswer()
        self._dirty: set[str] = set()

    def start(
        self,
        request_id: str,
        endpoint_key: str,
        tokens: int,
        now: float,
        model: str | None = None,
    ) -> None:
        """Count `request_id` as sent to `endpoint_key` at `now` (a restart re-routes it);
        `model`: its target model (base or adapter), counted in `inflight_models`."""
        if request_id in self._by_request:
            self.finish(request_id)
        entry = InflightEntry(request_id, endpoint_key, max(0, tokens), now, model)
        self._by_request[request_id] = entry
        load = self._by_endpoint.get(endpoint_key)
        if load is None:
            load = self._by_endpoint[endpoint_key] = _EndpointLoad()
        load.entries[request_id] = entry
        load.tokens += entry.tokens
        if model is not None:
            load.models[model] = load.models.get(model, 0) + 1
        self._changes += 1
        load.version = self._changes
        self._dirty.add(endpoint_key)

    def finish(
        self, request_id: str, *, now: float | None = None, output_tokens: int | None = None
    ) -> bool:
        """Stop counting `request_id`; False if it was not (or no longer) counted.

        With `now` and `output_tokens` (a successful completion), the time since `start` and
        the tokens feed the endpoint's observed speed.
        """
        entry = self._by_request.pop(request_id, None)
        if entry is None:
            return False
        key = entry.endpoint_key
        load = self._by_endpoint[key]
        del load.entries[request_id]
        load.answered.discard(request_id)
        load.tokens -= entry.tokens
        if entry.model is not None:
            if load.models[entry.model] <= 1:
                del load.models[entry.model]
            else:
                load.models[entry.model] -= 1
        self._changes += 1
        load.version = self._changes
        self._dirty.add(key)
        if now is not None and output_tokens is not None:
            self.speed.observe(key, now - entry.started_at, output_tokens, version=self._changes)
        if not load.entries:
            del self._by_endpoint[key]
            self._applied.pop(key, None)
        return True

    def forget_endpoints(self, keep: set[str]) -> None:
        """Drop what is kept for endpoints (ip:port) that left the pool (all but `keep`) and
        carry no request here: the kept answer, the owner and the observed speed. Pod IPs
        churn; without it those grow with every address the pool ever had. An endpoint with
        requests still counted keeps them until they end (then `finish` drops its answer)."""
        load = self._by_endpoint
        for key in [k for k in self._applied if k not in keep and k not in load]:
            del self._applied[key]
        for key in [k for k in self._owners if k not in keep and k not in load]:
            del self._owners[key]
            self.speed.forget(key)

    def first_token(self, request_id: str) -> bool:
        """The first response byte of `request_id` came back: it runs, it no longer waits in
        its endpoint's queue. False if it is not counted (any more)."""
        entry = self._by_request.get(request_id)
        if entry is None:
            return False
        load = self._by_endpoint[entry.endpoint_key]
        if request_id not in load.answered:
            load.answered.add(request_id)
            self._changes += 1
            load.version = self._changes
            self._dirty.add(entry.endpoint_key)
        return True

    def sweep(self, now: float, max_age_s: float) -> list[str]:
        """Forget requests started more than `max_age_s` ago; returns their ids."""
        cutoff = now - max_age_s
        old = [rid for rid, e in self._by_request.items() if e.started_at < cutoff]
        for rid in old:
            self.finish(rid)
        return old

    def forget(self, endpoint_key: str) -> list[str]:
        """Drop every in-flight entry and the observed speed of `endpoint_key` (the endpoint
        there was replaced); returns the dropped request ids (their `finish` is then a no-op)."""
        load = self._by_endpoint.pop(endpoint_key, None)
        dropped = list(load.entries) if load is not None else []
        for request_id in dropped:
            del self._by_request[request_id]
        self._applied.pop(endpoint_key, None)
        self._owners.pop(endpoint_key, None)
        self.speed.forget(endpoint_key)
        self._changes += 1
        self._dirty.add(endpoint_key)
        return dropped

    def __len__(self) -> int:
        return len(self._by_request)

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._by_request

    def counts(self, endpoint_key: str) -> tuple[int, int]:
        """(requests, tokens) in flight to `endpoint_key`."""
        load = self._by_endpoint.get(endpoint_key)
        return (0, 0) if load is None else (len(load.entries), load.tokens)

    def models(self, endpoint_key: str) -> dict[str, int]:
        """Requests in flight to `endpoint_key` by the target model `start` was given."""
        load = self._by_endpoint.get(endpoint_key)
        return {} if load is None else dict(load.models)

    def unseen(self, endpoint_key: str, scraped_at: float) -> tuple[int, int, int]:
        """(requests, tokens, requests answered) in flight to `endpoint_key` started after
        `scraped_at`."""
        load = self._by_endpoint.get(endpoint_key)
        if load is None:
            return (0, 0, 0)
        since = scraped_at - self.scrape_lag_s
        answered = load.answered
        n = tokens = done = 0
        for entry in reversed(load.entries.values()):
            if entry.started_at <= since:
                break
            n += 1
            tokens += entry.tokens
            if answered and entry.request_id in answered:
                done += 1
        return n, tokens, done

    def apply(self, states: Sequence[EndpointState]) -> list[EndpointState]:
        """The snapshots with in-flight and unseen counts and the observed speed filled in
        (others returned as-is, or with their former counts cleared)."""
        n = len(states)
        out = self._patched(states) if n >= MIN_CACHED else None
        if out is None:
            out, bare = self._apply_all(states)
            self._kept.remember(
                states, out, bare, self.scrape_lag_s, self._by_endpoint, self.speed.estimates
            )
        self._dirty.clear()  # (what changed is in `out` now)
        return out

    def _patched(self, states: Sequence[EndpointState]) -> list[EndpointState] | None:
        """The kept answer worked out again where needed (`inflight_kept.py`), or None."""
        return self._kept.patched(
            states, self._dirty, self._by_endpoint, self.speed.estimates, self.scrape_lag_s,
            self._apply_one,
        )  # fmt: skip

    def _apply_all(self, states: Sequence[EndpointState]) -> tuple[list[EndpointState], int]:
        """Every state worked out, and how many were bare (neither in flight nor a speed)."""
        by_endpoint = self._by_endpoint
        speeds = self.speed.estimates
        owners = self._owners
        if not by_endpoint and not speeds:  # nothing to carry over: just note who is where
            for s in states:
                owners[s.endpoint.hostport] = (s.endpoint.namespace, s.endpoint.name)
            return [s if not (s.inflight_requests or s.unseen_requests) else _cleared(s)
                    for s in states], len(states)  # fmt: skip
        # A bare endpoint still at its owner with the same scrape as last time (the most of
        # an idle pool) inline: the object `_apply_one` kept for its endpoint and scrape, where
        # that is its answer (the datastore's new plain states: the same object each time).
        load, speed, one, kept = by_endpoint.get, speeds.get, self._apply_one, self._applied.get
        out: list[EndpointState] = []
        append = out.append
        bare = 0
        for s in states:
            ep = s.endpoint
            key = ep.hostport
            owner = owners.get(key)
            if (
                owner is not None and owner[1] == ep.name and owner[0] == ep.namespace
                and load(key) is None and speed(key) is None
            ):  # fmt: skip
                bare += 1
                c = kept(key)
                if (
                    c is not None and c[2] < 0 and c[0] is s.metrics and c[1] is ep
                    and (s.inflight_requests or s.unseen_requests or plain(s))
                ):  # fmt: skip
                    append(c[3])
                    continue
            append(one(s))
        return out, bare

    def _apply_one(self, s: EndpointState) -> EndpointState:
        """One state with its counts and speed filled in (made anew only where they or the
        state changed since the last time: `_applied`)."""
        ep = s.endpoint
        key = ep.hostport
        owners = self._owners
        owner = owners.get(key)
        if owner is None or owner[1] != ep.name or owner[0] != ep.namespace:
            if owner is not None:  # another endpoint took this ip:port (pod IP reuse)
                self.forget(key)
            owners[key] = (ep.namespace, ep.name)
        load = self._by_endpoint.get(key)
        speed = self.speed.estimates.get(key)
        if load is None and speed is None:
            if not (s.inflight_requests or s.unseen_requests or plain(s)):
                return s  # (a caller's own figures, no count of ours to clear)
            # Answered by `EndpointState(ep, m)` (`s` is one, or it cleared): the same object
            # for the same endpoint and scrape, so the datastore's new objects per snapshot
            # look unchanged to the values kept downstream (`columns.py`).
            cached = self._applied.get(key)
            if cached is not None and cached[0] is s.metrics and cached[1] is ep and cached[2] < 0:
                return cached[3]
            new = _cleared(s) if s.inflight_requests or s.unseen_requests else s
            self._applied[key] = (s.metrics, ep, BARE, new)
            return new
        # Every change takes a fresh number from one counter, so the larger of the two
        # versions changes whenever either does (and `finish` drops the cache entry of an
        # endpoint whose in-flight set empties).
        if speed is None:
            assert load is not None  # not both None (above)
            version = load.version
        elif load is None or speed.version > load.version:
            version = speed.version
        else:
            version = load.version
        m = s.metrics
        cached = self._applied.get(key)
        if cached is not None and cached[0] is m and cached[1] is ep and cached[2] == version:
            return cached[3]
        spt = None if speed is None else speed.seconds_per_token
        if load is None:
            new = EndpointState(ep, m, seconds_per_output_token=spt)
        else:
            n_unseen, t_unseen, n_answered = self.unseen(key, m.updated_at)
            models = MappingProxyType(dict(load.models)) if load.models else empty_counts()
            new = EndpointState(
                ep, m, len(load.entries), load.tokens, n_unseen, t_unseen, spt, n_answered,
                models,
            )  # fmt: skip
        self._applied[key] = (m, ep, version, new)
        return new


def _cleared(state: EndpointState) -> EndpointState:
    return EndpointState(state.endpoint, state.metrics)
