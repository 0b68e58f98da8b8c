"""Real-time driver: steps every engine of the process from one asyncio task.

One scheduler loop for all servers (not a task per token): it sleeps until the earliest step end
among the engines (a heap of due times), completes the steps that are due on the loop's monotonic
clock, and wakes the HTTP handlers whose requests got tokens. A submit to an idle engine plans a
step at once and wakes the loop if that step ends sooner than the loop's current sleep.

The engine clock is `loop.time()`. If the loop runs late, the engine still steps on its own
schedule (a step's tokens carry the step's end time); late delivery is the only distortion, and
the capacity benchmark measures it.

`hold()` / `release()` / `resume()` are a seam for tests that must observe a state (say, two
requests running and four waiting) without racing the wall clock: while held, arriving requests
queue in the driver; `release()` hands them all to the engines at one instant (their arrival is
that instant), and no step is delivered until `resume()`.
"""

from __future__ import annotations

import asyncio
import heapq
import math
from collections.abc import Callable

from poolkeeper.sim.engine import EngineModel, SimRequest


class TokenWaiter:
    """The handler side of one request: wakes the handler when it has something to send."""

    __slots__ = ("pusher", "request", "stream", "waiter")

    def __init__(self, request: SimRequest, *, stream: bool) -> None:
        self.request = request
        self.stream = stream
        self.waiter: asyncio.Future[None] | None = None
        # Set by a streaming handler that lets the driver write tokens straight to the socket
        # (no task switch per token); it notifies the handler itself when the stream ends.
        self.pusher: Callable[[], None] | None = None

    def on_progress(self) -> None:
        """Called by the driver after each step that gave this request a token."""
        if self.pusher is not None:
            self.pusher()
        elif self.stream or self.request.done:
            self.notify()

    def notify(self) -> None:
        waiter = self.waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def wait(self) -> None:
        """Return when the request has progressed since the last call (or is done)."""
        self.waiter = asyncio.get_running_loop().create_future()
        try:
            await self.waiter
        finally:
            self.waiter = None


class RealtimeDriver:
    """Owns the engines' clock in real time. Start with `run()` as a task; `close()` stops it."""

    def __init__(self, engines: list[EngineModel]) -> None:
        self.engines = engines
        self._heap: list[tuple[float, int, int]] = []
        self._due: list[float | None] = [None] * len(engines)
        self._seq = 0
        self._wake: asyncio.Future[None] | None = None
        self._sleep_until = math.inf
        self._closed = False
        self.lag_max = 0.0  # worst lateness of step delivery seen (seconds)
        self.lag_sum = 0.0
        self.steps_delivered = 0
        self._held: list[tuple[int, SimRequest, TokenWaiter]] | None = None
        self._frozen = False

    def now(self) -> float:
        return asyncio.get_running_loop().time()

    def submit(self, index: int, request: SimRequest, waiter: TokenWaiter) -> None:
        if self._held is not None:
            self._held.append((index, request, waiter))
            return
        request.sink = waiter
        self.engines[index].submit(request, request.arrival)
        self._reschedule(index)

    def cancel(self, index: int, request_id: str) -> None:
        self.engines[index].cancel(request_id, self.now())
        self._reschedule(index)

    def held_count(self) -> int:
        """How many requests wait in `hold()` (0 when not holding)."""
        return 0 if self._held is None else len(self._held)

    def hold(self) -> None:
        """Queue new requests here and deliver no step until `release()` and `resume()`."""
        self._held = []
        self._frozen = True

    def release(self) -> None:
        """Submit every held request at this instant; steps stay frozen until `resume()`."""
        held, self._held = self._held or [], None
        now = self.now()
        for index, request, waiter in held:
            request.arrival = now
            request.sink = waiter
            self.engines[index].submit(request, now)
        for index in sorted({index for index, _, _ in held}):
            self._reschedule(index)

    def resume(self) -> None:
        """Deliver steps again (those that ended meanwhile are delivered late, at once)."""
        self._frozen = False
        self._kick()

    def close(self) -> None:
        self._closed = True
        self._kick()

    def _reschedule(self, index: int) -> None:
        t = self.engines[index].next_event_time()
        if t is not None and t != self._due[index]:
            self._due[index] = t
            self._seq += 1
            heapq.heappush(self._heap, (t, self._seq, index))
            if t < self._sleep_until:
                self._kick()

    def _kick(self) -> None:
        wake = self._wake
        if wake is not None and not wake.done():
            wake.set_result(None)

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        heap = self._heap
        while not self._closed:
            now = loop.time()
            while heap and heap[0][0] <= now and not self._frozen:
                t, _, index = heapq.heappop(heap)
                if self._due[index] != t:
                    continue
                self._due[index] = None
                self._deliver(self.engines[index], now)
                self._reschedule(index)
            self._sleep_until = heap[0][0] if heap else math.inf
            self._wake = loop.create_future()
            handle = None
            if heap and not self._frozen:
                handle = loop.call_at(self._sleep_until, _resolve, self._wake)
            try:
                await self._wake
            finally:
                self._wake = None
                self._sleep_until = -math.inf  # while awake, any submit may need a look
                if handle is not None:
                    handle.cancel()

    def _deliver(self, engine: EngineModel, now: float) -> None:
        for outcome in engine.advance(now):
            lag = now - outcome.time
            self.lag_sum += lag
            self.steps_delivered += 1
            if lag > self.lag_max:
                self.lag_max = lag
            for request in outcome.tokens:
                waiter = request.sink
                if isinstance(waiter, TokenWaiter):
                    waiter.on_progress()


def _resolve(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)
