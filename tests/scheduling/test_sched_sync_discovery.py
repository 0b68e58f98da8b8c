"""Replica-sync peer discovery: static lists, a re-resolved name, our own address left out."""

from __future__ import annotations

import asyncio

import pytest

from poolkeeper.scheduling.replicasync.discovery import (
    MAX_PEERS,
    PeerDiscovery,
    own_addresses,
    parse_peers,
    resolve,
)
from tests.support.waiting import settled, until


def test_peer_lists_parse_with_ipv6_and_names() -> None:
    assert parse_peers("10.0.0.1:9010, [fd00::1]:9010,epp-1:9011,") == (
        ("10.0.0.1", 9010), ("fd00::1", 9010), ("epp-1", 9011)
    )  # fmt: skip
    assert parse_peers(["127.0.0.1:1"]) == (("127.0.0.1", 1),)
    with pytest.raises(ValueError, match="expected ip:port"):
        parse_peers("10.0.0.1")
    with pytest.raises(ValueError, match="not a valid DNS name"):
        parse_peers(["a" * 64 + ".svc:9010"])  # a label over 63 characters (IDNA refuses)


class FakeDns:
    def __init__(self, answers: dict[str, list[str]]) -> None:
        self.answers = answers
        self.asked: list[str] = []

    async def __call__(self, host: str, port: int) -> list[str]:
        self.asked.append(host)
        if host not in self.answers:
            raise OSError(f"no such name {host}")
        return self.answers[host]


async def test_a_service_name_is_resolved_to_every_pod_and_our_own_left_out() -> None:
    dns = FakeDns({"epp-peers": ["10.0.0.1", "10.0.0.2", "10.0.0.3"], "10.9.9.9": ["10.9.9.9"]})
    discovery = PeerDiscovery(
        static=[("10.9.9.9", 7000)],
        service=("epp-peers", 9010),
        own=frozenset({("10.0.0.2", 9010)}),
        resolver=dns,
    )
    assert await discovery.peers() == (
        ("10.0.0.1", 9010), ("10.0.0.3", 9010), ("10.9.9.9", 7000)
    )  # fmt: skip


async def test_a_name_that_stops_resolving_keeps_its_last_answer() -> None:
    dns = FakeDns({"epp-peers": ["10.0.0.1"]})
    discovery = PeerDiscovery(service=("epp-peers", 9010), resolver=dns)
    assert await discovery.peers() == (("10.0.0.1", 9010),)
    del dns.answers["epp-peers"]
    assert await discovery.peers() == (("10.0.0.1", 9010),)
    dns.answers["epp-peers"] = ["10.0.0.4", "10.0.0.5"]
    assert await discovery.peers() == (("10.0.0.4", 9010), ("10.0.0.5", 9010))


async def test_a_name_the_resolver_cannot_encode_is_a_failed_lookup_not_a_dead_task() -> None:
    dns = FakeDns({"epp-peers": ["10.0.0.1"]})
    long_label = "a" * 64 + ".svc"
    discovery = PeerDiscovery(
        static=[(long_label, 9010)], service=("epp-peers", 9010), resolve_interval_s=0.01
    )
    seen: list[tuple[tuple[str, int], ...]] = []

    async def real_then_fake(host: str, port: int) -> list[str]:
        if host == long_label:
            return await resolve(host, port)  # the loop's getaddrinfo: UnicodeError
        return await dns(host, port)

    discovery.resolver = real_then_fake
    task = asyncio.create_task(discovery.follow(seen.append))
    await until(lambda: len(dns.asked) >= 2, "resolving again after the failure")
    assert not task.done()
    task.cancel()
    assert seen == [(("10.0.0.1", 9010),)]


async def test_peers_are_capped() -> None:
    dns = FakeDns({"many": [f"10.0.{i // 250}.{i % 250}" for i in range(MAX_PEERS + 10)]})
    discovery = PeerDiscovery(service=("many", 1), resolver=dns)
    assert len(await discovery.peers()) == MAX_PEERS


async def test_follow_reports_changes_only_and_stops_for_a_list_of_addresses() -> None:
    seen: list[tuple[tuple[str, int], ...]] = []
    fixed = PeerDiscovery(static=[("127.0.0.1", 5), ("127.0.0.1", 6)])
    await asyncio.wait_for(fixed.follow(seen.append), 30)  # returns: nothing can change
    assert seen == [(("127.0.0.1", 5), ("127.0.0.1", 6))]
    dns = FakeDns({"svc": ["10.0.0.1"]})
    moving = PeerDiscovery(service=("svc", 1), resolver=dns, resolve_interval_s=0)
    seen.clear()
    task = asyncio.create_task(moving.follow(seen.append))
    await settled(lambda: len(dns.asked) >= 3)
    dns.answers["svc"] = ["10.0.0.2"]
    await settled(lambda: len(seen) >= 2)
    task.cancel()
    assert seen[:2] == [(("10.0.0.1", 1),), (("10.0.0.2", 1),)]


async def test_own_addresses_cover_loopback_for_a_wildcard_bind() -> None:
    dns = FakeDns({})  # our host name does not resolve: the bind address still counts
    own = await own_addresses("0.0.0.0", 9010, resolver=dns)
    assert ("127.0.0.1", 9010) in own
    assert await own_addresses("10.1.2.3", 9010, resolver=dns) == {("10.1.2.3", 9010)}
