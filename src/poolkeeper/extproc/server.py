"""The grpc.aio ExternalProcessor service: one `Exchange` per gRPC stream.

The servicer only moves messages: it feeds each ProcessingRequest to the stream's Exchange and
writes its replies in order, and ends the stream early when the Exchange has detached (the
response observer, `extproc/accesslog.py`). The `finally` runs on normal end, on errors and
when Envoy cancels the stream (the task is cancelled inside `route` or between messages), so
in-flight accounting is always released (or, for a detached exchange, left to the access log).
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

import grpc
from envoy.service.ext_proc.v3 import (
    external_processor_pb2 as pb,
    external_processor_pb2_grpc as pb_grpc,
)

from poolkeeper.extproc import request_fields, wire
from poolkeeper.extproc.accesslog import DetachedExchanges
from poolkeeper.extproc.contracts import (
    BodyBudget,
    ExchangeObserver,
    ExtProcSettings,
    RequestRouter,
)
from poolkeeper.extproc.h2.rpc import RESOURCE_EXHAUSTED, RpcError
from poolkeeper.extproc.state import Exchange

log = logging.getLogger("poolkeeper.extproc")

# Envoy's default gRPC message limit is 4 MiB; body mutations are chunked well below it, but a
# large request body arrives as one message in BUFFERED mode.
MAX_MESSAGE_BYTES = 64 << 20


class ExtProcServicer(pb_grpc.ExternalProcessorServicer):  # type: ignore[misc]
    def __init__(
        self,
        router: RequestRouter,
        *,
        settings: ExtProcSettings | None = None,
        observer: ExchangeObserver | None = None,
        on_stream_end: Callable[[Exchange], None] | None = None,
        budget: BodyBudget | None = None,
        detached: DetachedExchanges | None = None,
    ) -> None:
        self.router = router
        self.settings = settings or ExtProcSettings()
        self.observer = observer
        self.on_stream_end = on_stream_end
        self.budget = budget  # request-body bytes held by all streams together
        # The response observer's waiting room (None: the EPP processes every response).
        self.detached = detached
        self.active = 0  # Process streams open now
        self.over_limit = 0  # streams refused at `settings.max_streams` since start

    async def Process(
        self,
        request_iterator: AsyncIterator[wire.Request],
        context: grpc.aio.ServicerContext | None = None,
    ) -> AsyncIterator[wire.Reply]:
        if self.active >= self.settings.max_streams:
            # A direct or runaway client could otherwise hold any number of streams (about
            # 26 KB each). Refused before anything is read or held; Envoy's failure mode
            # decides what its client gets (docs/reliability.md, "Streams the EPP holds").
            self.over_limit += 1
            await _exhausted(context, self.settings.max_streams)
            return
        exchange = Exchange(
            self.router,
            settings=self.settings,
            observer=self.observer,
            budget=self.budget,
            detached=self.detached,
        )
        self.active += 1
        generation = 0  # of the exchange this stream has: a resumed one's is later
        handed_off = False
        try:
            async for request in request_iterator:
                if (
                    self.detached is not None
                    and isinstance(request, pb.ProcessingRequest)
                    and request.HasField("response_headers")
                ):
                    # The response processor's stream (envoy/observer.py): the request was
                    # routed on an earlier stream. An unknown key (routed by an earlier EPP
                    # process) keeps the fresh Exchange, which passes the response on as is.
                    resumed = self.detached.resume(request_fields.exchange_key(request))
                    if isinstance(resumed, Exchange):
                        resumed.resumed()
                        exchange, generation = resumed, resumed.generation
                replies = await exchange.handle(request)
                if exchange.detach_key is not None:
                    # Routed: the replies go, then the stream ends (status OK). Envoy sends the
                    # response on without this process; the access log reports how it ended,
                    # or the response processor's stream resumes the request if the EPP
                    # rewrites it. Handed off from the first reply on (it names the exchange
                    # to Envoy): Envoy may finish the request, and cancel this stream, before
                    # this generator runs again. (Should Envoy never have had that reply, the
                    # waiting room's TTL releases the exchange.)
                    handed_off = True
                    for reply in replies:
                        yield reply
                    return
                for reply in replies:
                    yield reply
                last = replies[-1] if replies else None
                if isinstance(last, pb.ProcessingResponse) and last.HasField("immediate_response"):
                    # Envoy answers the client and drops the stream; end it now rather than
                    # wait for that. A read still pending when Envoy resets the stream, or a
                    # status sent after the reset, leaks ~80 bytes of native memory per
                    # request in grpc.aio (grpc/grpc#43360): 106 bytes per rejected request
                    # before this, 45 after (docs/reliability.md, Soak).
                    return
        finally:
            self.active -= 1
            if not handed_off:
                exchange.close(generation)
            if self.on_stream_end is not None:
                self.on_stream_end(exchange)


def add_process(server: grpc.aio.Server, process: Callable[..., Any]) -> None:
    """ext_proc's Process method on `server`, as the generated `add_...Servicer_to_server`
    adds it, with replies serialized by `wire.serialize_reply` (it takes the body
    mutations the Exchange sends in wire form as well as protobuf messages)."""
    handler = grpc.stream_stream_rpc_method_handler(
        process,
        request_deserializer=pb.ProcessingRequest.FromString,
        response_serializer=wire.serialize_reply,
    )
    service = pb.DESCRIPTOR.services_by_name["ExternalProcessor"].full_name
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler(service, {"Process": handler}),)
    )


async def _exhausted(context: grpc.aio.ServicerContext | None, limit: int) -> None:
    """Ends the call with RESOURCE_EXHAUSTED: grpcio's way (abort), or the lean transport's
    (which passes no context and turns `RpcError` into the status)."""
    message = f"the endpoint picker holds its limit of {limit} ext_proc streams"
    if context is None:
        raise RpcError(RESOURCE_EXHAUSTED, message)
    await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, message)


def build_server(
    servicer: pb_grpc.ExternalProcessorServicer,
    address: str,
    *,
    extra: Callable[[grpc.aio.Server], None] | None = None,
    interceptors: Sequence[grpc.aio.ServerInterceptor] = (),
    credentials: grpc.ServerCredentials | None = None,
) -> tuple[grpc.aio.Server, int]:
    """A grpc.aio server bound to `address` ("host:port", port 0 = any); returns (server, port).
    The servicer is the EPP's (`ExtProcServicer`) or body-based routing's (`bbr.BbrServicer`).
    `credentials` (`extproc.tls.server_credentials`): TLS; None: plaintext."""
    server = grpc.aio.server(
        interceptors=list(interceptors),
        options=[
            ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
            ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
            ("grpc.so_reuseport", 0),
        ],
    )
    add_process(server, servicer.Process)
    if extra is not None:
        extra(server)
    if credentials is None:
        port = server.add_insecure_port(address)
    else:
        port = server.add_secure_port(address, credentials)
    if port == 0:
        raise OSError(f"cannot bind the ext_proc server to {address}")
    return server, port
