"""Cross-replica sync in the composition root: two replicas on 127.0.0.1 see each other's sends
in their backlogs; a bad key or a profile without a backlog scorer stops the start; the runtime
starts and stops the syncer and exports its metrics."""

from __future__ import annotations

import asyncio
import random
import socket
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from unittest.mock import MagicMock

import aiohttp
import pytest
from prometheus_client import CollectorRegistry, generate_latest

from poolkeeper.controller.files import file_source
from poolkeeper.datastore.store import ChangeKind
from poolkeeper.errors import ConfigError
from poolkeeper.netutil import free_ports
from poolkeeper.scheduling.plugins.backlog_scorer import PrefillBacklogScorer
from poolkeeper.scheduling.prefillfacts import PrefillFacts
from poolkeeper.scheduling.replicasync.config import ReplicaSyncConfig
from poolkeeper.scheduling.replicasync.discovery import PeerDiscovery
from poolkeeper.scheduling.replicasync.events import Answered, Ended, Open, Sent
from poolkeeper.scheduling.replicasync.openset import digest
from poolkeeper.scheduling.scheduler import Scheduler
from poolkeeper.server.options import ServeOptions
from poolkeeper.server.replica_sync import (
    RunningSync,
    SpreadWake,
    notifier,
    origin_name,
    start_replica_sync,
)
from poolkeeper.server.runtime import GatewayRuntime
from poolkeeper.server.sync_keys import key_missing, read_keys
from poolkeeper.server.sync_service import SyncCollector
from tests.scheduling.sched_factories import NOW, key, request, scheduler, state
from tests.support.gateway_files import one_pool
from tests.support.waiting import until

pytestmark = pytest.mark.integration
PROMPT = "a long shared system prompt " * 100


def _clock() -> float:
    """The schedulers' clock in these tests (their decisions get `NOW`): the syncer's stamps
    and statements share its base (`start_replica_sync`'s `clock`)."""
    return NOW


@pytest.fixture
def key_file(tmp_path: Path) -> Path:
    path = tmp_path / "sync.key"
    path.write_text("0123456789abcdef0123456789abcdef\n")
    return path


def _section(key: Path, port: int, peers: list[int]) -> ReplicaSyncConfig:
    return ReplicaSyncConfig(
        enabled=True,
        address="127.0.0.1",
        port=port,
        peers=[f"127.0.0.1:{p}" for p in peers],
        key_file=str(key),
    )


def _backlog(s: Scheduler) -> PrefillBacklogScorer:
    scorer = s.plugins["prefill-backlog-scorer"]
    assert isinstance(scorer, PrefillBacklogScorer)
    return scorer


@dataclass
class _Pair:
    """Replica a and replica b (whose pump wakes are counted in `woken`), peers of each other."""

    ports: list[int]
    a: Scheduler
    b: Scheduler
    sync_a: RunningSync
    sync_b: RunningSync
    woken: list[int]


@asynccontextmanager
async def _two_replicas(key_file: Path, **b_section: object) -> AsyncIterator[_Pair]:
    """a and b syncing on 127.0.0.1, b's section updated with `b_section`; stopped after."""
    ports = free_ports(2)
    a, b = scheduler("default"), scheduler("default")
    woken: list[int] = []
    sync_a = await start_replica_sync(_section(key_file, ports[0], ports), a, clock=_clock)
    section_b = _section(key_file, ports[1], ports).model_copy(update=b_section)
    sync_b = await start_replica_sync(section_b, b, wake=lambda: woken.append(1), clock=_clock)
    try:
        await until(lambda: sync_a.transport.peers and sync_b.transport.peers, "peers known")
        yield _Pair(ports, a, b, sync_a, sync_b, woken)
    finally:
        await sync_a.stop()
        await sync_b.stop()


