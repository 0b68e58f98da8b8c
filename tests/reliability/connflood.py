"""An attacker process for the connection tests: opens COUNT TCP connections to 127.0.0.1:PORT
that never send a byte, from loopback source addresses 127.0.0.FIRST .. FIRST+SOURCES-1 (bound
before connect, so no one address runs out of ephemeral ports), and holds them.

Its own process because each process has its own descriptor limit (20,000 hard on this
project's machine): 25,000 connections are spread over several of these. Stdlib only (it
starts in tens of milliseconds). Protocol on stdout: `opened N` once every connect was
completed (N: those that connected; a SYN the kernel dropped is retried by the kernel, so this
can take seconds); then, when stdin closes, `closed_by_peer M` (how many the gateway closed)
and exit.

    python -m tests.reliability.connflood PORT COUNT FIRST SOURCES
"""

from __future__ import annotations

import errno
import resource
import select
import socket
import sys
import time


def open_silent(port: int, count: int, first: int, sources: int) -> list[socket.socket]:
    """Start `count` non-blocking connects (the kernel finishes the handshakes, retrying a
    dropped SYN itself): an attacker that opens as fast as it can, never waiting."""
    socks: list[socket.socket] = []
    for i in range(count):
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setblocking(False)
        try:
            sock.bind((f"127.0.0.{first + i % sources}", 0))
            err = sock.connect_ex(("127.0.0.1", port))
        except OSError:
            sock.close()
            continue
        if err not in (0, errno.EINPROGRESS):
            sock.close()
            continue
        socks.append(sock)
    return socks


def wait_connected(socks: list[socket.socket], within_s: float) -> int:
    """Wait until every connect has completed or failed (at most `within_s`); how many
    connected."""
    poller = select.poll()
    pending = {sock.fileno(): sock for sock in socks}
    for fd in pending:
        poller.register(fd, select.POLLOUT)
    connected = 0
    deadline = time.monotonic() + within_s
    while pending and time.monotonic() < deadline:
        for fd, _ in poller.poll(200):
            poller.unregister(fd)
            sock = pending.pop(fd)
            connected += sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR) == 0
    return connected


def closed_by_peer(socks: list[socket.socket]) -> int:
    """How many of `socks` the other side closed (readable with EOF, or in error)."""
    poller = select.poll()
    for sock in socks:
        poller.register(sock.fileno(), select.POLLIN | select.POLLERR | select.POLLHUP)
    return sum(1 for _ in poller.poll(0))


def main(argv: list[str]) -> int:
    port, count, first, sources = (int(arg) for arg in argv)
    _soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    socks = open_silent(port, count, first, sources)
    print(f"opened {wait_connected(socks, 60.0)}", flush=True)
    sys.stdin.read()  # hold until the test lets go
    print(f"closed_by_peer {closed_by_peer(socks)}", flush=True)
    for sock in socks:
        sock.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
