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

from poolkeeper.datastore.columns import MIN_CACHED
from poolkeeper.datastore.endpoint import EndpointState
from poolkeeper.datastore.inflight_fill import Applied, EndpointLoad, InflightEntry, fill
from poolkeeper.datastore.inflight_kept import KeptAnswer
from poolkeeper.datastore.speed import DEFAULT_SPEED_ALPHA, ObservedSpeed

__all__ = ["InflightEntry", "InflightTracker"]


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
        "_speed",
        "scrape_lag_s",
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
        self._speed = ObservedSpeed(alpha=speed_alpha)
        self._by_request: dict[str, InflightEntry] = {}
        self._by_endpoint: dict[str, EndpointLoad] = {}
        self._changes = 0
        # key -> (metrics, endpoint, version, the state `apply` produced for them): an
        # endpoint whose metrics and in-flight set did not change since the previous decision
        # gets the same object back instead of a new one (1,000 constructions cost ~1 ms).
        self._applied: Applied = {}
        # key -> name of the endpoint `apply` last saw there (IP reuse detection, `fill`)
        self._owners: dict[str, str] = {}
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
            load = self._by_endpoint[endpoint_key] = EndpointLoad()
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
            self._speed.observe(key, now - entry.started_at, output_tokens, version=self._changes)
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
            self._speed.forget(key)

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
        self._speed.forget(endpoint_key)
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
        `scraped_at` (less the scrape lag)."""
        load = self._by_endpoint.get(endpoint_key)
        return (0, 0, 0) if load is None else load.unseen(scraped_at - self.scrape_lag_s)

    def seconds_per_token(self, endpoint_key: str) -> float | None:
        """The observed speed of `endpoint_key` (None until a request there finished)."""
        return self._speed.seconds_per_token(endpoint_key)

    def apply(self, states: Sequence[EndpointState]) -> list[EndpointState]:
        """The snapshots with in-flight and unseen counts and the observed speed filled in
        (others returned as-is, or with their former counts cleared). From `MIN_CACHED`
        states on, the previous answer is kept and patched where it can be (`_patched`);
        below, one plain pass (the kept answer's bookkeeping costs more than it saves)."""
        kept = self._kept
        if len(states) < MIN_CACHED:  # (`fill` called here: a call less for a small pool)
            kept.last = None  # (the writes since are not all in `_dirty` any more)
            out = fill(states, self._by_endpoint, self._speed.estimates, self._owners,
                       self._applied, self.scrape_lag_s, self.forget)  # fmt: skip
        elif (patched := self._patched(states)) is not None:
            out = patched
        else:
            out = self._fill(states)
            kept.remember(states, out, self.scrape_lag_s, self._by_endpoint,
                          self._speed.estimates)  # fmt: skip
        self._dirty.clear()  # (what changed is in `out` now)
        return out

    def _patched(self, states: Sequence[EndpointState]) -> list[EndpointState] | None:
        """The kept answer worked out again where needed (`inflight_kept.py`), or None."""
        return self._kept.patched(
            states, self._dirty, self._by_endpoint, self._speed.estimates, self.scrape_lag_s,
            self._fill,
        )  # fmt: skip

    def _fill(self, states: Sequence[EndpointState]) -> list[EndpointState]:
        """Every state worked out (`inflight_fill.fill`)."""
        return fill(
            states, self._by_endpoint, self._speed.estimates, self._owners, self._applied,
            self.scrape_lag_s, self.forget,
        )  # fmt: skip
