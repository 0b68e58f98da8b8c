"""The EPP's end of the response observer: detached exchanges and Envoy's access-log entries.

Once a routed request's response needs no rewrite, its Exchange ends the ext_proc stream and
waits here, under the key the EPP put in the stream's `poolkeeper.exchange` metadata, until
Envoy's gRPC access log (envoy/observer.py) reports how the response ended. `outcome_of`
(extproc/outcome.py) turns one access-log entry into an `Outcome` (a pure function of the
entry); `DetachedExchanges` settles the waiting exchange with it. Bounded: at most `limit`
exchanges wait, the oldest is settled as unknown (status 0) when a new one would pass the
limit, and any left waiting longer than `ttl_s` (an entry lost with a broken access-log
stream) is settled the same way, by the runtime's timer calling `expire()` (off the request
path).
"""

from __future__ import annotations

import binascii
import logging
import os
import time
from collections.abc import AsyncIterator, Callable
from typing import Protocol

import grpc
from envoy.service.accesslog.v3 import als_pb2, als_pb2_grpc
from google.protobuf import empty_pb2, wrappers_pb2

from poolkeeper import observation as wire
from poolkeeper.extproc.outcome import UNKNOWN_STATUS, Outcome, outcome_of
from poolkeeper.extproc.signal_tap import SignalTap

log = logging.getLogger("poolkeeper.extproc")

_KEY_BYTES = 12  # an exchange key's random bytes (96 bits: 16 base64 characters, no padding)
_URLSAFE = bytes.maketrans(b"+/", b"-_")  # base64's alphabet to the URL-safe one


class Detached(Protocol):
    """What waits here: an Exchange whose ext_proc stream has ended."""

    def observed(self, outcome: Outcome) -> None: ...

    def first_byte_passed(self) -> None:
        """Envoy reports the response's first byte as it passes (before `observed`)."""
        ...


class DetachedExchanges:
    """Exchanges waiting for their access-log entry, oldest first."""

    def __init__(
        self,
        *,
        limit: int = 65_536,
        ttl_s: float = 3600.0,
        clock: Callable[[], float] = time.monotonic,
        tap: SignalTap | None = None,
    ) -> None:
        self.limit = limit
        self.ttl_s = ttl_s
        self.clock = clock
        self._waiting: dict[str, tuple[float, Detached]] = {}
        self._entropy = b""  # random bytes of the next keys (`_random_key`)
        self._entropy_at = 0
        self.settled = 0
        self.expired = 0  # settled as unknown: over the limit or the TTL
        # Bench only (scripts/step_signal.py): the composition root passes one when
        # $POOLKEEPER_BENCH_SIGNAL_LOG is set (`SignalTap.from_env`), else None.
        self.tap = tap

    def __len__(self) -> int:
        return len(self._waiting)

    def hold(self, exchange: Detached) -> str:
        """Keep `exchange` until its entry arrives; returns the key Envoy will log."""
        if len(self._waiting) >= self.limit:
            oldest = next(iter(self._waiting))
            self._give_up(oldest, "over the limit of waiting exchanges")
        # Random per request (round 2, finding 2): a key seen once tells nothing of the next,
        # and keys of an earlier EPP process never match.
        key = self._random_key()
        while key in self._waiting:  # pragma: no cover  (96 random bits)
            key = self._random_key()
        self._waiting[key] = (self.clock(), exchange)
        return key

    def _random_key(self) -> str:
        """`secrets.token_urlsafe(12)`'s key (96 bits from `os.urandom`, 16 URL-safe base64
        characters), its bytes read from the OS 256 keys at a time: one system call and four
        Python frames fewer per routed request. Each key is still its own unpredictable bytes."""
        at = self._entropy_at
        if at >= len(self._entropy):
            self._entropy, at = os.urandom(_KEY_BYTES * 256), 0
        self._entropy_at = at + _KEY_BYTES
        raw = binascii.b2a_base64(self._entropy[at : at + _KEY_BYTES], newline=False)
        return raw.translate(_URLSAFE).decode("ascii")

    def resume(self, key: str | None) -> Detached | None:
        """The response processor's stream for `key` began: it takes the exchange over (its
        access-log entry is then ignored). None for a key this process never gave out."""
        held = self._waiting.pop(key, None) if key is not None else None
        return held[1] if held is not None else None

    def waiting(self, key: str) -> Detached | None:
        """The exchange waiting under `key`, left waiting (None if none)."""
        held = self._waiting.get(key)
        return held[1] if held is not None else None

    def discard(self, key: str) -> None:
        """The detach never reached Envoy (the stream broke first): forget it."""
        self._waiting.pop(key, None)

    def first_byte(self, key: str) -> bool:
        """The first byte of `key`'s response passed Envoy; False for a key not waiting."""
        held = self._waiting.get(key)
        if held is None:
            return False
        held[1].first_byte_passed()
        return True

    def settle(self, key: str, outcome: Outcome) -> bool:
        held = self._waiting.pop(key, None)
        if held is None:
            return False
        self.settled += 1
        held[1].observed(outcome)
        return True

    def expire(self) -> int:
        """Settle, as unknown, the exchanges that waited longer than the TTL."""
        cutoff = self.clock() - self.ttl_s
        old = [key for key, (since, _) in self._waiting.items() if since < cutoff]
        for key in old:
            self._give_up(key, "no access-log entry within the TTL")
        return len(old)

    def give_up_all(self, why: str) -> int:
        """Settle every waiting exchange as unknown (their entries can no longer come: the
        Envoy that owed them died); returns how many."""
        keys = list(self._waiting)
        for key in keys:
            self._give_up(key, why, quiet=True)  # the caller logs once for all
        return len(keys)

    def _give_up(self, key: str, why: str, *, quiet: bool = False) -> None:
        held = self._waiting.pop(key, None)
        if held is None:
            return
        self.expired += 1
        if not quiet:
            log.warning("response observer: request settled as unknown (%s) key=%s", why, key)
        held[1].observed(Outcome(status=UNKNOWN_STATUS))