async def test_two_replicas_count_each_others_sends(key_file: Path) -> None:
    # No spread and no claim (0 turns the default grace off): the wake runs inside the
    # delivery, so its absence is seen at once.
    async with _two_replicas(key_file, peer_wake_spread_ms=0, claim_grace_ms=0) as pair:
        a, b, sync_a, sync_b, woken = pair.a, pair.b, pair.sync_a, pair.sync_b, pair.woken
        assert sync_a.transport.peers == (("127.0.0.1", pair.ports[1]),)  # itself left out
        pool = [state(i) for i in range(1, 5)]
        req = replace(request(prompt=PROMPT, request_id="q1"), stream=True)
        picked = a.schedule(req, pool, now=NOW).primary.key
        backlog = _backlog(b).backlog
        await until(lambda: backlog.tokens(picked) == req.prompt_tokens, "a's send at b")
        assert woken == []  # a send alone shrinks no backlog: the pump is not run for it
        a.observe_first_token("q1", picked, NOW + 0.2)
        await until(lambda: backlog.tokens(picked) == 0, "a's first byte at b")
        assert woken == [1]
        assert len(backlog.claims) == 0  # claimGraceMs 0: off
        registry = CollectorRegistry()
        registry.register(SyncCollector(lambda: sync_b))
        text = generate_latest(registry).decode()
        assert "poolkeeper_replica_sync_batches_received_total 2.0" in text
        assert "poolkeeper_replica_sync_peers 1.0" in text
        assert "poolkeeper_replica_sync_enabled 1.0" in text
        assert "poolkeeper_replica_sync_origins 1.0" in text
    assert _backlog(a).sync is None  # unbound: nothing published any more


@pytest.mark.parametrize("grace", [None, 2.5])
async def test_claim_grace_ms_reaches_the_hold_and_the_wake_in_seconds(
    key_file: Path, grace: float | None
) -> None:
    # The wiring of `claimGraceMs`, the default's (None) and a set one: b folds a's first byte
    # into a claim lasting the grace on the schedulers' clock (constant here, so the check is
    # timing-free), its hold's view counts it, and it still wakes its pump.
    ms = ReplicaSyncConfig.model_fields["claim_grace_ms"].default if grace is None else grace
    assert ms > 0  # the default claims (docs/notes/2026-12-07-claim-default.md)
    section = {} if grace is None else {"claim_grace_ms": grace}
    async with _two_replicas(key_file, peer_wake_spread_ms=0, **section) as pair:
        pool = [state(i) for i in range(1, 5)]
        req = replace(request(prompt=PROMPT, request_id="q1"), stream=True)
        picked = pair.a.schedule(req, pool, now=NOW).primary.key
        backlog = _backlog(pair.b).backlog
        await until(lambda: backlog.tokens(picked) == req.prompt_tokens, "a's send at b")
        pair.a.observe_first_token("q1", picked, NOW + 0.2)
        await until(lambda: backlog.tokens(picked) == 0, "a's first byte at b")
        within, after = NOW + ms / 1000 * 0.98, NOW + ms / 1000  # ms, not s
        index = [s.endpoint.hostport for s in pool].index(picked)
        facts = PrefillFacts(pair.b)  # what the hold reads (an expired claim is dropped)
        assert backlog.claims.tokens(within) == {picked: req.prompt_tokens}
        assert facts.backlogs(pool, within)[index] == req.prompt_tokens
        assert facts.backlogs(pool, after)[index] == 0
        assert backlog.claims.tokens(after) == {}
        await until(lambda: pair.woken == [1], "b's pump woken after the claim")


def test_only_a_decision_is_sent_at_once_and_only_with_send_at_once() -> None:
    calls: list[bool] = []

    class Transport:
        def notify(self, *, at_once: bool = False) -> None:
            calls.append(at_once)

    on, off = notifier(Transport(), True), notifier(Transport(), False)
    sent = Sent("r1", "10.0.0.1:8000", 10, True)
    for event in (sent, Answered("r1"), Ended("r1")):
        on(event)
    off(sent)
    assert calls == [True, False, False, False]


