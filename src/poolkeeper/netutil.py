"""Finding free TCP ports on the loopback interface (demo, benchmarks, tests).

A port found free can be taken by someone else before it is bound again; callers that start a
server on it accept that small race (the server's bind then fails loudly).
"""

from __future__ import annotations

import socket

LOOPBACK = "127.0.0.1"


def free_ports(count: int, *, consecutive: bool = False, host: str = LOOPBACK) -> list[int]:
    """`count` ports free right now; with `consecutive`, a run of adjacent ports
    (what `poolkeeper sim --count N --port P` needs)."""
    if not consecutive:
        held: list[socket.socket] = []
        try:
            for _ in range(count):
                sock = socket.socket()
                held.append(sock)
                sock.bind((host, 0))
            return [int(s.getsockname()[1]) for s in held]
        finally:
            for sock in held:
                sock.close()
    for _ in range(200):
        first = free_ports(1, host=host)[0]
        if first + count > 65535:
            continue
        if all(_is_free(port, host) for port in range(first + 1, first + count)):
            return list(range(first, first + count))
    raise OSError(f"no run of {count} free ports on {host}")


def free_port(host: str = LOOPBACK) -> int:
    return free_ports(1, host=host)[0]


def _is_free(port: int, host: str) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True
