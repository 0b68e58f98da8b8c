"""Holding a child's listening socket: new connections are dropped (then refused once it
closes), the ones already queued stay queued until the child accepts them."""

from __future__ import annotations

import errno
import os
import select
import socket
import subprocess
import sys
from collections.abc import Iterator

import pytest

from poolkeeper.envoy.listen_hold import hold_new_connections, waiting

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(not sys.platform.startswith("linux"), reason="pidfd_getfd, /proc"),
]

# Listens without accepting until told to; then accepts one connection and echoes its bytes.
_CHILD = """
import socket, sys
s = socket.socket()
s.bind(("127.0.0.1", 0))
s.listen(16)
print(s.getsockname()[1], flush=True)
sys.stdin.readline()
conn, _ = s.accept()
print(conn.recv(100).decode(), flush=True)
sys.stdin.readline()
"""


@pytest.fixture
def child() -> Iterator[tuple[subprocess.Popen[str], int]]:
    with subprocess.Popen(
        [sys.executable, "-c", _CHILD], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    ) as proc:
        assert proc.stdout is not None
        try:
            yield proc, int(proc.stdout.readline())
        finally:
            proc.kill()


def test_a_held_listener_keeps_its_queue_and_drops_new_connections(
    child: tuple[subprocess.Popen[str], int],
) -> None:
    proc, port = child
    assert proc.stdin is not None
    assert proc.stdout is not None
    with socket.create_connection(("127.0.0.1", port)) as queued:
        queued.sendall(b"hello")
        held = hold_new_connections(proc.pid, port)
        assert len(held) == 1
        assert waiting(port, held) == 1  # the queued connection, not accepted yet
        late = socket.socket()
        late.setblocking(False)
        assert late.connect_ex(("127.0.0.1", port)) == errno.EINPROGRESS
        assert waiting(port, held) == 1  # the late SYN was dropped: neither queued nor shaking
        assert select.select([], [late], [], 0)[1] == []
        proc.stdin.write("accept\n")
        proc.stdin.flush()
        assert proc.stdout.readline().strip() == "hello"  # the queued request got through
        assert waiting(port, held) == 0
        proc.kill()
        proc.wait()
        # The late client's retransmitted SYN finds no listener: refused, nothing was sent.
        assert select.select([], [late], [], 10)[1] == [late]
        assert late.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR) == errno.ECONNREFUSED
        late.close()


def test_nothing_is_held_without_a_listening_socket_of_the_process() -> None:
    with socket.socket() as other:  # listening, but not the process's own socket
        other.bind(("127.0.0.1", 0))
        other.listen()
        port = other.getsockname()[1]
        with subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"]) as proc:
            try:
                assert hold_new_connections(proc.pid, port) == set()
            finally:
                proc.kill()


def test_an_fd_closed_while_the_table_is_read_does_not_stop_the_others(
    child: tuple[subprocess.Popen[str], int], monkeypatch: pytest.MonkeyPatch
) -> None:
    # A process starting up opens and closes fds while /proc/PID/fd is listed: an entry gone
    # by its readlink is skipped, the listing goes on (and its iterator is closed: an
    # unclosed one is a ResourceWarning, an error under this suite's warning filter).
    proc, port = child
    real = os.readlink
    failed: list[str] = []

    def readlink(path: str) -> str:
        if not failed:
            failed.append(path)
            raise FileNotFoundError(errno.ENOENT, "No such file or directory", path)
        return real(path)

    monkeypatch.setattr(os, "readlink", readlink)
    held = hold_new_connections(proc.pid, port)
    assert failed  # the first entry failed ...
    assert len(held) == 1  # ... and the listening socket was still found