async def test_a_peers_decision_is_in_its_unseen_counts_unless_turned_off(
    key_file: Path,
) -> None:
    ports = free_ports(3)
    a, b = scheduler("default"), scheduler("default")
    sync_a = await start_replica_sync(_section(key_file, ports[0], ports), a, clock=_clock)
    sync_b = await start_replica_sync(_section(key_file, ports[1], ports[:2]), b, clock=_clock)
    c = scheduler("default")
    off = await start_replica_sync(
        _section(key_file, ports[2], ports).model_copy(update={"peer_unseen": False}),
        c, clock=_clock,
    )  # fmt: skip
    try:
        assert off.unseen is None
        unseen = sync_b.unseen
        assert unseen is not None
        # Every receiver must know a as a peer first: a datagram from an address not (yet)
        # resolved as one is dropped as a stranger's, and a sends its decision only once.
        await until(lambda: len(sync_a.transport.peers) == 2 and sync_b.transport.peers
                    and len(off.transport.peers) == 2, "peers known")  # fmt: skip
        pool = [replace(state(i), metrics=replace(state(i).metrics, updated_at=NOW - 1.0))
                for i in range(1, 5)]  # fmt: skip
        picked = a.schedule(request(prompt=PROMPT, request_id="q1"), pool, now=NOW).primary.key
        await until(lambda: len(unseen) == 1, "a's decision at b")
        counts = {s.key: s.unseen_requests for s in unseen.apply(pool)}
        assert counts == {s.key: int(s.key == picked) for s in pool}
        # Turned off: the decision reaches the fold (the backlog) and nothing else.
        await until(lambda: _backlog(c).backlog.tokens(picked) > 0, "a's decision at off")
        assert all(sink is off.fold for sink in off.hub._sinks)
    finally:
        await sync_a.stop()
        await sync_b.stop()
        await off.stop()


@pytest.mark.parametrize("at_once", [True, False])
async def test_send_at_once_reaches_the_transport(
    key_file: Path, at_once: bool, caplog: pytest.LogCaptureFixture
) -> None:
    port, peer = free_ports(2)
    section = _section(key_file, port, [peer]).model_copy(update={"send_at_once": at_once})
    running = await start_replica_sync(section, scheduler("default"), clock=_clock)
    # Counting peers' sends pays off only when they arrive at once: said at start.
    assert ("peerUnseen is on with sendAtOnce off" in caplog.text) is not at_once
    calls: list[bool] = []

    def notify(*, at_once: bool = False) -> None:
        calls.append(at_once)

    running.transport.notify = notify  # type: ignore[method-assign]
    try:
        running.hub.publish(Sent("r1", "10.0.0.1:8000", 10, True))
        running.hub.publish(Ended("r1"))
        assert calls == [at_once, False]
    finally:
        await running.stop()


async def test_a_pool_change_prunes_the_peers_unseen_sends(key_file: Path) -> None:
    port, peer = free_ports(2)
    a, b = key(1), key(2)
    running = await start_replica_sync(
        _section(key_file, port, [peer]), scheduler("default"), clock=_clock, pool={a, b}
    )
    try:
        unseen = running.unseen
        assert unseen is not None
        for rid, endpoint in (("r1", a), ("r2", b), ("r3", "10.9.9.9:8000")):
            unseen.fold("peer", Sent(rid, endpoint, 10, True), NOW)
        assert (len(unseen), unseen.ignored) == (2, 1)  # seeded with the pool
        snapshot = MagicMock()
        snapshot.all_endpoints.return_value = [state(2).endpoint]
        running.pool_changed(snapshot, ChangeKind.ENDPOINTS)
        assert len(unseen) == 1
        assert running.fold.pool == frozenset({b})
    finally:
        await running.stop()


async def test_a_lost_end_stops_counting_at_the_peer_after_the_next_statement(
    key_file: Path,
) -> None:
    ports = free_ports(2)
    a, b = scheduler("default"), scheduler("default")
    fast = {"reconcile_interval_ms": 100}
    sync_a = await start_replica_sync(
        _section(key_file, ports[0], ports).model_copy(update=fast), a, clock=_clock
    )
    sync_b = await start_replica_sync(_section(key_file, ports[1], ports), b, clock=_clock)
    try:
        await until(lambda: sync_a.transport.peers and sync_b.transport.peers, "peers known")
        pool = [state(i) for i in range(1, 5)]
        picked = a.schedule(request(prompt=PROMPT, request_id="q1"), pool, now=NOW).primary.key
        backlog = _backlog(b).backlog
        await until(lambda: backlog.tokens(picked) > 0, "a's send at b")
        peers = sync_a.transport.peers
        sync_a.transport.set_peers([])  # the datagram with q1's end is lost on the way
        a.request_ended("q1")
        sync_a.transport.flush()
        assert sync_a.hub.pending == 0  # taken and sent, to no one
        sync_a.transport.set_peers(peers)
        assert backlog.tokens(picked) > 0  # b never heard the end
        await until(lambda: backlog.tokens(picked) == 0, "a's next statement at b")
        assert sync_b.hub.reconciled == 1
        registry = CollectorRegistry()
        registry.register(SyncCollector(lambda: sync_b))
        assert "poolkeeper_replica_sync_reconciled_total 1.0" in generate_latest(registry).decode()
    finally:
        await sync_a.stop()
        await sync_b.stop()


