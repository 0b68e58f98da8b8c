"""Which TCP connections on this host are open, asked of the kernel (Linux sock_diag).

The connection counter (extproc/conncap.py) learns of a connection's first bytes and of its
close on two gRPC streams, so in one case it cannot tell from their order alone whether a
check belongs to a connection that already closed or to a new one from the same address and
port. The kernel can: Envoy's end of the connection is on this host (Envoy is `serve`'s child,
in its network namespace), and one netlink request looks it up by its four-tuple, as `ss` does.
It also lists the open connections on Envoy's listener port that have sent bytes
(`peers_that_sent`): the counter's reconciliation, for connections Envoy let in when their
check timed out (extproc/conncap_service.py).
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


_NLM_F_DUMP = 0x300
_NLMSG_DONE = 3
_INET_DIAG_INFO = 2  # the attribute that carries struct tcp_info
_BYTES_RECEIVED_AT = 128  # tcp_info.tcpi_bytes_received (u64), Linux 4.1 and later
_DUMP_STATES = (1 << 1) | (1 << 8)  # ESTABLISHED, CLOSE_WAIT: open as far as Envoy is concerned
_INET_DIAG_REQ_BYTECODE = 1
_BC_S_GE, _BC_S_LE = 2, 3  # the filter's "local port at least" and "at most"


def _dump(family: int, local_port: int) -> bytes:
    body = struct.pack("=BBBxI", family, socket.IPPROTO_TCP, 1 << (_INET_DIAG_INFO - 1), 0)
    body = body[:4] + struct.pack("=I", _DUMP_STATES) + b"\0" * 48  # an empty socket id
    # The kernel keeps only sockets whose port here is `local_port` (local port >= it and
    # <= it; a failed test jumps 4 bytes past the end: rejected), so a host with thousands
    # of other connections costs no parsing here.
    code = struct.pack("=BBH", _BC_S_GE, 8, 20) + struct.pack("=BBH", 0, 0, local_port)
    code += struct.pack("=BBH", _BC_S_LE, 8, 12) + struct.pack("=BBH", 0, 0, local_port)
    body += struct.pack("=HH", 4 + len(code), _INET_DIAG_REQ_BYTECODE) + code
    flags = _NLM_F_REQUEST | _NLM_F_DUMP
    return struct.pack("=IHHII", 16 + len(body), _SOCK_DIAG_BY_FAMILY, flags, 1, 0) + body


def _peer(family: int, raw: bytes) -> str:
    if family == socket.AF_INET:
        return socket.inet_ntop(socket.AF_INET, raw[:4])
    address = ipaddress.IPv6Address(raw[:16])
    mapped = address.ipv4_mapped  # a dual-stack listener's IPv4 client, as Envoy names it
    return str(mapped) if mapped is not None else str(address)


def _received(message: bytes, start: int, end: int) -> int | None:
    """tcpi_bytes_received from the attributes of one inet_diag_msg (None: not there)."""
    at = start + 72  # past struct inet_diag_msg
    while at + 4 <= end:
        length, kind = struct.unpack_from("=HH", message, at)
        if length < 4:
            return None
        if kind == _INET_DIAG_INFO and length - 4 >= _BYTES_RECEIVED_AT + 8:
            received: int = struct.unpack_from("=Q", message, at + 4 + _BYTES_RECEIVED_AT)[0]
            return received
        at += (length + 3) & ~3
    return None


def peers_that_sent(local_port: int) -> set[tuple[str, int]] | None:
    """The peers (address, port) of this host's open TCP connections whose end here is on
    `local_port` (Envoy's listener) and that have received bytes; None when the kernel cannot
    be asked or answered in part (not Linux, not allowed, a reply cut short)."""
    if not hasattr(socket, "AF_NETLINK"):
        return None
    peers: set[tuple[str, int]] = set()
    for family in (socket.AF_INET, socket.AF_INET6):
        try:
            with socket.socket(socket.AF_NETLINK, socket.SOCK_DGRAM, _NETLINK_SOCK_DIAG) as sock:
                sock.settimeout(1.0)
                sock.send(_dump(family, local_port))
                if not _read_dump(sock, local_port, peers):
                    return None
        except OSError:
            return None
    return peers


def _read_dump(sock: socket.socket, local_port: int, peers: set[tuple[str, int]]) -> bool:
    """Read one dump to its end into `peers`; False if it ended in an error or a connection's
    bytes received were not given (a kernel before 4.1): a list without them would make the
    counter forget every connection it holds."""
    while True:
        reply = sock.recv(1 << 16)
        at = 0
        while at + 16 <= len(reply):
            length, kind = struct.unpack_from("=IH", reply, at)
            if length < 16:
                return False
            if kind == _NLMSG_DONE:
                return True
            if kind == _NLMSG_ERROR:
                return False
            message = at + 16
            if kind == _SOCK_DIAG_BY_FAMILY and length >= 16 + 72:
                here, there = struct.unpack_from("!HH", reply, message + 4)
                if here == local_port:
                    received = _received(reply, message, at + length)
                    if received is None:
                        return False
                    if received:
                        family = reply[message]
                        peers.add((_peer(family, reply[message + 24 : message + 40]), there))
            at += (length + 3) & ~3
