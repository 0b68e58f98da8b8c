"""The EPP's own work per request, without Envoy or a transport (a profiling script).

A `poolkeeper serve --no-envoy` runtime runs in this process (the response observer on, as
with the Envoy `serve` runs), in front of one `poolkeeper sim` process it scrapes. This
driver then plays Envoy's part directly on the servicer, one request at a time (light load):
each request is the messages Envoy sends for a chat completion (request headers, then the
body with end_of_stream), decoded from their wire bytes as a transport would, through
`ExtProcServicer.Process`, its replies encoded back; then the access-log entry that settles
the request (in batches of `--batch`, as Envoy flushes them), through the access-log
receiver.

Reported, in thread CPU time (`time.thread_time_ns`: what the code costs, not what the shared
machine's scheduler adds): the request headers' handling, the body's (the routing decision:
`Exchange._route`), the whole stream, and the access-log entry, p10, median and p90 per
request (p10: the least disturbed by other processes on a shared host), and the loop thread's
whole CPU per request (`loop_us`: also the metric samples deferred after a stream, the
access log, the scrapes in the gaps, the driver); `--scheduling` picks a preset or one of
the default's candidates (scheduling/candidate_presets.py) instead of the default;
with `--profile`, cProfile's top functions for the same loop (a second pass: the profiler's
own cost inflates absolute times, the shares are what it is for).

Not a test: run it by hand.

    .venv/bin/python scripts/route_profile.py --requests 3000 [--profile] [--gap-ms 100]

`--gap-ms 100` idles between requests as the light-load benchmark does (10 per second): the
same code then runs with the caches other work left behind. `--chunk-bytes 262144` sends a
large body as `serve`'s Envoy does (messages of its 256 KiB connection buffer); "after last
chunk" is then the CPU between the last body message and the replies.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import cProfile
import io
import itertools
import json
import pstats
import statistics
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

from envoy.config.core.v3 import base_pb2
from envoy.data.accesslog.v3 import accesslog_pb2
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2 as pm
from envoy.service.accesslog.v3 import als_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

from poolkeeper import observation as wire
from poolkeeper.bench.live import live_processes as procs
from poolkeeper.bench.overhead.overhead_gateway import BODY, MODEL, write_config
from poolkeeper.controller.files import file_source
from poolkeeper.extproc.accesslog import AccessLogReceiver
from poolkeeper.extproc.heap import keep_freed_pages
from poolkeeper.extproc.wire import serialize_reply
from poolkeeper.netutil import free_ports
from poolkeeper.server.options import ServeOptions
from poolkeeper.server.runtime import GatewayRuntime


def envoy_messages(body: bytes, request_id: str, chunk_bytes: int = 0) -> list[bytes]:
    """What Envoy sends on the ext_proc stream for one POST (wire bytes): headers as the HTTP
    connection manager has them by then, the body in one chunk with end_of_stream, or in
    chunks of `chunk_bytes` (`serve`'s Envoy: 262,144, its connection buffer), the last
    with end_of_stream."""
    values = {
        ":authority": "127.0.0.1:8080",
        ":path": "/v1/chat/completions",
        ":method": "POST",
        ":scheme": "http",
        "content-type": "application/json",
        "content-length": str(len(body)),
        "user-agent": "Python/3.11 aiohttp/3.12",
        "accept": "*/*",
        "accept-encoding": "gzip, deflate",
        "x-forwarded-proto": "http",
        "x-request-id": request_id,
    }
    headers = pb.HttpHeaders(
        headers=base_pb2.HeaderMap(
            headers=[base_pb2.HeaderValue(key=k, raw_value=v.encode()) for k, v in values.items()]
        )
    )
    first = pb.ProcessingRequest(request_headers=headers)
    first.protocol_config.request_body_mode = pm.ProcessingMode.FULL_DUPLEX_STREAMED
    first.protocol_config.response_body_mode = pm.ProcessingMode.NONE
    size = chunk_bytes or len(body)
    edges = [*range(0, len(body), size), len(body)]
    chunks = [
        pb.ProcessingRequest(request_body=pb.HttpBody(body=body[a:b], end_of_stream=b == edges[-1]))
        for a, b in itertools.pairwise(edges)
    ]
    return [first.SerializeToString(), *(c.SerializeToString() for c in chunks)]


def access_log_entry(key: str, upstream_port: int) -> accesslog_pb2.HTTPAccessLogEntry:
    """The entry Envoy logs for a routed request (the observer's Lua stamps and counts)."""
    entry = accesslog_pb2.HTTPAccessLogEntry()
    common = entry.common_properties
    common.metadata.filter_metadata[wire.NAMESPACE].update(
        {wire.EXCHANGE: key, wire.FIRST_BYTE_AT: 1002.5,
         wire.PROMPT_TOKENS: 9, wire.COMPLETION_TOKENS: 1, wire.EVENTS: 0, wire.DONE_EVENTS: 0}
    )  # fmt: skip
    common.start_time.FromMilliseconds(990)
    common.time_to_first_upstream_tx_byte.FromMilliseconds(10)
    address = common.upstream_remote_address.socket_address
    address.address, address.port_value = "127.0.0.1", upstream_port
    common.time_to_last_downstream_tx_byte.FromMilliseconds(3)
    entry.response.response_code.value = 200
    entry.response.response_body_bytes = 300
    return entry


class Driver:
    def __init__(
        self,
        runtime: GatewayRuntime,
        sim_port: int,
        batch: int,
        prompt_bytes: int = 0,
        chunk_bytes: int = 0,
    ) -> None:
        assert runtime.servicer is not None
        assert runtime.detached is not None
        self.servicer = runtime.servicer
        self.receiver = AccessLogReceiver(runtime.detached)
        self.sim_port = sim_port
        self.batch = batch
        body = BODY
        if prompt_bytes:
            text = "the quick brown fox jumps over the lazy dog " * (prompt_bytes // 44 + 1)
            body = {**BODY, "messages": [{"role": "user", "content": text[:prompt_bytes]}]}
        self.body = json.dumps(body).encode()
        self.chunk_bytes = chunk_bytes
        self.n = 0
        self.keys: list[str] = []
        self.times: dict[str, list[int]] = {
            "headers": [], "body": [], "after last chunk": [], "stream": [], "log": []
        }  # fmt: skip

    async def one(self) -> None:
        self.n += 1
        wires = envoy_messages(self.body, f"req-{self.n}", self.chunk_bytes)
        clock = time.thread_time_ns
        marks: list[int] = []

        async def requests() -> AsyncIterator[pb.ProcessingRequest]:
            for raw in wires:
                marks.append(clock())
                yield pb.ProcessingRequest.FromString(raw)

        began = clock()
        replies = [r async for r in self.servicer.Process(requests())]
        routed = clock()  # the stream ends once routed (handed off to the access log)
        encoded = [serialize_reply(r) for r in replies]
        ended = clock()
        assert encoded, "no reply"
        first = replies[0]
        assert isinstance(first, pb.ProcessingResponse), replies
        assert first.HasField("request_headers"), replies
        self.times["headers"].append(marks[1] - marks[0])
        self.times["body"].append(routed - marks[1])
        self.times["after last chunk"].append(routed - marks[-1])
        self.times["stream"].append(ended - began)
        names = first.dynamic_metadata.fields[wire.NAMESPACE]
        self.keys.append(names.struct_value.fields[wire.EXCHANGE].string_value)
        if len(self.keys) >= self.batch:
            await self.flush()

    async def flush(self) -> None:
        clock = time.thread_time_ns
        began = clock()
        message = als_pb2.StreamAccessLogsMessage()
        message.http_logs.log_entry.extend(access_log_entry(k, self.sim_port) for k in self.keys)
        raw = message.SerializeToString()

        async def entries() -> AsyncIterator[als_pb2.StreamAccessLogsMessage]:
            yield als_pb2.StreamAccessLogsMessage.FromString(raw)

        await self.receiver.StreamAccessLogs(entries())
        self.times["log"].append((clock() - began) // len(self.keys))
        self.keys.clear()

    async def run(self, n: int, gap_s: float = 0.0) -> None:
        for _ in range(n):
            await self.one()
            # The scrapers' turn, as between real requests; with a gap, as at light load
            # (10 requests/s: the caches go cold between requests).
            await asyncio.sleep(gap_s)
        if self.keys:
            await self.flush()


def _summary(times: dict[str, list[int]]) -> dict[str, dict[str, float]]:
    out = {}
    for name, values in times.items():
        ordered = sorted(values)
        out[name] = {
            "n": float(len(ordered)),
            "p10_us": ordered[int(0.1 * (len(ordered) - 1))] / 1000,
            "median_us": statistics.median(ordered) / 1000,
            "p90_us": ordered[int(0.9 * (len(ordered) - 1))] / 1000,
            "mean_us": statistics.fmean(ordered) / 1000,
        }
    return out


def _use_scheduling(gateway_yaml: Path, name: str) -> None:
    """Replace the config's `scheduling: {preset: default}` by the preset `name`, or by the
    document of the default candidate `name` (scheduling/candidate_presets.py's CANDIDATES),
    inline: the same config in the tree under test and in an older one (PYTHONPATH A/B)."""
    from poolkeeper.scheduling import candidate_presets, presets

    if name in candidate_presets.CANDIDATES:
        document = json.dumps(candidate_presets.candidate_document(name))
    else:
        presets.preset_document(name)  # KeyError naming the known presets
        document = json.dumps({"preset": name})
    text = gateway_yaml.read_text()
    old = "  scheduling: {preset: default}\n"
    assert old in text, "write_config's scheduling line moved"
    gateway_yaml.write_text(text.replace(old, f"  scheduling: {document}\n"))


@contextlib.contextmanager
def simulator(work: Path) -> Iterator[int]:
    (port,) = free_ports(1)
    (work / "sim.yaml").write_text("defaults: {max_model_len: 100000}\n")
    cmd = [sys.executable, "-m", "poolkeeper", "sim", "--count", "1", "--port", str(port),
           "--model", MODEL, "--time-scale", "0.001",
           "--config", str(work / "sim.yaml")]  # fmt: skip
    with procs.process(cmd, work / "sim.log"):
        yield port


async def measure(
    requests: int,
    batch: int,
    profile: bool,
    top: int,
    prompt_bytes: int = 0,
    gap_s: float = 0.0,
    scheduling: str = "default",
    profile_out: str = "",
    chunk_bytes: int = 0,
) -> dict[str, Any]:
    with (
        tempfile.TemporaryDirectory(prefix="route-profile-") as tmp,
        simulator(Path(tmp)) as sim_port,
    ):
        (config := Path(tmp) / "config").mkdir()
        write_config(config, sim_port, free_ports(5), observe_responses=True)
        if scheduling != "default":
            _use_scheduling(config / "gateway.yaml", scheduling)
        runtime = GatewayRuntime(
            ServeOptions(source=file_source([config]), run_envoy=False, ready_wait_s=30)
        )
        await runtime.start()
        try:
            if not runtime.ready():
                raise RuntimeError("the simulator's metrics never arrived: not ready")
            driver = Driver(runtime, sim_port, batch, prompt_bytes, chunk_bytes)
            # Warm-up: caches, the prefix index, first-use imports.
            await driver.run(min(500, max(20, requests // 5)))
            driver.times = {k: [] for k in driver.times}
            began = time.thread_time_ns()
            await driver.run(requests, gap_s)
            # Everything the loop thread ran, per request: the streams, the samples deferred
            # after them, the access log, the scrapes in the gaps, the driver's own work.
            whole = (time.thread_time_ns() - began) / requests / 1000
            result: dict[str, Any] = {"cpu": _summary(driver.times), "loop_us": whole}
            if profile:
                profiler = cProfile.Profile(time.thread_time)
                profiler.enable()
                await driver.run(requests, gap_s)
                profiler.disable()
                text = io.StringIO()
                stats = pstats.Stats(profiler, stream=text)
                if profile_out:
                    stats.dump_stats(profile_out)
                stats.sort_stats("tottime").print_stats(top)
                stats.sort_stats("cumulative").print_stats(top)
                result["profile"] = text.getvalue()
            return result
        finally:
            await runtime.stop(grace_s=0)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=3000, help="measured requests")
    parser.add_argument("--batch", type=int, default=16, help="access-log entries per flush")
    parser.add_argument("--profile", action="store_true", help="also a cProfile pass")
    parser.add_argument("--top", type=int, default=40, help="functions listed per profile")
    parser.add_argument("--json", action="store_true", help="print the result as JSON")
    parser.add_argument(
        "--gap-ms", type=float, default=0.0, help="idle ms between requests (100: 10/s)"
    )
    parser.add_argument(
        "--prompt-bytes", type=int, default=0, help="a user message of this many bytes"
    )
    parser.add_argument(
        "--chunk-bytes",
        type=int,
        default=0,
        help="the body in messages of this many bytes (serve's Envoy: 262144); 0: one",
    )
    parser.add_argument(
        "--scheduling",
        default="default",
        help="a preset or a default candidate of scheduling/candidate_presets.py "
        "(default: default)",
    )
    parser.add_argument("--profile-out", default="", help="with --profile: pstats dump file")
    parser.add_argument(
        "--glibc-heap-default",
        action="store_true",
        help="leave glibc's allocator as it is (serve tunes it: extproc/heap.py)",
    )
    args = parser.parse_args(argv)
    if not args.glibc_heap_default:
        keep_freed_pages()
    if not 1 <= args.requests <= 1_000_000 or not 1 <= args.batch <= 1000:
        parser.error("--requests must be in [1, 1000000] and --batch in [1, 1000]")
    runner: Callable[[Any], Any]
    try:
        import uvloop  # as `serve`

        runner = uvloop.run
    except ImportError:
        runner = asyncio.run
    if not 0 <= args.prompt_bytes <= 8 << 20:
        parser.error("--prompt-bytes must be in [0, 8 MiB]")
    if not 0 <= args.chunk_bytes <= 8 << 20:
        parser.error("--chunk-bytes must be in [0, 8 MiB]")
    if not 0 <= args.gap_ms <= 10_000:
        parser.error("--gap-ms must be in [0, 10000]")
    result = runner(
        measure(args.requests, args.batch, args.profile, args.top, args.prompt_bytes,
                args.gap_ms / 1000, args.scheduling, args.profile_out, args.chunk_bytes)
    )  # fmt: skip
    if args.json:
        print(json.dumps(result, indent=1))
        return 0
    print("| part | requests | CPU p10 µs | median µs | p90 µs | mean µs |")
    print("|---|---|---|---|---|---|")
    for name, row in result["cpu"].items():
        print(f"| {name} | {row['n']:.0f} | {row['p10_us']:.0f} | {row['median_us']:.0f} "
              f"| {row['p90_us']:.0f} | {row['mean_us']:.0f} |")  # fmt: skip
    print(f"\nthe loop thread's CPU per request, all of it: {result['loop_us']:.0f} µs")
    if "profile" in result:
        print(result["profile"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
