"""Only the Envoy `serve` runs may call the EPP's gRPC port (reliability round 2, finding 2).

A client that reached the port could route requests it never sent (phantom in-flight counts),
learn every endpoint from the replies, and settle live streams with forged access-log entries.
`serve` binds the port to loopback and gives its Envoy a random token (`new_token`), which
Envoy sends as gRPC metadata on every ext_proc stream, access-log stream and first-byte call
(`grpc_service.initial_metadata`; a header of the Lua filter's call). `EnvoyOnly` refuses
every other call with UNAUTHENTICATED before any servicer runs, and counts it. The gRPC health
service stays open: it reads, it changes nothing, and Envoy's health checker sends no metadata.
"""

from __future__ import annotations

import logging
import secrets
from collections.abc import Awaitable, Callable
from typing import Any

import grpc

log = logging.getLogger("poolkeeper.extproc")

TOKEN_HEADER = "x-poolkeeper-epp-token"
_OPEN_PREFIX = "/grpc.health.v1.Health/"


def new_token() -> str:
    """A token nobody can guess: 256 random bits, URL-safe (a valid gRPC metadata value)."""
    return secrets.token_urlsafe(32)


async def _refuse(_request: Any, context: grpc.aio.ServicerContext) -> None:
    await context.abort(grpc.StatusCode.UNAUTHENTICATED, "only the gateway's Envoy may call")


async def _refuse_stream(_request: Any, context: grpc.aio.ServicerContext) -> Any:
    await context.abort(grpc.StatusCode.UNAUTHENTICATED, "only the gateway's Envoy may call")
    yield  # pragma: no cover  (an async generator, as streaming handlers are)


def _refusing(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    """A handler of the same shape as `handler` that refuses the call."""
    decode, encode = handler.request_deserializer, handler.response_serializer
    if handler.request_streaming and handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(_refuse_stream, decode, encode)
    if handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(_refuse, decode, encode)
    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(_refuse_stream, decode, encode)
    return grpc.unary_unary_rpc_method_handler(_refuse, decode, encode)


class EnvoyOnly(grpc.aio.ServerInterceptor):  # type: ignore[misc]
    """Refuses calls without `token` in their metadata (the health service excepted)."""

    def __init__(self, token: str) -> None:
        self._token = token.encode()
        self.refused = 0  # calls refused since start (exported as a counter)

    def allows(self, metadata: Any) -> bool:
        for key, value in metadata or ():
            if key == TOKEN_HEADER:
                given = value.encode() if isinstance(value, str) else bytes(value)
                return secrets.compare_digest(given, self._token)
        return False

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(details)
        method = details.method or ""
        if handler is None or method.startswith(_OPEN_PREFIX):
            return handler
        if self.allows(details.invocation_metadata):
            return handler
        self.refused += 1
        if self.refused == 1 or self.refused % 1000 == 0:  # never a line per forged call
            log.warning("refused %d gRPC call(s) without Envoy's token (%s)", self.refused, method)
        return _refusing(handler)
