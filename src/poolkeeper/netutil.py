"""Finding free TCP ports on the loopback interface (demo, benchmarks, tests).

Ports are drawn at random from *below* the kernel's ephemeral range
(`/proc/sys/net/ipv4/ip_local_port_range`, 32768-60999 by default on Linux). A port the kernel
hands out for `bind(0)` comes from that range, which is also where every outgoing connection
(Envoy to the EPP, a client to Envoy) takes its local port: between the check and the server's
own bind, such a connection could take the port, and the server failed with "Address already in
use" (seen in CI). Below the range only servers bind, so what remains is the race between two
programs picking the same random port at the same moment; the server's bind then fails loudly.
"""

from __future__ import annotations

import random
import socket
from pathlib import Path

LOOPBACK = "127.0.0.1"
_EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")
_DEFAULT_EPHEMERAL = (32768, 60999)
_LOWEST = 10_000  # leave the well-known and commonly configured ports alone
_ATTEMPTS = 2_000


def ephemeral_range() -> tuple[int, int]:
    """The kernel's ephemeral port range (Linux's default where it cannot be read)."""
    try:
        low, high = (int(v) for v in _EPHEMERAL_RANGE.read_text().split())
    except (OSError, ValueError):
        return _DEFAULT_EPHEMERAL
    return low, high


def _pool() -> range:
    """Ports to draw from: below the ephemeral range, else above it if that is roomier."""
    low, high = ephemeral_range()
    below = range(_LOWEST, low)
    above = range(high + 1, 65536)
    return below if len(below) >= len(above) else above


def free_ports(count: int, *, consecutive: bool = False, host: str = LOOPBACK) -> list[int]:
    """`count` distinct ports free right now; with `consecutive`, a run of adjacent ports
    (what `poolkeeper sim --count N --port P` needs)."""
    pool = _pool()
    if count < 1 or count > len(pool):
        raise ValueError(f"cannot pick {count} ports from {pool.start}-{pool.stop - 1}")
    pick = random.SystemRandom()
    chosen: list[int] = []
    for _ in range(_ATTEMPTS):
        if consecutive:
            first = pick.randrange(pool.start, pool.stop - count + 1)
            run = list(range(first, first + count))
            if all(_is_free(port, host) for port in run):
                return run
            continue
        port = pick.randrange(pool.start, pool.stop)
        if port not in chosen and _is_free(port, host):
            chosen.append(port)
            if len(chosen) == count:
                return chosen
    raise OSError(f"no {count} free ports on {host} in {pool.start}-{pool.stop - 1}")


def free_port(host: str = LOOPBACK) -> int:
    return free_ports(1, host=host)[0]


def _is_free(port: int, host: str) -> bool:
    # No SO_REUSEADDR: a port held by a listener or lingering in TIME_WAIT is not free.
    with socket.socket() as sock:
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True
