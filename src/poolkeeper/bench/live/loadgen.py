"""Open-loop HTTP load generator for live benchmarks (loopback only).

Sends each workload arrival at its scheduled time as a streaming OpenAI chat completion
(`max_tokens` = the arrival's output length) and records, per request: the time of the first
chunk carrying text (the role-only opening chunk does not count), finish time, chunks received,
HTTP status, and which server answered (the simulator's `x-sim-server` header, else the
gateway's `x-gateway-destination-endpoint-served`). 429 answers count as shed. Bounded in count
(`max_requests`) and time (`time_limit`); refuses any target that is not on loopback.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Sequence
from dataclasses import dataclass
from urllib.parse import urlsplit

import aiohttp

from poolkeeper.bench.results.metrics import RequestOutcome
from poolkeeper.bench.workload.workload_spec import Arrival
from poolkeeper.errors import ConfigError
from poolkeeper.tokens import count_tokens

LOOPBACK_HOSTS = frozenset({"127.0.0.1", "localhost", "::1"})
SERVER_HEADERS = ("x-sim-server", "x-gateway-destination-endpoint-served", "x-backend-port")


def check_loopback(url: str) -> None:
    host = urlsplit(url).hostname
    if host not in LOOPBACK_HOSTS:
        raise ConfigError(f"live benchmarks only target 127.0.0.1; refusing {url!r}")


@dataclass(frozen=True, slots=True)
class LiveResult:
    outcome: RequestOutcome
    status: int
    chunks: int
    error: str = ""


def _has_text(choice: dict[str, object]) -> bool:
    """A chunk carries a token when its delta (chat) or text (completions) is non-empty; the
    role-only first chunk of a chat stream does not count as the first token."""
    delta = choice.get("delta")
    if isinstance(delta, dict) and delta.get("content"):
        return True
    return bool(choice.get("text"))


class _Progress:
    """Shared by the request tasks of one run: how many are resolved, and the stop flag."""

    __slots__ = ("resolved", "stop", "total")

    def __init__(self, total: int) -> None:
        self.total = total
        self.resolved = 0  # got a first token, or failed
        self.stop = asyncio.Event()


def stream_body(arrival: Arrival) -> dict[str, object]:
    """The streaming chat request of `arrival` (with the usage chunk at the end)."""
    return {
        "model": arrival.model,
        "messages": arrival.messages(),
        "max_tokens": arrival.output_tokens,
        "stream": True,
        "stream_options": {"include_usage": True},
    }


async def _one(
    session: aiohttp.ClientSession,
    url: str,
    arrival: Arrival,
    t0: float,
    request_timeout: float,
    progress: _Progress | None = None,
) -> LiveResult:
    body = stream_body(arrival)
    start = time.monotonic() - t0
    first: float | None = None
    chunks = 0
    cached = 0
    server: str | None = None
    status = 0
    error = ""
    try:
        async with session.post(
            url, json=body, timeout=aiohttp.ClientTimeout(total=request_timeout)
        ) as resp:
            status = resp.status
            for name in SERVER_HEADERS:
                if name in resp.headers:
                    server = resp.headers[name]
                    break
            if status != 200:
                await resp.read()
            else:
                async for raw in resp.content:
                    line = raw.strip()
                    if not line.startswith(b"data:"):
                        continue
                    payload = line[5:].strip()
                    if payload == b"[DONE]":
                        break
                    try:
                        event = json.loads(payload)
                    except ValueError:
                        continue
                    choices = event.get("choices") or []
                    if choices and _has_text(choices[0]):
                        if first is None:
                            first = time.monotonic() - t0
                            if progress is not None:
                                progress.resolved += 1
                        chunks += 1
                    if progress is not None and progress.stop.is_set():
                        break
                    usage = event.get("usage") or {}
                    details = usage.get("prompt_tokens_details") or {}
                    cached = int(details.get("cached_tokens") or cached)
    except (aiohttp.ClientError, TimeoutError) as exc:
        error = type(exc).__name__
    stopped = progress is not None and progress.stop.is_set() and status == 200
    if progress is not None and first is None:
        progress.resolved += 1
    finish = time.monotonic() - t0 if status == 200 and not error and not stopped else None
    outcome = RequestOutcome(
        request_id=arrival.request_id,
        criticality=arrival.criticality,
        arrival=start,
        prompt_tokens=count_tokens(arrival.prompt_text()),
        output_tokens=arrival.output_tokens,
        server=server,
        first_token=first if status == 200 and not error else None,
        finish=finish,
        cached_tokens=cached,
        shed=status == 429,
        group=arrival.group,
    )
    return LiveResult(outcome, status, chunks, error)


async def run_open_loop(
    base_url: str,
    arrivals: Sequence[Arrival],
    *,
    max_requests: int = 20_000,
    time_limit: float = 300.0,
    request_timeout: float = 120.0,
    connections: int = 512,
    stop_after_first_tokens: bool = False,
) -> list[LiveResult]:
    """Replay `arrivals` against `base_url` (…/v1/chat/completions) in real time.

    With `stop_after_first_tokens`, the run ends as soon as every request has its first token
    (or failed): later tokens cannot change any TTFT, and long answers would otherwise keep a
    run going for minutes. Requests still streaming then count as not completed (no E2E/ITL).
    """
    check_loopback(base_url)
    url = base_url.rstrip("/") + "/v1/chat/completions"
    todo = list(arrivals)[:max_requests]
    connector = aiohttp.TCPConnector(limit=connections, force_close=False)
    async with aiohttp.ClientSession(connector=connector) as session:
        t0 = time.monotonic()
        tracker = _Progress(len(todo)) if stop_after_first_tokens else None
        tasks: list[asyncio.Task[LiveResult]] = []
        for arrival in todo:
            if arrival.time > time_limit:
                break
            delay = arrival.time - (time.monotonic() - t0)
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(
                asyncio.create_task(_one(session, url, arrival, t0, request_timeout, tracker))
            )
        remaining = max(1.0, time_limit + request_timeout - (time.monotonic() - t0))
        if tracker is not None:
            deadline = time.monotonic() + remaining
            while tracker.resolved < len(tasks) and time.monotonic() < deadline:
                if all(t.done() for t in tasks):
                    break
                await asyncio.sleep(0.05)
            tracker.stop.set()
        done, pending = await asyncio.wait(tasks, timeout=remaining)
        for task in pending:
            task.cancel()
        results = [t.result() for t in tasks if t in done and not t.cancelled()]
    return results
