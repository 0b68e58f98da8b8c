"""Whether one TCP connection on this host is still open, asked of the kernel (Linux sock_diag).

The connection counter (extproc/conncap.py) learns of a connection's first bytes and of its
close on two gRPC streams, so in one case it cannot tell from their order alone whether a
check belongs to a connection that already closed or to a new one from the same address and
port. The kernel can: Envoy's end of the connection is on this host (Envoy is `serve`'s child,
in its network namespace), and one netlink request looks it up by its four-tuple, as `ss` does.
"""

from __future__ import annotations

import errno
import ipaddress
import socket
import struct

_NETLINK_SOCK_DIAG = 4
_SOCK_DIAG_BY_FAMILY = 20
_NLM_F_REQUEST = 1
_NLMSG_ERROR = 2
_NOCOOKIE = 0xFFFFFFFF
# Envoy's end, still open as far as Envoy is concerned: established, or the client has sent
# its FIN and Envoy has not closed yet (its close is still to be reported). Anything else
# (Envoy closed it: FIN_WAIT, TIME_WAIT, LAST_ACK, ...; or a listening socket, which the
# kernel's lookup falls back to when no connection matches) is not this connection alive.
_OPEN_STATES = frozenset({1, 3, 8})  # ESTABLISHED, SYN_RECV, CLOSE_WAIT


def _request(family: int, local: tuple[bytes, int], remote: tuple[bytes, int]) -> bytes:
    states = 0xFFFFFFFF
    sockid = struct.pack("!HH", local[1], remote[1]) + local[0].ljust(16, b"\0")
    sockid += remote[0].ljust(16, b"\0") + struct.pack("=III", 0, _NOCOOKIE, _NOCOOKIE)
    body = struct.pack("=BBBxI", family, socket.IPPROTO_TCP, 0, states) + sockid
    header = struct.pack("=IHHII", 16 + len(body), _SOCK_DIAG_BY_FAMILY, _NLM_F_REQUEST, 1, 0)
    return header + body


def _ask(message: bytes) -> bool | None:
    with socket.socket(socket.AF_NETLINK, socket.SOCK_DGRAM, _NETLINK_SOCK_DIAG) as sock:
        sock.settimeout(1.0)
        sock.send(message)
        reply = sock.recv(8192)
    if len(reply) < 17:
        return None
    kind = struct.unpack_from("=H", reply, 4)[0]
    if kind == _NLMSG_ERROR:
        code = -struct.unpack_from("=i", reply, 16)[0]
        return False if code == errno.ENOENT else None
    if kind == _SOCK_DIAG_BY_FAMILY:
        return reply[17] in _OPEN_STATES  # inet_diag_msg: family, then state
    return None


def connection_open(local: tuple[str, int], remote: tuple[str, int]) -> bool | None:
    """Whether the TCP connection whose end on this host is `local` (address, port), with its
    peer at `remote`, is open; None when the kernel cannot be asked (not Linux, not allowed,
    an address that does not parse)."""
    if not hasattr(socket, "AF_NETLINK"):
        return None
    try:
        here, there = ipaddress.ip_address(local[0]), ipaddress.ip_address(remote[0])
    except ValueError:
        return None
    forms: list[tuple[int, bytes, bytes]] = []
    if here.version == there.version == 4:
        forms.append((socket.AF_INET, here.packed, there.packed))
        mapped = ipaddress.IPv6Address(b"\0" * 10 + b"\xff\xff" + here.packed)
        there6 = ipaddress.IPv6Address(b"\0" * 10 + b"\xff\xff" + there.packed)
        forms.append((socket.AF_INET6, mapped.packed, there6.packed))  # a dual-stack listener
    elif here.version == there.version == 6:
        forms.append((socket.AF_INET6, here.packed, there.packed))
    else:
        return None
    answer: bool | None = False
    for family, a, b in forms:
        try:
            found = _ask(_request(family, (a, local[1]), (b, remote[1])))
        except OSError:
            return None
        if found:
            return True
        if found is None:
            answer = None
    return answer
