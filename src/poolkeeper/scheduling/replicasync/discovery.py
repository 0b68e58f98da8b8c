"""Who the peers of this replica are: a static list and/or a DNS name, re-resolved.

Why both: outside Kubernetes (and in tests) the replicas are a fixed `host:port` list; in a
cluster they are the ready Pods behind the EPP's headless Service, whose A/AAAA records follow
the Deployment as it scales and rolls, so the name is resolved again every
`resolve_interval_s`. A name that does not resolve (a Service with no ready Pod yet, a DNS
hiccup) leaves the last answer in place: a replica keeps talking to the peers it knew rather
than to none.

Our own address is left out where it can be known: the addresses of our own host name and the
bind address, at our own port (a headless Service lists this Pod too); whatever still reaches
us is dropped by origin (`transport.py`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass

from poolkeeper.hostport import split_hostport

log = logging.getLogger("poolkeeper.replicasync")

Address = tuple[str, int]
Resolver = Callable[[str, int], Awaitable[list[str]]]  # host, port -> IP addresses
MAX_PEERS = 64  # more addresses than this are cut (sorted), with a warning


async def resolve(host: str, port: int) -> list[str]:
    """The IPv4 and IPv6 addresses of `host` (the loop's resolver; an IP stays itself)."""
    infos = await asyncio.get_running_loop().getaddrinfo(
        host, port, type=socket.SOCK_DGRAM, proto=socket.IPPROTO_UDP
    )
    return sorted({str(info[4][0]) for info in infos})


def check_name(host: str) -> str:
    """`host` if the resolver can take it (an IP, or a name whose labels IDNA encodes: 1-63
    characters each); ValueError otherwise (the resolver would raise UnicodeError)."""
    if _is_ip(host):
        return host
    try:
        host.encode("idna")
    except UnicodeError as exc:
        raise ValueError(f"{host!r} is not a valid DNS name ({exc})") from None
    return host


def parse_peers(text: str | Iterable[str]) -> tuple[Address, ...]:
    """`host:port,host:port` (or a list of them) as (host, port) pairs; ValueError naming the
    bad entry."""
    items = text.split(",") if isinstance(text, str) else list(text)
    pairs = tuple(split_hostport(item.strip()) for item in items if item.strip())
    for host, _ in pairs:
        check_name(host)
    return pairs


def reachable(peers: Iterable[Address], own: Address | None) -> set[Address]:
    """The peers a socket bound to `own` sends to: `own` left out, and those of the other
    address family (a name may resolve to both; an IPv6 socket reaches IPv4 peers through
    their mapped addresses, an IPv4 socket cannot reach IPv6 ones)."""
    v6 = own is not None and ":" in own[0]
    kept: set[Address] = set()
    for host, port in peers:
        if ":" not in host and v6:
            host = f"::ffff:{host}"
        elif ":" in host and not v6:
            continue
        if (host, port) != own:
            kept.add((host, port))
    return kept


@dataclass(slots=True)
class PeerDiscovery:
    """The peer addresses of `static` and `service` (each `host:port`), resolved."""

    static: Sequence[Address] = ()
    service: Address | None = None
    own: frozenset[Address] = frozenset()  # our own addresses, left out
    resolve_interval_s: float = 5.0
    resolver: Resolver = resolve
    _last: dict[Address, tuple[Address, ...]] | None = None

    async def peers(self) -> tuple[Address, ...]:
        """Every peer address now (each name resolved; a failing name keeps its last answer)."""
        if self._last is None:
            self._last = {}
        names = list(self.static) + ([self.service] if self.service is not None else [])
        found: set[Address] = set()
        for host, port in names:
            try:
                addresses = tuple((ip, port) for ip in await self.resolver(host, port))
            except (OSError, UnicodeError) as exc:  # (UnicodeError: a label IDNA refuses)
                log.warning("replica sync: cannot resolve %s: %s", host, exc)
                addresses = self._last.get((host, port), ())
            self._last[(host, port)] = addresses
            found.update(addresses)
        peers = sorted(found - self.own)
        if len(peers) > MAX_PEERS:
            log.warning("replica sync: %d peers, only the first %d used", len(peers), MAX_PEERS)
        return tuple(peers[:MAX_PEERS])

    async def follow(self, on_peers: Callable[[tuple[Address, ...]], None]) -> None:
        """Call `on_peers` with the peers now and after every change (until cancelled)."""
        current: tuple[Address, ...] | None = None
        while True:
            peers = await self.peers()
            if peers != current:
                log.info(
                    "replica sync peers: %s", ", ".join(f"{h}:{p}" for h, p in peers) or "none"
                )
                on_peers(peers)
                current = peers
            if self.service is None and all(_is_ip(h) for h, _ in self.static):
                return  # nothing can change: only addresses were given
            await asyncio.sleep(self.resolve_interval_s)


async def own_addresses(
    bind_host: str, port: int, resolver: Resolver = resolve
) -> frozenset[Address]:
    """Where peers would reach us: the bind address and our host name's addresses, at `port`
    (a wildcard bind adds the loopback addresses)."""
    hosts = {bind_host}
    if bind_host in ("0.0.0.0", "::", ""):
        hosts = {"127.0.0.1", "::1"}
    # (a host name that does not resolve: the transport's origin check is the backstop)
    with contextlib.suppress(OSError, UnicodeError):
        hosts.update(await resolver(socket.gethostname(), port))
    return frozenset((h, port) for h in hosts if h)


def _is_ip(host: str) -> bool:
    try:
        socket.inet_pton(socket.AF_INET6 if ":" in host else socket.AF_INET, host)
    except OSError:
        return False
    return True
