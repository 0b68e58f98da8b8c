"""Rotating the sync key without a restart, and an optional key that appears while running:
two syncers over real UDP on loopback, their key files rewritten on disk, each poll of the
files driven by the test on the runtime's clock (`SyncService.check`). Nothing here runs on
real time: the services do not follow their files on their own (`follow=False`), and their
heartbeats are stopped (`_quiet`), so each datagram a peer sees is one the test sent."""

from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from functools import partial
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from poolkeeper.datastore.store import Datastore
from poolkeeper.errors import ConfigError
from poolkeeper.netutil import free_ports
from poolkeeper.server.sync_service import SyncService
from tests.scheduling.sched_factories import NOW, scheduler
from tests.server.test_server_replica_sync import _section
from tests.server.test_server_sync_keys import K1, K2, K3, _kubelet_write, _write
from tests.support.waiting import until

pytestmark = pytest.mark.integration


class _Clock:
    def __init__(self) -> None:
        self.now = NOW

    def __call__(self) -> float:
        return self.now


def _service(
    key: Path, port: int, ports: list[int], clock: _Clock, *, optional: bool = False
) -> SyncService:
    section = _section(key, port, ports).model_copy(update={"key_optional": optional})
    return SyncService(section, scheduler("default"), Datastore(), clock=clock, follow=False)


def _quiet(service: SyncService) -> None:
    """Stop the started syncer's heartbeat (sent every second of real time): a datagram it
    sent while the test changed keys would be counted as the test's own."""
    assert service.running is not None
    for task in service.running._tasks:
        if task.get_name() == "replica-sync-heartbeat":
            task.cancel()


def _knows_peers(service: SyncService) -> bool:
    return service.running is not None and bool(service.running.transport.peers)


def _started(service: SyncService) -> bool:
    return service.running is not None


async def _polled(clock: _Clock, *services: SyncService) -> None:
    """One key-file poll of each service, due on the runtime's clock."""
    clock.now += services[0].every_s
    for service in services:
        await service.check()


async def _heard(sender: SyncService, receiver: SyncService) -> bool:
    """Whether `receiver` verifies a datagram `sender` sends now (False: rejected, `auth`)."""
    assert sender.running is not None
    assert receiver.running is not None
    stats = receiver.running.transport.stats
    before = (stats.received + stats.refused, stats.rejected.get("auth", 0))
    sender.running.transport.flush(heartbeat=True)
    now = lambda: (stats.received + stats.refused, stats.rejected.get("auth", 0))  # noqa: E731
    await until(lambda: now() != before, "the datagram at the peer")
    return now()[0] > before[0]


@asynccontextmanager
async def _pair(
    tmp_path: Path, clock: _Clock
) -> AsyncIterator[tuple[list[Path], SyncService, SyncService]]:
    """Two started syncers `a`, `b` on key files (returned) holding K1, each knowing the
    other."""
    ports = free_ports(2)
    files = [tmp_path / "a.key", tmp_path / "b.key"]
    for path in files:
        _write(path, K1)
    a, b = (_service(path, port, ports, clock) for path, port in zip(files, ports, strict=True))
    await a.start()
    await b.start()
    try:
        for service in (a, b):
            _quiet(service)
            await until(partial(_knows_peers, service), "peers known")
        yield files, a, b
    finally:
        await a.stop()
        await b.stop()


async def test_the_key_rotates_in_three_steps_without_a_restart(tmp_path: Path) -> None:
    clock = _Clock()
    async with _pair(tmp_path, clock) as (files, a, b):
        assert b.running is not None
        assert await _heard(a, b)
        # 1. Everyone also accepts the new key (still signs with the old).
        _write(files[0], K1, K2)
        await _polled(clock, a, b)
        assert await _heard(a, b)
        assert await _heard(b, a)
        _write(files[1], K1, K2)
        await _polled(clock, a, b)
        # 2. Everyone signs with the new key, one replica after the other: the one still on
        # the old order verifies the new signature by its second key, and is still heard.
        _write(files[0], K2, K1)
        await _polled(clock, a, b)
        old = b.running.transport.codec.verified_old
        assert await _heard(a, b)
        assert b.running.transport.codec.verified_old == old + 1
        assert await _heard(b, a)
        _write(files[1], K2, K1)
        await _polled(clock, a, b)
        # 3. The old key goes.
        _write(files[0], K2)
        _write(files[1], K2)
        await _polled(clock, a, b)
        assert await _heard(a, b)
        assert await _heard(b, a)
        # The keys in use really are the file's: a key the peer does not hold is refused.
        _write(files[0], K3)
        await _polled(clock, a, b)
        assert not await _heard(a, b)
        registry = CollectorRegistry()
        registry.register(a.collector())
        text = generate_latest(registry).decode()
        assert 'poolkeeper_replica_sync_key_reloads_total{result="ok"} 4.0' in text
        assert 'poolkeeper_replica_sync_key_reloads_total{result="invalid"} 0.0' in text


