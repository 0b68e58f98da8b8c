"""KV-event batches received on a thread of their own, stamped as they come off the socket.

The default `KVEventSubscriber` reads its SUB sockets on the EPP's event loop: a batch waits
behind whatever the loop is doing (decisions, gRPC, scrapes) before it is even read. With
`kvEventsReceiveThread` one thread polls every followed endpoint's socket, takes each message
off at once, stamps it with the wall clock, and hands it to the loop
(`call_soon_threadsafe`), which applies it as before. The stamp is what a step-phase scorer
would go by; the index itself is still updated on the loop (it is not thread-safe). The
thread still needs the GIL: with the loop busy in Python code it runs at the loop's next
blocking call or after the interpreter's switch interval (5 ms by default).
docs/notes/2026-12-07-kv-events-decode.md measures both.

Sockets live on the thread only (ZMQ sockets are not thread-safe): `add` and `remove` queue
the change, which the thread picks up within one poll interval (`POLL_MS`). An address ZMQ
refuses is reported to the loop (`refused`, called there). `handed` counts the messages handed
to the loop; only this thread writes it (`kvstats.py` says why the loop may read it).

The hand-off is bounded in bytes: `call_soon_threadsafe` queues without limit, so the thread
counts the payload bytes it handed (`handed_bytes`, written here) and the loop those it took
(`taken_bytes`, written there); past `MAX_PENDING_BYTES` in between (a loop stalled while
engines publish), the thread drops the message (`dropped`, with a warning at most every
`WARN_EVERY_S`): the loop sees the sequence gap at that endpoint's next message and falls back.

Both modes read a message frame by frame (`rest_of_message`), keeping at most its first
`MESSAGE_FRAMES`: `recv_multipart` would gather every part of a message before anyone could
check their number, and a peer may send millions of parts, each under `MAXMSGSIZE`.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import Any, Protocol

from poolkeeper.kvevents import MAX_MESSAGE_BYTES

log = logging.getLogger(__name__)

MESSAGE_FRAMES = 3  # topic, 8-byte sequence, payload: a longer message is malformed
# ZMQ sockets per context (its default 1,023): one per followed endpoint, and a reopened one's
# slot is freed on ZMQ's reaper thread after the new socket may have taken another (measured:
# 1,000 endpoints reopened at once on the default, 223 sockets refused; the bounds note).
MAX_SOCKETS = 8_192
POLL_MS = 50  # how soon a new subscription or a stop is seen by the thread
# Bytes handed to the loop and not taken yet: room for four messages of the largest size.
MAX_PENDING_BYTES = 4 * MAX_MESSAGE_BYTES
WARN_EVERY_S = 10.0  # at most one warning per endpoint (or per receive thread) this often


class _Warned(Protocol):
    warned_at: float


def warn_every(holder: _Warned) -> bool:
    """True at most once per WARN_EVERY_S for `holder` (then its time is noted): a peer
    sending bad messages in a loop must not flood the log."""
    now = time.monotonic()
    if now - holder.warned_at < WARN_EVERY_S:
        return False
    holder.warned_at = now
    return True


def rest_of_message(sock: Any, first: bytes) -> list[bytes]:
    """The frames of the message whose first frame `first` was just taken off `sock` (a sync
    socket): all of them if they are at most MESSAGE_FRAMES, else none (the rest is read to
    its end and dropped part by part, never kept; the caller counts it as malformed frames).
    ZMQ delivers a message whole (its first part is readable only once its last has come), so
    reading the rest never waits: the NOBLOCK is a guard, never the loop's stall."""
    import zmq

    frames = [first]
    over = False
    while sock.get(zmq.RCVMORE):
        try:
            part = sock.recv(zmq.NOBLOCK)
        except zmq.Again:  # pragma: no cover - ZMQ's atomic delivery: not seen
            break
        if over:
            continue
        if len(frames) == MESSAGE_FRAMES:
            over, frames = True, []
        else:
            frames.append(part)
    return frames


