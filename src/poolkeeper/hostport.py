"""`host:port` strings, IPv6 included: the one place they are formed and taken apart.

An IPv6 address is bracketed (`[fd00::5]:20100`), as RFC 3986 and Envoy's original-destination
header expect; `fd00::5:20100` would be read as a longer address with no port. Everything
that turns an endpoint into `ip:port` (the destination header, Envoy's endpoints, the access
log's served address, metrics URLs) goes through `join_hostport`, and everything that reads one
back through `split_hostport` or `host_of`.
"""

from __future__ import annotations

__all__ = ["host_of", "join_hostport", "split_hostport"]


def join_hostport(host: str, port: int) -> str:
    """`host:port`, with an IPv6 host bracketed (an already bracketed one is left as is)."""
    if ":" in host and not host.startswith("["):
        return f"[{host}]:{port}"
    return f"{host}:{port}"


def split_hostport(value: str) -> tuple[str, int]:
    """(host, port) of `host:port` or `[v6]:port`, the host unbracketed; ValueError otherwise."""
    if value.startswith("["):
        host, sep, rest = value[1:].partition("]")
        port = rest[1:] if rest.startswith(":") else ""
        if not sep or not host:
            raise ValueError(f"endpoint {value!r}: expected [ipv6]:port")
    else:
        host, _, port = value.rpartition(":")
        if ":" in host:
            raise ValueError(f"endpoint {value!r}: an IPv6 address needs brackets: [ip]:port")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"endpoint {value!r}: expected ip:port")
    return host, int(port)


def host_of(value: str) -> str:
    """The host of `host:port`, `[v6]:port`, a bare IPv4 or a bare IPv6 address."""
    if value.startswith("["):
        return value[1:].partition("]")[0]
    if value.count(":") == 1:
        return value.rpartition(":")[0]
    return value  # no port: a bare address (IPv6 has several colons and no brackets)