class AccessLogReceiver(als_pb2_grpc.AccessLogServiceServicer):  # type: ignore[misc]
    """Envoy's access-log stream: each HTTP entry settles its detached exchange."""

    def __init__(self, detached: DetachedExchanges) -> None:
        self.detached = detached

    async def StreamAccessLogs(
        self,
        request_iterator: AsyncIterator[als_pb2.StreamAccessLogsMessage],
        context: grpc.aio.ServicerContext | None = None,
    ) -> als_pb2.StreamAccessLogsResponse:
        async for message in request_iterator:
            for entry in message.http_logs.log_entry:
                try:
                    parsed = outcome_of(entry)
                    log.debug("access-log entry %s", parsed)
                    if parsed is not None:
                        if self.detached.tap is not None:
                            held = self.detached.waiting(parsed[0])
                            self.detached.tap.entry(entry, parsed[0], held)
                        self.detached.settle(*parsed)
                except Exception:
                    log.exception("response observer: an access-log entry could not be applied")
        return als_pb2.StreamAccessLogsResponse()

    def register(self, server: grpc.aio.Server) -> None:
        als_pb2_grpc.add_AccessLogServiceServicer_to_server(self, server)


class FirstByteReceiver:
    """The Lua filter's first-byte reports (`observation.FIRST_BYTE_PATH`), as they happen.

    Unary calls with the exchange key as a StringValue; an unknown key (an earlier EPP
    process, or the access-log entry came first) is ignored. Always answered with Empty, so
    a report can never make Envoy retry or log an error for the client's request."""

    def __init__(self, detached: DetachedExchanges) -> None:
        self.detached = detached

    async def first_byte(
        self, request: wrappers_pb2.StringValue, context: grpc.aio.ServicerContext | None = None
    ) -> empty_pb2.Empty:
        try:
            if self.detached.tap is not None:
                self.detached.tap.first_byte(request.value, self.detached.waiting(request.value))
            self.detached.first_byte(request.value)
        except Exception:
            log.exception("response observer: a first-byte report could not be applied")
        return empty_pb2.Empty()

    def register(self, server: grpc.aio.Server) -> None:
        handler = grpc.unary_unary_rpc_method_handler(
            self.first_byte,
            request_deserializer=wrappers_pb2.StringValue.FromString,
            response_serializer=empty_pb2.Empty.SerializeToString,
        )
        server.add_generic_rpc_handlers(
            (grpc.method_handlers_generic_handler(wire.FIRST_BYTE_SERVICE,
                                                  {wire.FIRST_BYTE_METHOD: handler}),)
        )  # fmt: skip