async def test_a_batch_folded_in_whose_wake_failed_is_received_not_rejected(
    key_file: Path,
) -> None:
    ports = free_ports(2)
    a, b = scheduler("default"), scheduler("default")

    def broken_wake() -> None:
        raise RuntimeError("flow control bug")

    sync_a = await start_replica_sync(_section(key_file, ports[0], ports), a, clock=_clock)
    section = _section(key_file, ports[1], ports).model_copy(update={"peer_wake_spread_ms": 0})
    sync_b = await start_replica_sync(section, b, wake=broken_wake, clock=_clock)
    try:
        await until(lambda: sync_a.transport.peers and sync_b.transport.peers, "peers known")
        picked = a.schedule(
            replace(request(prompt=PROMPT, request_id="q1"), stream=True), [state(1)], now=NOW
        ).primary.key
        await until(lambda: sync_b.transport.stats.received == 1, "a's send folded in at b")
        a.observe_first_token("q1", picked, NOW + 0.2)  # a first byte: b's pump is woken
        await until(lambda: sync_b.transport.stats.received == 2, "a's first byte at b")
        assert sync_b.transport.stats.rejected == {}
    finally:
        await sync_a.stop()
        await sync_b.stop()


async def test_a_background_task_that_dies_says_so(
    key_file: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    async def broken(self: PeerDiscovery) -> tuple[tuple[str, int], ...]:
        raise RuntimeError("discovery bug")

    monkeypatch.setattr(PeerDiscovery, "peers", broken)
    (port,) = free_ports(1)
    running = await start_replica_sync(_section(key_file, port, [port]), scheduler("default"))
    try:
        await until(lambda: "replica-sync-peers stopped" in caplog.text, "the death logged")
        assert "discovery bug" in caplog.text
    finally:
        await running.stop()


def test_the_key_must_exist_and_be_long_enough(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="keyFile: cannot read"):
        read_keys(str(tmp_path / "missing"))
    short = tmp_path / "short"
    short.write_text("  too short \n")
    with pytest.raises(
        ConfigError, match=f"keyFile: {short} line 1 holds 9 bytes; each key needs at least 16"
    ):
        read_keys(str(short))
    with pytest.raises(ConfigError, match="required"):
        read_keys(None)


def test_a_key_file_holds_one_key_a_line_the_first_signing(tmp_path: Path) -> None:
    path = tmp_path / "keys"
    path.write_text("# rotation: new key first\n\n  " + "n" * 32 + "  \n" + "o" * 32 + "\n")
    assert read_keys(str(path)) == [b"n" * 32, b"o" * 32]
    for text, problem in (
        ("# nothing\n\n", "holds no key"),
        ("k" * 20 + "\n" + "x" * 20 + "\n" + "k" * 20 + "\n", "line 3 repeats the key of line 1"),
        ("".join(f"{i}" * 20 + "\n" for i in range(5)), "holds 5 keys, at most 4"),
        ("k" * 20 + "\n# old:\nshort\n", "line 3 holds 5 bytes"),
    ):
        path.write_text(text)
        with pytest.raises(ConfigError, match=f"spec.replicaSync.keyFile: {path} {problem}"):
            read_keys(str(path))


async def test_a_profile_without_a_backlog_scorer_cannot_sync(key_file: Path) -> None:
    (port,) = free_ports(1)
    with pytest.raises(ConfigError, match="needs a prefill-backlog-scorer"):
        await start_replica_sync(_section(key_file, port, [port]), scheduler("classic"))


def test_each_process_life_is_a_new_origin(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("POD_NAME", "epp-7f9c")
    first, second = origin_name(None), origin_name(None)
    assert first.startswith("epp-7f9c-")
    assert first != second
    assert origin_name("x" * 500).startswith("x" * 200 + "-")
    assert len(origin_name("x" * 500).encode()) <= 255


def _runtime(
    tmp_path: Path, key_file: Path, extra: str = "", clock: Callable[[], float] = time.monotonic
) -> tuple[GatewayRuntime, int, int]:
    """A runtime (not started) with one pool and sync on (`extra`: more of the section),
    its sync port and its server's."""
    sync_port, sim = free_ports(2)
    spec = (
        f"  replicaSync: {{enabled: true, address: 127.0.0.1, port: {sync_port}, "
        f"keyFile: {key_file}, peers: ['127.0.0.1:{sync_port}']{extra}}}\n"
    )
    directory = one_pool(tmp_path / "cfg", sim, spec=spec)
    options = ServeOptions(source=file_source([directory]), run_envoy=False, ready_wait_s=0)
    return GatewayRuntime(options, clock=clock), sync_port, sim


async def test_the_runtime_leaves_peers_unseen_sends_out_when_turned_off(
    tmp_path: Path, key_file: Path
) -> None:
    runtime, _, _ = _runtime(tmp_path, key_file, ", peerUnseen: false")
    await runtime.start()
    try:
        assert runtime._sync is not None
        assert runtime._sync.running is not None  # the syncer runs, its fold bound
        assert runtime._sync.running.unseen is None
        assert runtime.director is not None
        assert runtime.director.peers is None
    finally:
        await runtime.stop(grace_s=0)


async def test_the_runtime_runs_the_syncer_it_is_configured_with(
    tmp_path: Path, key_file: Path
) -> None:
    now = [1e9]  # far from time.monotonic(): a syncer on another clock would not age at all
    runtime, sync_port, sim = _runtime(tmp_path, key_file, clock=lambda: now[0])
    await runtime.start()
    try:
        assert runtime.config is not None
        metrics = runtime.config.spec.listeners.metrics
        async with (
            aiohttp.ClientSession() as session,
            session.get(f"http://127.0.0.1:{metrics}/metrics") as resp,
        ):
            text = await resp.text()
        assert "poolkeeper_replica_sync_peers 0.0" in text  # its own address left out
        # Peers' sends are accepted only for the pool's endpoints, seeded at start.
        assert runtime._sync is not None
        assert runtime._sync.running is not None
        assert runtime._sync.running.fold.pool == frozenset({f"127.0.0.1:{sim}"})
        # The statement ages the own open sends on the scheduler's clock, the runtime's.
        assert runtime.director is not None
        scheduler = runtime.director.scheduler
        assert isinstance(scheduler, Scheduler)
        scheduler.schedule(request(prompt=PROMPT, request_id="q1"), [state(1)], now=now[0])
        assert runtime._sync.running.hub.statement(100) == Open(0, 0, frozenset({digest("q1")}))
        now[0] += 61.0
        assert runtime._sync.running.hub.statement(100) == Open(0, 0, frozenset())
        # The peers' unseen sends reach the Director's candidates while the syncer runs.
        assert runtime.director.peers is runtime._sync.running.unseen is not None
    finally:
        await runtime.stop(grace_s=0)
    assert runtime.director.peers is None
    # The UDP port is free again: the syncer closed its socket.
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.bind(("127.0.0.1", sync_port))


def test_a_raw_binary_key_is_refused_not_split_into_other_keys(tmp_path: Path) -> None:
    path = tmp_path / "raw"
    # 32 raw bytes with a newline, a carriage return and other control bytes among them: split
    # into lines and stripped they would have been two other keys.
    path.write_bytes(b"\x0b" + b"k" * 16 + b"\r" + b"\x01" + b"j" * 16 + b"\x0c\n")
    with pytest.raises(ConfigError, match=r"line 1 holds control bytes \(0x0b\): a key file"):
        read_keys(str(path))
    path.write_bytes(b"k" * 20 + b"\n" + b"\x01" + b"j" * 20)
    with pytest.raises(ConfigError, match=r"line 2 holds control bytes \(0x01\).*base64"):
        read_keys(str(path))
    path.write_bytes(b"k" * 20 + b"\tj" * 4 + b"\n")
    with pytest.raises(ConfigError, match=r"line 1 holds control bytes \(0x09\)"):
        read_keys(str(path))
    # Text keys with CRLF endings, edge whitespace and comments still read as before.
    path.write_bytes(b"# rotated\r\n\t" + b"n" * 32 + b" \r\n" + b"o" * 32 + b"\r\n")
    assert read_keys(str(path)) == [b"n" * 32, b"o" * 32]


async def test_a_missing_optional_key_starts_the_runtime_without_sync(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    sync_port, sim = free_ports(2)
    missing = tmp_path / "secret" / "key"  # an optional Secret volume, the Secret not created
    missing.parent.mkdir()
    spec = (
        f"  replicaSync: {{enabled: true, keyOptional: true, address: 127.0.0.1, "
        f"port: {sync_port}, keyFile: {missing}, peers: ['127.0.0.1:{sync_port}'], "
        "reconcileIntervalMs: 100}\n"
    )
    runtime = GatewayRuntime(
        ServeOptions(
            source=file_source([one_pool(tmp_path / "cfg", sim, spec=spec)]),
            run_envoy=False,
            ready_wait_s=0,
        )
    )
    await runtime.start()
    sync = runtime._sync
    try:
        assert sync is not None
        assert sync.running is None
        assert f"replica sync stays off: spec.replicaSync.keyFile {missing} does not exist" in (
            caplog.text
        )
        assert "kubectl create secret generic" in caplog.text
        assert runtime.metrics is not None
        scraped = generate_latest(runtime.metrics.registry).decode()
        assert "poolkeeper_replica_sync_enabled 0.0" in scraped
        # The Secret is created (written whole, then renamed: the kubelet's swap, so the
        # runtime's check never reads it half written): its check starts sync, no restart.
        written = missing.with_name("..written")
        written.write_text("0123456789abcdef0123456789abcdef\n")
        written.rename(missing)
        await until(lambda: sync.running is not None, "sync started by the key's check")
        scraped = generate_latest(runtime.metrics.registry).decode()
        assert "poolkeeper_replica_sync_enabled 1.0" in scraped
        assert "poolkeeper_replica_sync_start_failures_total 0.0" in scraped
        # The shutdown stops following the key before it drains (nothing starts meanwhile).
        following: list[bool] = []
        stop_source = runtime._stop_source

        async def _drain_begins() -> None:
            assert sync._task is not None
            following.append(not sync._task.done())
            await stop_source()

        monkeypatch.setattr(runtime, "_stop_source", _drain_begins)
    finally:
        await runtime.stop(grace_s=0)
    assert following == [False]
    # (read through the runtime: mypy still holds `sync.running` to be None, as asserted above)
    running = runtime._sync.running if runtime._sync is not None else None
    assert running is not None
    assert running.transport._socket is None  # stopped with the runtime


def test_only_an_empty_key_directory_is_optional(tmp_path: Path, key_file: Path) -> None:
    volume = tmp_path / "volume"
    volume.mkdir()
    section = ReplicaSyncConfig(
        enabled=True, peers=["127.0.0.1:1"], key_file=str(volume / "key"), key_optional=True
    )
    assert key_missing(section) is not None  # an optional Secret volume, no Secret: empty
    # What the kubelet's atomic writer leaves in an optional Secret volume without the
    # Secret: its data link and timestamped directory, both hidden ("..").
    (volume / "..2026_12_07_14_00_00.123").mkdir()
    (volume / "..data").symlink_to("..2026_12_07_14_00_00.123")
    assert key_missing(section) is not None
    assert key_missing(section.model_copy(update={"key_optional": False})) is None  # it fails
    assert key_missing(section.model_copy(update={"key_file": str(key_file)})) is None
    short = tmp_path / "short"
    short.write_text("short\n")  # present but bad: the start still stops, at read_keys
    assert key_missing(section.model_copy(update={"key_file": str(short)})) is None
    with pytest.raises(ConfigError, match="line 1 holds 5 bytes"):
        read_keys(str(short))


def test_a_key_file_that_is_not_an_empty_optional_volume_stops_the_start(tmp_path: Path) -> None:
    def section(path: Path) -> ReplicaSyncConfig:
        return ReplicaSyncConfig(
            enabled=True, peers=["127.0.0.1:1"], key_file=str(path), key_optional=True
        )

    # A wrong mountPath: the directory is not there.
    with pytest.raises(ConfigError, match=r"spec\.replicaSync\.keyFile: .* nor does its dir"):
        key_missing(section(tmp_path / "elsewhere" / "key"))
    # The Secret's data key is not the file's name: the volume holds another file.
    volume = tmp_path / "volume"
    volume.mkdir()
    (volume / "sync-key").write_text("x" * 32)
    (volume / "..data").mkdir()
    with pytest.raises(
        ConfigError, match=r"keyFile: .*/key does not exist, but .* holds sync-key:"
    ):
        key_missing(section(volume / "key"))
    # A path that cannot be checked (here a file where a directory should be) is a ConfigError,
    # not a traceback.
    with pytest.raises(ConfigError, match="keyFile: cannot check"):
        key_missing(section(volume / "sync-key" / "key"))


def test_a_key_path_that_cannot_be_checked_is_a_config_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def denied(self: Path, **_: object) -> object:
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(Path, "stat", denied)
    section = ReplicaSyncConfig(
        enabled=True, peers=["127.0.0.1:1"], key_file=str(tmp_path / "k"), key_optional=True
    )
    with pytest.raises(ConfigError, match=r"keyFile: cannot check .*: Permission denied"):
        key_missing(section)


def _recorded(calls: list[float]) -> Callable[[], None]:
    """A wake that records the loop time it ran at in `calls`."""
    loop = asyncio.get_running_loop()
    return lambda: calls.append(loop.time())


async def test_peer_wakes_are_spread_and_coalesced() -> None:
    calls: list[float] = []
    loop = asyncio.get_running_loop()
    at_once = SpreadWake(_recorded(calls), 0.0)
    at_once()
    assert len(calls) == 1  # no spread: called before returning
    spread = SpreadWake(_recorded(calls), 0.05, random.Random(3))
    asked = loop.time()
    spread()
    spread()
    spread()  # armed once: one wake for the three
    assert len(calls) == 1
    await until(lambda: len(calls) == 2, "the spread wake")
    assert calls[1] >= asked  # later, never sooner
    spread()
    spread.cancel()  # a stopped syncer wakes nothing
    await asyncio.sleep(0.1)
    assert len(calls) == 2


async def test_a_claim_merged_into_a_pending_wake_gets_a_wake_when_it_ends() -> None:
    # A second peer first byte 10 ms after the first is merged into the pending wake (due at
    # 20 ms), but its room stays claimed until 30 ms: the pump must be woken again then.
    calls: list[float] = []
    loop = asyncio.get_running_loop()
    claimed = SpreadWake(_recorded(calls), 0.0, after_s=0.02)
    asked = loop.time()
    claimed()
    await asyncio.sleep(0.01)
    later = loop.time()
    claimed()
    await until(lambda: len(calls) == 2, "a wake after the second claim")
    assert calls[0] >= asked + 0.02
    assert calls[1] >= later + 0.02
    await asyncio.sleep(0.04)
    assert len(calls) == 2


async def test_a_claim_grace_delays_the_peer_wake_past_it() -> None:
    calls: list[float] = []
    loop = asyncio.get_running_loop()
    claimed = SpreadWake(_recorded(calls), 0.0, after_s=0.02)
    asked = loop.time()
    claimed()
    claimed()
    assert calls == []  # not at once, though there is no spread: the claim lasts 20 ms
    await until(lambda: len(calls) == 1, "the wake after the claim")
    assert calls[0] >= asked + 0.02
    await asyncio.sleep(0.03)
    assert len(calls) == 1  # coalesced
