"""What the exact prefix index and its live feed cost in memory (`replicas.py --memory`).

`memory` measures (tracemalloc) the exact index after `blocks` engine-reported blocks were
stored on each of `endpoints` endpoints and none removed (each block on one endpoint, the common
case), and the approximate index with the same entries: bytes per (endpoint, block) entry held
and per 1,000 endpoints. The exact index keeps at most `cap` blocks per endpoint
(`kvIndexMaxBlocksPerEndpoint`; None: no bound). Past the bound the figure includes what the
churn leaves: dict tables sized for the blocks that came and went.

`subscriber_memory` (`--subscribers`) measures what the index's feed costs live: the resident
memory (VmRSS) a `KVEventSubscriber` adds by following `endpoints` engines (one ZMQ SUB socket
and task each), against publishers in a child process that each send one
batch (checked: every subscription receives it).
"""

from __future__ import annotations

import random
from typing import Any

from poolkeeper.scheduling.exact_prefix import ExactPrefixIndex

_NO_BOUND = 1 << 62


def memory(endpoints: int, blocks: int, chain: int = 128, cap: int | None = None) -> dict[str, Any]:
    """Traced bytes of the exact and the approximate index after `blocks` stores per
    endpoint, the exact one reported as chains of `chain` blocks (each chain's first block a
    head, which `coldAffinityBalance` counts: 128 blocks = a 2,048-token prompt; 1 = the worst
    case) and bounded by `cap` blocks per endpoint."""
    import tracemalloc

    from poolkeeper.scheduling.prefix import PrefixIndex

    rng = random.Random(1)
    if chain < 1:
        raise ValueError("chain must be >= 1")
    out: dict[str, Any] = {
        "endpoints": endpoints,
        "blocks_per_endpoint": blocks,
        "chain": chain,
        "cap": cap,
    }
    for kind in ("exact", "approx"):
        tracemalloc.start()
        before = tracemalloc.get_traced_memory()[0]
        exact = ExactPrefixIndex(max_blocks_per_endpoint=_NO_BOUND if cap is None else cap)
        approx = PrefixIndex(blocks)
        for i in range(endpoints):
            key = f"10.0.{i // 250}.{i % 250 + 1}:8000"
            hashes = [rng.getrandbits(64) for _ in range(blocks)]
            if kind == "exact":
                for start in range(0, blocks, chain):
                    exact.stored(key, hashes[start : start + chain], 0.0, head=True)
            else:
                approx.insert(key, hashes)
        used = tracemalloc.get_traced_memory()[0] - before
        tracemalloc.stop()
        entries = exact.size if kind == "exact" else approx.size
        if kind == "exact":
            out["exact_blocks_held_per_endpoint"] = entries // endpoints
        out[f"{kind}_bytes_per_entry"] = round(used / entries, 1)
        out[f"{kind}_mib_per_1000_endpoints"] = round(used / endpoints * 1000 / 2**20, 1)
        del exact, approx
    return out


_PUBLISHERS = """
import sys, zmq
from poolkeeper.kvevents import BlockStored, KVEventBatch, encode
ctx = zmq.Context()
socks = [ctx.socket(zmq.PUB) for _ in range(int(sys.argv[1]))]
print(" ".join(str(s.bind_to_random_port("tcp://127.0.0.1")) for s in socks), flush=True)
sys.stdin.readline()
payload = encode(KVEventBatch(0.0, [BlockStored([1, 2, 3], None, [], 16, None, "GPU")], 0))
for s in socks:
    s.send_multipart([b"kv", bytes(8), payload])
print("sent", flush=True)
sys.stdin.readline()
"""


def _rss_kib() -> int:
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    raise OSError("no VmRSS in /proc/self/status")


def subscriber_memory(endpoints: int, settle_s: float = 2.0) -> dict[str, Any]:
    """Resident KiB a KV-event subscriber adds by following `endpoints` live publishers."""
    import asyncio
    import subprocess
    import sys

    from poolkeeper.scheduling.kvsubscriber import KVEventSubscriber

    async def measure(ports: list[str], child: subprocess.Popen[str]) -> dict[str, Any]:
        assert child.stdin is not None
        assert child.stdout is not None
        addresses = {
            f"10.0.{i // 250}.{i % 250 + 1}:8000": f"tcp://127.0.0.1:{p}"
            for i, p in enumerate(ports)
        }
        subscriber = KVEventSubscriber(ExactPrefixIndex(), addresses.__getitem__)
        await asyncio.sleep(0.2)
        before = _rss_kib()
        subscriber.follow(addresses)
        await asyncio.sleep(settle_s)  # connected (ZMQ drops what a PUB sends before that)
        child.stdin.write("\n")
        child.stdin.flush()
        child.stdout.readline()
        await asyncio.sleep(settle_s)
        used = _rss_kib() - before
        received = subscriber.received
        await subscriber.close()
        return {
            "endpoints": endpoints,
            "batches_received": received,
            "subscriber_kib_per_endpoint": round(used / endpoints, 1),
            "subscriber_mib_per_1000_endpoints": round(used / endpoints * 1000 / 1024, 1),
        }

    with subprocess.Popen(
        [sys.executable, "-c", _PUBLISHERS, str(endpoints)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    ) as child:  # fmt: skip
        assert child.stdout is not None
        assert child.stdin is not None
        try:
            return asyncio.run(measure(child.stdout.readline().split(), child))
        finally:
            child.stdin.close()
            child.wait(timeout=10)
