"""Router-side speed observations: how long each endpoint takes per output token.

A fleet may mix GPU generations; the scraped metrics (queue, running, KV) say how busy a server
is, not how fast it drains. The router can measure that itself: every finished request took
`elapsed` seconds (sent to finished, on the router's clock) for `output_tokens` tokens.
`ObservedSpeed` keeps, per endpoint (ip:port), exponentially weighted sums of both and reports
their ratio, the observed seconds per output token. Token-weighted on purpose: a short request
(mostly prefill and queueing) moves the estimate less than a long one. The number includes the
endpoint's queueing, so it rises with load too; a scorer built on it balances latency, which is
what a client sees. Only requests that finished successfully and reported tokens count.

Pure: no I/O, no clock of its own; `observe` returns whether the sample counted, and every
counted sample gives the endpoint a new `version` from the caller's change counter, so callers
can cache states built from an unchanged estimate.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from poolkeeper.datastore.endpoint import EndpointState

DEFAULT_SPEED_ALPHA = 0.1


class EndpointSpeed:
    """The decayed sums of one endpoint; `seconds_per_token` is their ratio."""

    __slots__ = ("elapsed", "samples", "seconds_per_token", "tokens", "version")

    def __init__(self) -> None:
        self.elapsed = 0.0
        self.tokens = 0.0
        self.samples = 0
        self.seconds_per_token = 0.0
        self.version = 0


class ObservedSpeed:
    """Per-endpoint EWMA of seconds per output token (start to finish). Not thread-safe."""

    __slots__ = ("_applied", "_by_endpoint", "_changes", "alpha")

    def __init__(self, *, alpha: float = DEFAULT_SPEED_ALPHA) -> None:
        """`alpha`: weight of the newest request in (0, 1]; 1 keeps only the last one."""
        if not 0.0 < alpha <= 1.0:
            raise ValueError("alpha must be in (0, 1]")
        self.alpha = alpha
        self._by_endpoint: dict[str, EndpointSpeed] = {}
        self._changes = 0
        # key -> (input state, estimate version, output state) of the last `apply`
        self._applied: dict[str, tuple[EndpointState, int, EndpointState]] = {}

    def observe(
        self, endpoint_key: str, elapsed_s: float, output_tokens: int, *, version: int = 0
    ) -> bool:
        """Count one finished request; False (ignored) unless elapsed >= 0 and tokens >= 1.

        `version`: the caller's change counter for this update (default: an own counter).
        """
        if output_tokens < 1 or not elapsed_s >= 0.0:  # also rejects NaN
            return False
        speed = self._by_endpoint.get(endpoint_key)
        if speed is None:
            speed = self._by_endpoint[endpoint_key] = EndpointSpeed()
            # The first sample is the whole estimate (no decay towards an invented prior).
            speed.elapsed, speed.tokens = elapsed_s, float(output_tokens)
        else:
            keep = 1.0 - self.alpha
            speed.elapsed = keep * speed.elapsed + self.alpha * elapsed_s
            speed.tokens = keep * speed.tokens + self.alpha * output_tokens
        speed.samples += 1
        speed.seconds_per_token = speed.elapsed / speed.tokens
        self._changes += 1
        speed.version = version or self._changes
        return True

    @property
    def estimates(self) -> Mapping[str, EndpointSpeed]:
        """ip:port -> estimate (a live, read-only view; for per-candidate loops)."""
        return self._by_endpoint

    def get(self, endpoint_key: str) -> EndpointSpeed | None:
        return self._by_endpoint.get(endpoint_key)

    def seconds_per_token(self, endpoint_key: str) -> float | None:
        speed = self._by_endpoint.get(endpoint_key)
        return None if speed is None else speed.seconds_per_token

    def forget(self, endpoint_key: str) -> None:
        """Drop an endpoint's estimate (it left the pool)."""
        self._by_endpoint.pop(endpoint_key, None)
        self._applied.pop(endpoint_key, None)

    def __len__(self) -> int:
        return len(self._by_endpoint)

    def apply(self, states: Sequence[EndpointState]) -> list[EndpointState]:
        """The snapshots with `seconds_per_output_token` filled in where observed, for callers
        without an `InflightTracker` (the virtual-time benchmarks). An input state seen before
        with an unchanged estimate gets the same output object back."""
        by_endpoint = self._by_endpoint
        if not by_endpoint:
            return list(states)
        applied = self._applied
        out: list[EndpointState] = []
        append = out.append
        for s in states:
            key = s.endpoint.hostport
            speed = by_endpoint.get(key)
            if speed is None:
                append(s)
                continue
            cached = applied.get(key)
            if cached is not None and cached[0] is s and cached[1] == speed.version:
                append(cached[2])
                continue
            new = EndpointState(
                s.endpoint, s.metrics, s.inflight_requests, s.inflight_tokens,
                s.unseen_requests, s.unseen_tokens, speed.seconds_per_token, s.unseen_answered,
            )  # fmt: skip
            applied[key] = (s, speed.version, new)
            append(new)
        return out
