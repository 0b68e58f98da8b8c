"""The EPP's gRPC methods on the lean transport (`extproc/h2/`), by path.

The same servicer objects as on grpcio (`server.ExtProcServicer`, the access-log and first-byte
receivers): each transport only feeds them an async iterator of decoded requests, and neither
uses the grpcio context, so both transports run the same code.
"""

from __future__ import annotations

import ssl
from collections.abc import Mapping

from envoy.service.accesslog.v3 import als_pb2
from google.protobuf import empty_pb2, wrappers_pb2

from poolkeeper import observation as wire
from poolkeeper.extproc.accesslog import AccessLogReceiver, DetachedExchanges, FirstByteReceiver
from poolkeeper.extproc.h2.limits import Limits
from poolkeeper.extproc.h2.rpc import Method, bidi, client_stream, unary
from poolkeeper.extproc.h2.server import LeanServer
from poolkeeper.extproc.server import ExtProcServicer
from poolkeeper.extproc.wire import grpc_message, read_request

PROCESS_PATH = "/envoy.service.ext_proc.v3.ExternalProcessor/Process"
ACCESS_LOG_PATH = "/envoy.service.accesslog.v3.AccessLogService/StreamAccessLogs"


def extproc_methods(
    servicer: ExtProcServicer, detached: DetachedExchanges | None = None
) -> dict[str, Method]:
    """ext_proc's Process, and with the response observer its access log and first bytes."""
    methods = {
        PROCESS_PATH: bidi(
            servicer.Process,
            read_request,
            grpc_message,
            enveloped=True,
        )
    }
    if detached is not None:
        methods[ACCESS_LOG_PATH] = client_stream(
            AccessLogReceiver(detached).StreamAccessLogs,
            als_pb2.StreamAccessLogsMessage.FromString,
            als_pb2.StreamAccessLogsResponse.SerializeToString,
        )
        methods[wire.FIRST_BYTE_PATH] = unary(
            FirstByteReceiver(detached).first_byte,
            wrappers_pb2.StringValue.FromString,
            empty_pb2.Empty.SerializeToString,
        )
    return methods


async def start_lean(
    servicer: ExtProcServicer,
    host: str,
    port: int,
    *,
    detached: DetachedExchanges | None = None,
    token: str | None = None,
    tls: ssl.SSLContext | None = None,
    limits: Limits | None = None,
    more: Mapping[str, Method] | None = None,
) -> LeanServer:
    """The lean transport serving the EPP's methods (and `more`) on `host:port`, listening."""
    methods = extproc_methods(servicer, detached)
    methods.update(more or {})
    server = LeanServer(methods, limits=limits, token=token, tls=tls)
    await server.listen(host, port)
    return server