class ThreadReceiver:
    """One thread, one poller, a SUB socket per endpoint; messages go to `deliver` on `loop`."""

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        deliver: Callable[[str, list[bytes], float], None],
        configure: Callable[[Any], None],
        refused: Callable[[str], None],
    ) -> None:
        import zmq

        self._ctx = zmq.Context()
        self._ctx.set(zmq.MAX_SOCKETS, MAX_SOCKETS)
        self._loop = loop
        self._deliver = deliver
        self._configure = configure  # socket options, set on the thread before connecting
        self._refused = refused  # an endpoint whose address ZMQ refused, told on the loop
        self.handed = 0  # messages handed to the loop (written by the thread only)
        self.handed_bytes = 0  # their payload bytes (written by the thread only)
        self.taken_bytes = 0  # payload bytes the loop took (written on the loop only)
        self.dropped = 0  # messages dropped past MAX_PENDING_BYTES (written by the thread)
        self.warned_at = float("-inf")  # the thread's last warning (`warn_every`)
        self._changes: queue.SimpleQueue[tuple[str, str | None]] = queue.SimpleQueue()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kv-events-recv", daemon=True)
        self._thread.start()

    def add(self, endpoint: str, address: str) -> None:
        self._changes.put((endpoint, address))

    def remove(self, endpoint: str) -> None:
        self._changes.put((endpoint, None))

    def stop(self) -> None:
        """End the thread, close its sockets and the context (blocks up to a poll interval)."""
        self._stop.set()
        self._thread.join()
        self._ctx.term()

    def _take(
        self,
        deliver: Callable[[str, list[bytes], float], None],
        endpoint: str,
        frames: list[bytes],
        received_at: float,
        size: int,
    ) -> None:
        """On the loop: the message leaves the hand-off's byte count, then is delivered."""
        self.taken_bytes += size
        deliver(endpoint, frames, received_at)

    def _run(self) -> None:
        import zmq

        poller = zmq.Poller()
        socks: dict[str, Any] = {}
        names: dict[Any, str] = {}
        loop, deliver = self._loop, self._deliver
        try:
            while not self._stop.is_set():
                while not self._changes.empty():
                    endpoint, address = self._changes.get()
                    old = socks.pop(endpoint, None)
                    if old is not None:
                        poller.unregister(old)
                        del names[old]
                        old.close(linger=0)
                    if address is not None:
                        try:
                            sock = self._ctx.socket(zmq.SUB)
                        except zmq.ZMQError as exc:  # out of sockets or descriptors
                            log.warning(
                                "kv events from %s: %s; tried again when reopened", endpoint, exc
                            )
                            continue
                        try:
                            self._configure(sock)
                            sock.connect(address)
                        except zmq.ZMQError as exc:
                            # One bad address loses that endpoint only, as on the loop.
                            log.warning("kv events from %s (%s): %s", endpoint, address, exc)
                            sock.close(linger=0)
                            try:
                                loop.call_soon_threadsafe(self._refused, endpoint)
                            except RuntimeError:  # the loop is closed: shutting down
                                return
                            continue
                        poller.register(sock, zmq.POLLIN)
                        socks[endpoint], names[sock] = sock, endpoint
                for sock, _ in poller.poll(POLL_MS):
                    try:
                        first = sock.recv(zmq.NOBLOCK)
                    except zmq.Again:
                        continue
                    frames = rest_of_message(sock, first)
                    received_at = time.time()
                    size = sum(len(f) for f in frames)
                    if self.handed_bytes - self.taken_bytes + size > MAX_PENDING_BYTES:
                        self.dropped += 1
                        if warn_every(self):
                            log.warning(
                                "kv events from %s: the loop is %d bytes behind; dropped",
                                names[sock],
                                self.handed_bytes - self.taken_bytes,
                            )
                        continue
                    self.handed += 1  # before the loop can take it: `kvstats.py`
                    self.handed_bytes += size
                    try:
                        loop.call_soon_threadsafe(
                            self._take, deliver, names[sock], frames, received_at, size
                        )
                    except RuntimeError:  # the loop is closed: shutting down
                        return
        finally:
            for sock in socks.values():
                sock.close(linger=0)