async def test_an_invalid_new_key_file_leaves_sync_running_on_the_old_keys(
    tmp_path: Path,
) -> None:
    clock = _Clock()
    async with _pair(tmp_path, clock) as (files, a, b):
        files[0].write_bytes(b"short\n")
        await _polled(clock, a)
        assert await _heard(a, b)  # still signing with K1
        files[0].unlink()
        await _polled(clock, a)
        assert await _heard(a, b)
        assert a.keys.reloads == {"ok": 0, "invalid": 2}


async def test_an_optional_key_created_later_starts_sync_without_a_restart(
    tmp_path: Path,
) -> None:
    ports, clock = free_ports(2), _Clock()
    volume = tmp_path / "secret"
    volume.mkdir()  # an optional Secret volume, its Secret not created yet
    b_key = tmp_path / "b.key"
    _write(b_key, K1)
    a = _service(volume / "key", ports[0], ports, clock, optional=True)
    b = _service(b_key, ports[1], ports, clock)
    await a.start()
    await b.start()
    registry = CollectorRegistry()
    registry.register(a.collector())
    try:
        assert not _started(a)
        assert "poolkeeper_replica_sync_enabled 0.0" in generate_latest(registry).decode()
        await _polled(clock, a)
        assert not _started(a)  # still no key
        _kubelet_write(volume, "2026_12_07_16_00_00.1", [K1])  # the Secret was created
        await _polled(clock, a)
        assert _started(a)
        _quiet(a)
        _quiet(b)
        text = generate_latest(registry).decode()
        assert "poolkeeper_replica_sync_enabled 1.0" in text
        assert 'poolkeeper_replica_sync_key_reloads_total{result="ok"} 1.0' in text
        await until(lambda: a.running and a.running.transport.peers, "peers known")
        await until(lambda: b.running and b.running.transport.peers, "peers known")
        assert await _heard(a, b)
        assert await _heard(b, a)
    finally:
        await a.stop()
        await b.stop()


async def test_a_late_start_that_fails_is_tried_again_at_the_next_poll(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    ports, clock = free_ports(2), _Clock()
    volume = tmp_path / "secret"
    volume.mkdir()
    taken = _service(tmp_path / "t.key", ports[0], ports, clock)
    _write(tmp_path / "t.key", K1)
    await taken.start()  # holds the port the optional one wants
    a = _service(volume / "key", ports[0], ports, clock, optional=True)
    await a.start()
    registry = CollectorRegistry()
    registry.register(a.collector())
    try:
        _kubelet_write(volume, "2026_12_07_16_00_00.1", [K1])
        await _polled(clock, a)
        assert not _started(a)  # the port is taken: not started, keys kept for a retry
        await _polled(clock, a)
        text = generate_latest(registry).decode()
        assert "poolkeeper_replica_sync_enabled 0.0" in text
        assert "poolkeeper_replica_sync_start_failures_total 2.0" in text  # each try counted
        # The file turns bad meanwhile: the error says sync is not running, not that keys
        # stay in use; the valid keys read before are still the ones tried.
        _kubelet_write(volume, "2026_12_07_16_01_00.2", [b"short"])
        with caplog.at_level(logging.ERROR, logger="poolkeeper.replicasync"):
            await _polled(clock, a)
        assert any(
            m.endswith("; replica sync is not running (its start fails), tried again with "
                       "the 1 key(s) read before")
            for m in caplog.messages
        ), caplog.messages  # fmt: skip
        await taken.stop()
        await until(lambda: _free(ports[0]), "the port closed")  # (closed on a later pass)
        assert not _started(a)  # nothing but the test's own poll starts it
        await _polled(clock, a)
        assert _started(a)
        assert a.start_failures == 3
    finally:
        await a.stop()


async def test_checks_at_once_start_the_syncer_once(tmp_path: Path) -> None:
    ports, clock = free_ports(2), _Clock()
    volume = tmp_path / "secret"
    volume.mkdir()
    a = _service(volume / "key", ports[0], ports, clock, optional=True)
    await a.start()
    try:
        _kubelet_write(volume, "2026_12_07_16_00_00.1", [K1])
        clock.now += a.every_s
        # The second check comes while the first awaits the start (the loop's and another).
        await asyncio.gather(a.check(), a.check())
        assert _started(a)
        assert a.start_failures == 0  # not a second start on the same port
    finally:
        await a.stop()


def _free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


async def test_a_profile_sync_cannot_bind_to_is_refused_before_the_key_exists(
    tmp_path: Path,
) -> None:
    volume = tmp_path / "secret"
    volume.mkdir()
    (port,) = free_ports(1)
    service = SyncService(
        _section(volume / "key", port, [port]).model_copy(update={"key_optional": True}),
        scheduler("classic"),
        Datastore(),
        clock=_Clock(),
    )
    with pytest.raises(ConfigError, match="needs a prefill-backlog-scorer"):
        await service.start()
