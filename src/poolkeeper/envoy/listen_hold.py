"""Hold Envoy's listening sockets shut to new connections before they are closed (Linux).

Closing a listening socket makes the kernel reset every connection still in its accept queue:
the client's handshake had completed, it sent its request, and gets "connection reset" instead
of an answer or a refusal. A busy Envoy lets the queue grow between two accept passes, so a
stop under load cut such requests (the restart test under CPU load: 2 and 7 of ~250).

So before the stop closes the listeners, `hold_new_connections` attaches a socket filter to
each of Envoy's listening sockets for the port that drops new SYNs (a handshake already under
way completes). Envoy goes on accepting until the queue is empty (`waiting`), and only then are
the sockets closed; a dropped client's retransmitted SYN (1 s later) finds no listener and is
refused: nothing was sent. The sockets are reached through `pidfd_getfd` (Linux 5.6), which
needs the right to trace Envoy (the same user, Envoy being `serve`'s child); without it (or
elsewhere than Linux) nothing is held and the stop goes on as before.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import socket
import struct
from pathlib import Path

log = logging.getLogger("poolkeeper.envoy")

_SYS_PIDFD_GETFD = 438  # one number on every Linux architecture (the unified table)
_SO_ATTACH_FILTER = 26
_LISTEN, _SYN_RECV = "0A", "03"  # /proc/net/tcp states
# Classic BPF on the TCP header: a SYN without ACK (a new connection) is dropped, every
# other segment kept (the last ACK of a handshake under way, data of accepted connections).
_DROP_NEW_SYNS = (
    (0x30, 0, 0, 13),  # ldb [13]: the flags byte
    (0x45, 2, 0, 0x10),  # jset ACK -> keep
    (0x45, 0, 1, 0x02),  # jset SYN -> drop, else keep
    (0x06, 0, 0, 0),  # drop
    (0x06, 0, 0, 0xFFFFFFFF),  # keep
)


def _tcp_table(port: int) -> list[list[str]]:
    """The rows of the kernel's TCP tables that mention `port` (local or remote)."""
    rows: list[list[str]] = []
    mark = f":{port:04X} "
    for name in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(OSError):
            lines = Path(name).read_text().splitlines()[1:]
            rows.extend(line.split() for line in lines if mark in line)
    return rows


def _local_port(row: list[str]) -> int:
    return int(row[1].rpartition(":")[2], 16)


def waiting(port: int, inodes: set[int]) -> int:
    """Connections the held sockets still owe Envoy: queued for accept, or shaking hands."""
    count = 0
    for row in _tcp_table(port):
        if len(row) < 10 or _local_port(row) != port:
            continue
        if row[3] == _SYN_RECV:
            count += 1
        elif row[3] == _LISTEN and int(row[9]) in inodes:
            count += int(row[4].partition(":")[2], 16)  # rx_queue: the accept queue
    return count


def hold_new_connections(pid: int, port: int) -> set[int]:
    """Make process `pid`'s listening sockets on `port` drop new connections; the inodes of
    those held (empty when none could be: not Linux, no right to, no such socket)."""
    listening = {
        int(r[9])
        for r in _tcp_table(port)
        if len(r) >= 10 and r[3] == _LISTEN and _local_port(r) == port
    }
    if not listening or not hasattr(os, "pidfd_open"):
        return set()
    targets: dict[int, int] = {}  # Envoy's fd -> inode
    with contextlib.suppress(OSError), os.scandir(f"/proc/{pid}/fd") as entries:
        for entry in entries:
            try:
                link = os.readlink(entry.path)
            except OSError:  # closed since the listing: the others are still read
                continue
            if link.startswith("socket:[") and int(link[8:-1]) in listening:
                targets[int(entry.name)] = int(link[8:-1])
    held: set[int] = set()
    if not targets:
        return held
    code = ctypes.create_string_buffer(b"".join(struct.pack("HBBI", *i) for i in _DROP_NEW_SYNS))
    program = struct.pack("HP", len(_DROP_NEW_SYNS), ctypes.addressof(code))
    libc = ctypes.CDLL(None, use_errno=True)
    try:
        pidfd = os.pidfd_open(pid)
    except OSError as exc:
        log.info("listening sockets not held (%s): queued connections may be reset", exc)
        return held
    try:
        for target, inode in targets.items():
            copy = libc.syscall(_SYS_PIDFD_GETFD, pidfd, target, 0)
            if copy < 0:
                log.info(
                    "listening socket not held (%s): queued connections may be reset",
                    os.strerror(ctypes.get_errno()),
                )
                continue
            # Closing this copy leaves Envoy's socket open: it is one more descriptor of it.
            with socket.socket(fileno=copy) as sock:
                sock.setsockopt(socket.SOL_SOCKET, _SO_ATTACH_FILTER, program)
            held.add(inode)
    except OSError as exc:
        log.info("listening sockets not held (%s): queued connections may be reset", exc)
    finally:
        os.close(pidfd)
    return held
