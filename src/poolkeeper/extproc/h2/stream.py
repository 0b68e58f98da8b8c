"""One gRPC stream's state on a lean-transport connection: its windows in both directions,
the credit held back from Envoy, its message reader and inbox, its handler's task, and the
reply bytes and trailers waiting for window."""

from __future__ import annotations

import asyncio
from collections import deque

from poolkeeper.extproc.h2.rpc import Inbox, MessageReader


class Stream:
    __slots__ = (
        "deferred",
        "headers_sent",
        "id",
        "inbox",
        "pending",
        "pending_bytes",
        "reader",
        "recv_window",
        "remote_closed",
        "send_window",
        "task",
        "trailer",
        "unacked",
    )

    def __init__(self, stream_id: int, send_window: int, recv_window: int, max_msg: int) -> None:
        self.id = stream_id
        self.send_window = send_window
        self.recv_window = recv_window
        self.unacked = 0  # received bytes not yet credited back
        self.deferred = 0  # credit held back until the handler reads (backpressure)
        self.reader = MessageReader(max_msg)
        self.inbox: Inbox | None = None
        self.task: asyncio.Task[None] | None = None
        self.pending: deque[bytes | memoryview] = deque()  # reply bytes waiting for window
        self.pending_bytes = 0
        self.trailer: bytes | None = None  # to send once `pending` is out
        self.headers_sent = False
        self.remote_closed = False
