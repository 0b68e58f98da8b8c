"""The EPP side of KV events: one ZMQ SUB socket per endpoint, feeding the exact prefix index.

Each engine publishes on its own address (vLLM: `--kv-events-config` with a `tcp://*:PORT`
PUB endpoint); the subscriber connects to `tcp://<endpoint ip>:<port>` for every endpoint it is
asked to follow, reads three-frame messages (topic, 8-byte big-endian sequence number, msgpack
batch: `kvevents.py`) and applies each batch to the `ExactPrefixIndex` at `clock()`, the
runtime's one clock (the decisions' `now`, wired by the composition root through the plugin
build context): the index compares a batch's stamp with the decisions' `now`, so another base
would make an endpoint's distrust end at once or never. A sequence gap (ZMQ PUB drops messages
past its high-water mark, and a reconnect misses whatever was sent meanwhile) or an
undecodable batch tells the index its view of that endpoint was lost (`ExactPrefixIndex.lost`,
which distrusts it for a while; the scorer falls back meanwhile).

Endpoints are followed as soon as the EPP knows them: the runtime's wiring tells the prefix
scorer the pool's endpoints on every change (`server/wiring.py`), and the scorer also calls
`follow` with each decision's candidates; `forget` drops the ones that left the pool. Why
early: an engine reports a block once, and a SUB socket gets only what is published after it
connects, so a subscription made at the first decision loses the cold start's first prefixes. Needs
`pyzmq` (the `kv-events` extra); without it `follow` raises ConfigError once at startup.

`on_batch` (None by default: one attribute test a batch) is told of every batch applied:
`on_batch(endpoint, ts, received_at)`, the batch's engine stamp (vLLM: `time.time()` at the end
of the step that stored or evicted blocks) and the wall clock when this loop took it off the
socket. Who listens: the bench-only signal tap (`extproc/signal_tap.py`, its arrival times) and
a step-phase scorer (the batches are the engines' step clock).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterable

from poolkeeper.errors import ConfigError
from poolkeeper.kvevents import KVEventError, decode
from poolkeeper.scheduling.exact_prefix import ExactPrefixIndex

log = logging.getLogger(__name__)

# Longest wait between connection attempts to a silent endpoint (doubling from ZMQ's 100 ms).
RECONNECT_IVL_MAX_MS = 5_000


def events_address(hostport: str, *, port: int, port_offset: int | None) -> str:
    """The ZMQ address of an endpoint's KV events: its IP and `port`, or its HTTP port plus
    `port_offset` (several servers on one host, as the simulator runs them)."""
    host, _, http_port = hostport.rpartition(":")
    if port_offset is not None:
        port = int(http_port) + port_offset
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"  # IPv6
    return f"tcp://{host}:{port}"


class KVEventSubscriber:
    """Per-endpoint SUB tasks on the running loop; not thread-safe (one loop owns it)."""

    __slots__ = (
        "_address",
        "_clock",
        "_closed",
        "_ctx",
        "_tasks",
        "index",
        "on_batch",
        "received",
    )

    def __init__(
        self,
        index: ExactPrefixIndex,
        address: Callable[[str], str],
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        try:
            import zmq.asyncio
        except ImportError as exc:  # pragma: no cover - depends on the install
            raise ConfigError(
                "kvEvents needs the pyzmq package: pip install 'poolkeeper[kv-events]'"
            ) from exc
        self.index = index
        self._address = address
        self._clock = clock
        self._ctx = zmq.asyncio.Context()
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self.received = 0  # batches applied (for tests and stats)
        # (endpoint, batch ts, wall-clock receipt) per batch applied; the module's docstring.
        self.on_batch: Callable[[str, float, float], None] | None = None
        self._closed = False

    def follow(self, endpoints: Iterable[str]) -> None:
        """Subscribe to every endpoint (ip:port) not yet followed (nothing without a running
        loop: a scheduler driven synchronously, as in virtual time, is fed in-process)."""
        if self._closed:  # a pool change late in a shutdown: the context is gone
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return
        for endpoint in endpoints:
            if endpoint not in self._tasks:
                self._tasks[endpoint] = loop.create_task(
                    self._run(endpoint), name=f"kv-events:{endpoint}"
                )

    def forget(self, keep: set[str]) -> None:
        for endpoint in [e for e in self._tasks if e not in keep]:
            self._tasks.pop(endpoint).cancel()

    async def close(self) -> None:
        """End every subscription and the ZMQ context (idempotent; `follow` is a no-op after)."""
        if self._closed:
            return
        self._closed = True
        tasks = list(self._tasks.values())
        self._tasks.clear()
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._ctx.term()

    async def _run(self, endpoint: str) -> None:
        import zmq

        sock = self._ctx.socket(zmq.SUB)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SUBSCRIBE, b"")
        # Back off reconnecting to an endpoint that publishes nothing (ZMQ retries every
        # RECONNECT_IVL, 100 ms, forever by default: 1,000 silent endpoints cost about a
        # third of a core); a publisher that comes up later is joined within the cap.
        sock.setsockopt(zmq.RECONNECT_IVL_MAX, RECONNECT_IVL_MAX_MS)
        sock.connect(self._address(endpoint))
        index = self.index
        expected: int | None = None
        try:
            while True:
                frames = await sock.recv_multipart()
                now = self._clock()  # the decisions' clock
                observer = self.on_batch
                received_at = time.time() if observer is not None else 0.0
                if len(frames) != 3 or len(frames[1]) != 8:
                    log.warning("kv events from %s: not (topic, seq, payload); ignored", endpoint)
                    continue
                seq = int.from_bytes(frames[1], "big")
                if expected is not None and seq != expected:
                    index.lost(endpoint, now)
                expected = seq + 1
                try:
                    batch = decode(frames[2])
                except KVEventError as exc:
                    log.warning("kv events from %s: %s", endpoint, exc)
                    index.lost(endpoint, now)
                    continue
                index.apply(endpoint, batch, now)
                self.received += 1
                if observer is not None:
                    observer(endpoint, batch.ts, received_at)
        finally:
            sock.close(linger=0)
