"""The lean transport's own CPU per ext_proc stream, without Envoy or a socket (a profiling script).

One `Connection` of the lean transport (`extproc/h2/`) is fed, in this process, the bytes Envoy
sends for a chat completion's ext_proc stream: a HEADERS frame whose HPACK block is the one
Envoy repeats on every stream once its dynamic table holds the rest (`:path` a literal without
indexing), a DATA frame with the request-headers message and DATA frames of 16 KiB carrying
the body message. The handler is `--floor`'s do-nothing processor
(`bench/overhead/overhead_floor.py`: it answers with one route header and passes the body
back), so what is measured is the transport plus protobuf, not the EPP. Its replies go to a
fake socket that counts bytes.

Reported: thread CPU per stream (`time.thread_time_ns`), median and mean over `--streams`,
for each `--body-bytes` (the JSON body's size: 1 KiB is a small chat request, 1 MiB the large
prompt of the acceptance benchmark). With `--profile`, cProfile's top functions.

Not a test: run it by hand.

    .venv/bin/python scripts/transport_profile.py [--body-bytes 1024,1048576] [--profile]
        [--gap-ms 100]

`--gap-ms 100` idles between streams as the light-load benchmark does (10 per second): the
same code then runs on the caches other processes left behind.
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import io
import json
import pstats
import statistics
import time
from typing import Any

import hpack
from envoy.config.core.v3 import base_pb2
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2 as pm
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

from poolkeeper.bench.overhead.overhead_floor import MinimalProcessor
from poolkeeper.bench.overhead.overhead_gateway import body_of
from poolkeeper.extproc.h2 import frames as f
from poolkeeper.extproc.h2.connection import Connection
from poolkeeper.extproc.h2.limits import Limits, TransportStats
from poolkeeper.extproc.h2.rpc import bidi, envelope
from poolkeeper.extproc.h2.shared import Shared
from poolkeeper.extproc.heap import keep_freed_pages
from poolkeeper.extproc.lean import PROCESS_PATH

FRAME = 16_384  # Envoy's DATA frames towards the EPP


class CountingTransport:
    """The socket: counts what is written."""

    def __init__(self) -> None:
        self.written = 0

    def write(self, data: bytes) -> None:
        self.written += len(data)

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return default

    def get_write_buffer_size(self) -> int:
        return 0

    def is_closing(self) -> bool:
        return False

    def abort(self) -> None:
        pass

    def close(self) -> None:
        pass


def stream_bytes(encoder: hpack.Encoder, stream_id: int, body: bytes) -> bytes:
    """One ext_proc stream as Envoy sends it (HEADERS, headers message, body message)."""
    block = encoder.encode([
        (":method", "POST"), (":scheme", "http"),
        hpack.NeverIndexedHeaderTuple(":path", PROCESS_PATH), (":authority", "epp"),
        ("te", "trailers"), ("content-type", "application/grpc"),
        ("x-envoy-internal", "true"), ("x-forwarded-for", "192.0.2.2"),
    ])  # fmt: skip
    headers = pb.ProcessingRequest(
        request_headers=pb.HttpHeaders(
            headers=base_pb2.HeaderMap(
                headers=[
                    base_pb2.HeaderValue(key=k, raw_value=v.encode())
                    for k, v in {
                        ":method": "POST", ":path": "/v1/chat/completions",
                        ":authority": "127.0.0.1:8080", "content-type": "application/json",
                        "content-length": str(len(body)), "x-request-id": f"req-{stream_id}",
                    }.items()
                ]
            )
        )
    )  # fmt: skip
    headers.protocol_config.request_body_mode = pm.ProcessingMode.FULL_DUPLEX_STREAMED
    message = envelope(
        pb.ProcessingRequest(
            request_body=pb.HttpBody(body=body, end_of_stream=True)
        ).SerializeToString()
    )
    out = [
        f.frame(f.HEADERS, f.END_HEADERS, stream_id, block),
        f.frame(f.DATA, 0, stream_id, envelope(headers.SerializeToString())),
    ]
    for at in range(0, len(message), FRAME):
        last = at + FRAME >= len(message)
        out.append(
            f.frame(f.DATA, f.END_STREAM if last else 0, stream_id, message[at : at + FRAME])
        )
    return b"".join(out)


async def measure(
    body_bytes: int, streams: int, profile: bool, gap_s: float = 0.0
) -> dict[str, Any]:
    processor = MinimalProcessor()
    method = bidi(
        processor.Process, pb.ProcessingRequest.FromString, pb.ProcessingResponse.SerializeToString
    )
    shared = Shared(
        methods={PROCESS_PATH.encode(): method}, limits=Limits(), stats=TransportStats()
    )
    connection = Connection(shared)
    transport = CountingTransport()
    connection.connection_made(transport)  # type: ignore[arg-type]
    big = (1 << 31) - 1
    connection.data_received(
        f.PREFACE + f.settings({f.INITIAL_WINDOW_SIZE: big}) + f.window_update(0, big - 65_535)
    )
    encoder = hpack.Encoder()
    body = json.dumps(body_of(max(1, body_bytes - 90))).encode()
    times: list[int] = []
    profiler = cProfile.Profile(time.thread_time) if profile else None
    next_id = 1

    async def one(record: bool) -> None:
        nonlocal next_id
        data = stream_bytes(encoder, next_id, body)
        next_id += 2
        began = time.thread_time_ns()
        connection.data_received(data)
        # The handler runs on this loop; yielding until it is done keeps the connection's
        # internals out of this script (no event to wait for from outside).
        while connection.active:  # noqa: ASYNC110
            await asyncio.sleep(0)
        if record:
            times.append(time.thread_time_ns() - began)
            if gap_s:  # idle as light load does: the next stream runs on colder caches
                await asyncio.sleep(gap_s)

    for _ in range(min(200, streams)):
        await one(False)
    if profiler is not None:
        profiler.enable()
    for _ in range(streams):
        await one(True)
    if profiler is not None:
        profiler.disable()
    connection.connection_lost(None)
    result: dict[str, Any] = {
        "body_bytes": len(body),
        "median_us": statistics.median(times) / 1000,
        "mean_us": statistics.fmean(times) / 1000,
        "written_per_stream": transport.written / (streams + min(200, streams)),
    }
    if profiler is not None:
        text = io.StringIO()
        pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(25)
        result["profile"] = text.getvalue()
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--body-bytes", default="1024,1048576", help="JSON body sizes")
    parser.add_argument(
        "--streams", type=int, default=0, help="streams per size (default: by size)"
    )
    parser.add_argument("--profile", action="store_true", help="cProfile the measured streams")
    parser.add_argument(
        "--gap-ms", type=float, default=0.0, help="idle ms between streams (100: 10/s)"
    )
    parser.add_argument(
        "--glibc-heap-default",
        action="store_true",
        help="leave glibc's allocator as it is (serve tunes it: extproc/heap.py)",
    )
    args = parser.parse_args(argv)
    if not args.glibc_heap_default:
        keep_freed_pages()
    sizes = [int(b) for b in args.body_bytes.split(",") if b]
    if any(not 100 <= b <= 8 << 20 for b in sizes) or not 0 <= args.streams <= 1_000_000:
        parser.error("--body-bytes must be in [100, 8 MiB], --streams in [0, 1000000]")
    if not 0 <= args.gap_ms <= 10_000:
        parser.error("--gap-ms must be in [0, 10000]")
    try:
        import uvloop  # as `serve`

        run: Any = uvloop.run
    except ImportError:
        run = asyncio.run
    print("| body bytes | streams | CPU median µs | mean µs |")
    print("|---|---|---|---|")
    profiles = []
    for size in sizes:
        streams = args.streams or max(20, min(3000, (3 << 20) // size))
        row = run(measure(size, streams, args.profile, args.gap_ms / 1000))
        print(f"| {row['body_bytes']:,} | {streams} | {row['median_us']:.0f} "
              f"| {row['mean_us']:.0f} |")  # fmt: skip
        if "profile" in row:
            profiles.append(row["profile"])
    for text in profiles:
        print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
