"""The multi-replica prefix-affinity measurement (virtual time, small and deterministic)."""

from __future__ import annotations

from typing import Any

import pytest

from poolkeeper.bench.fleet.replica_router import replica_of
from poolkeeper.bench.fleet.replica_run import run
from poolkeeper.datastore.endpoint import EndpointState
from poolkeeper.flowcontrol.config import FlowControlConfig


def test_replica_split_is_even_and_stable() -> None:
    ids = [f"req-{i}" for i in range(4000)]
    counts = [sum(1 for i in ids if replica_of(i, 4) == k) for k in range(4)]
    assert all(900 < c < 1100 for c in counts)
    assert [replica_of(i, 4) for i in ids[:50]] == [replica_of(i, 4) for i in ids[:50]]
    assert {replica_of(i, 1) for i in ids} == {0}


def test_more_replicas_see_less_of_each_prefix_group() -> None:
    # 4 servers of ~25 req/s each (the probe's figure for this workload), at 70 %.
    def once(replicas: int) -> dict[str, Any]:
        return run(replicas, servers=4, duration=5.0, seed=3, capacity_rps=100.0)

    one, four = once(1), once(4)
    assert one["requests"] == four["requests"]
    assert isinstance(one["requests"], int)
    assert one["requests"] > 100
    assert one == once(1)  # deterministic
    # One router keeps each group on one server; four independent routers split groups.
    assert one["affinity"] > four["affinity"]
    assert one["prefix_hit_rate"] > four["prefix_hit_rate"]


def test_exact_kv_events_give_every_replica_the_whole_picture() -> None:
    def once(replicas: int, exact: bool) -> dict[str, Any]:
        return run(replicas, servers=4, duration=5.0, seed=3, capacity_rps=100.0, exact=exact)

    approx4, exact4 = once(4, False), once(4, True)
    assert exact4["index"] == "exact"
    assert exact4["requests"] == approx4["requests"]
    # Fed by the engines, four replicas keep groups together far better than on their own.
    assert exact4["affinity"] > approx4["affinity"]
    assert exact4["prefix_hit_rate"] > approx4["prefix_hit_rate"]
    assert exact4 == once(4, True)  # deterministic


def test_index_memory_is_measured_per_entry() -> None:
    from poolkeeper.bench.fleet.replica_memory import memory

    got = memory(20, 50)
    assert got["endpoints"] == 20
    # Tens to a few hundred bytes per entry in CPython; zero would mean nothing was measured.
    assert 20 < got["exact_bytes_per_entry"] < 1000
    assert 20 < got["approx_bytes_per_entry"] < 1000
    # A head per block (the worst case for coldAffinityBalance's count) costs more per entry.
    worst = memory(20, 50, chain=1)
    assert worst["exact_bytes_per_entry"] > got["exact_bytes_per_entry"]
    with pytest.raises(ValueError, match="chain must be >= 1"):
        memory(1, 1, chain=0)
    # Bounded at 20 blocks per endpoint, 50 stored each: 20 held, and less memory for them.
    capped = memory(20, 50, cap=20)
    assert capped["exact_blocks_held_per_endpoint"] == 20
    assert got["exact_blocks_held_per_endpoint"] == 50
    assert capped["exact_mib_per_1000_endpoints"] < got["exact_mib_per_1000_endpoints"]


def test_subscriber_memory_follows_every_publisher() -> None:
    from poolkeeper.bench.fleet.replica_memory import subscriber_memory

    got = subscriber_memory(20)
    # Every subscription got its publisher's batch: the sockets measured were connected.
    assert got["batches_received"] == 20
    # The figure is an RSS difference in a process other tests share (pytest-xdist): the
    # allocator may hand pages back meanwhile (-33 KiB seen under load), so only its presence
    # is checked here; its size is the benchmark's (`replicas --memory`, docs/benchmarks.md).
    assert isinstance(got["subscriber_kib_per_endpoint"], float)


def test_cold_affinity_keeps_four_replicas_groups_together() -> None:
    # Without `placeUnderBacklog`, which sends a new prefix released from the hold away from
    # the server cold affinity picks while it is backlogged (seeds 1-4: 0.65-0.68 with it).
    unplaced = FlowControlConfig.model_validate({"holdNewPrefixes": {"placeUnderBacklog": False}})

    def once(cold: float) -> dict[str, Any]:
        return run(4, servers=4, duration=5.0, seed=3, capacity_rps=100.0, cold_affinity=cold,
                   flow_control=unplaced)  # fmt: skip

    plain, cold = once(0.0), once(0.2)
    assert cold["cold_affinity"] == 0.2
    assert cold["requests"] == plain["requests"]
    # Replicas that know nothing of a new system prompt send it to the same server.
    assert cold["affinity"] > plain["affinity"]


def test_cold_affinity_with_peers_only_is_off_for_one_replica_and_on_for_four() -> None:
    def once(replicas: int, **kw: Any) -> dict[str, Any]:
        return run(replicas, servers=4, duration=5.0, seed=3, capacity_rps=100.0, exact=True, **kw)

    def routing(row: dict[str, Any]) -> dict[str, Any]:
        return {k: v for k, v in row.items() if k not in ("cold_affinity", "cold_peers")}

    # One replica never sees another's blocks: exactly the run without cold affinity.
    assert routing(once(1, cold_affinity=0.2, cold_peers=True)) == routing(once(1))
    # Four see each other's blocks from the first engine step, and the rule moves placements
    # (whether that pays is the benchmark's question, not this small run's).
    peers = once(4, cold_affinity=0.2, cold_peers=True)
    assert peers["cold_peers"] is True
    assert routing(peers) != routing(once(4))
    with pytest.raises(ValueError, match="cold_peers needs exact"):
        run(4, servers=4, duration=1.0, capacity_rps=100.0, cold_affinity=0.2, cold_peers=True)


def test_balanced_cold_affinity_keeps_more_of_each_group_on_one_server() -> None:
    def once(**kw: Any) -> dict[str, Any]:
        return run(4, servers=4, groups=16, duration=3.3, load=0.9, seed=4, capacity_rps=140.0,
                   exact=True, cold_affinity=0.2, **kw)  # fmt: skip

    plain = once()
    balanced = once(prefix_params={"kvEvents": True, "kvEventsSubscribe": False,
                                   "coldAffinityBalance": 1.0})  # fmt: skip
    assert balanced["groups"] == 16
    assert sum(balanced["groups_per_server"]) == 16
    # Each replica counts the prefixes the engines reported and those it sent: a group's
    # requests from every replica meet the same, less loaded, server more often.
    assert balanced["affinity"] > plain["affinity"]


def test_cold_placement_keeps_four_replicas_groups_together() -> None:
    # On the old default's profile without flow control (what the filter was built against;
    # the new default's hold changes the cold start: docs/notes/2026-12-07-replicas-new-default.md).
    def once(**kw: Any) -> dict[str, Any]:
        return run(4, servers=4, duration=5.0, seed=3, capacity_rps=100.0, exact=True,
                   policy="poolkeeper-classic-shed", **kw)  # fmt: skip

    plain = once()
    placed = once(cold_placement={}, prefix_params={"kvEvents": True, "kvEventsSubscribe": False})
    assert placed["cold_placement"] == {}
    assert placed["requests"] == plain["requests"]
    # Every replica sends a new system prompt to its ring owner (within the load band), so a
    # group's first requests from different replicas meet on one server.
    assert placed["affinity"] > plain["affinity"]


def test_events_that_never_arrive_in_time_leave_the_approximate_index_alone() -> None:
    def once(**kw: Any) -> dict[str, Any]:
        row = run(4, servers=4, duration=5.0, seed=3, capacity_rps=100.0, **kw)
        return {k: v for k, v in row.items() if k not in ("index", "event_delay_s")}

    approx, exact = once(), once(exact=True)
    assert exact != approx  # the events change placements ...
    # ... unless they reach the replicas only after the run: then the exact index is empty
    # and every decision is the approximate index's.
    assert once(exact=True, event_delay_s=100.0) == approx


@pytest.mark.parametrize(
    ("policy_name", "rate"), [("poolkeeper", 90.0), ("poolkeeper-classic", 20.0)]
)
def test_one_replica_routes_as_the_single_router_replay(policy_name: str, rate: float) -> None:
    # One replica is the EPP as `bench sim` runs it: the default preset behind flow control
    # (its hold included), first tokens reported as they happen where the router asks for
    # them (not `poolkeeper-classic`); so the same decisions.
    import random

    from poolkeeper.bench.fleet.simrun import _outcome, replay
    from poolkeeper.bench.policies.flowpolicy import FlowPolicy
    from poolkeeper.bench.policies.routers import make_policy
    from poolkeeper.bench.results.metrics import SLO, summarize
    from poolkeeper.bench.workload.scenarios import build_scenario
    from poolkeeper.bench.workload.workloads import generate

    scenario = build_scenario("shared-prefix", 4)
    arrivals = generate(scenario.spec, rate=rate, duration=5.0, seed=3)
    policy = make_policy(policy_name, random.Random("3:replica0"))
    alone = replay(list(scenario.servers), arrivals, policy, seed=3)
    by_id = {a.request_id: a for a in arrivals}
    outcomes = [_outcome(r, by_id[r.request_id]) for r in alone.requests]
    summary = summarize(outcomes, duration=5.0, slo=SLO())
    assert isinstance(policy, FlowPolicy)
    held = policy.hold.total if policy.hold is not None else 0
    assert (held > 0) is (policy_name == "poolkeeper")  # the hold ran where it is on
    row = run(1, servers=4, duration=5.0, seed=3, capacity_rps=100.0, load=rate / 100.0,
              policy=policy_name)  # fmt: skip
    assert row["held"] == held
    assert row["ttft_p50_s"] == round(summary["ttft_s"]["p50"], 4)
    assert row["ttft_p90_s"] == round(summary["ttft_s"]["p90"], 4)
    assert row["prefix_hit_rate"] == round(summary["prefix_hit_rate"], 4)
    assert row["ttft_p99_s"] == round(summary["ttft_s"]["p99"], 4)
    assert row["goodput_rps"] == round(summary["goodput_rps"], 3)
    # The old default without the hold holds nothing.
    assert run(1, servers=4, duration=2.0, seed=3, capacity_rps=100.0, load=0.9,
               policy="poolkeeper-classic")["held"] == 0  # fmt: skip


def test_plugin_params_reach_every_replicas_plugins() -> None:
    from pydantic import ValidationError

    def once(**kw: Any) -> dict[str, Any]:
        return run(2, servers=4, duration=3.0, seed=3, capacity_rps=100.0, load=0.9, **kw)

    plain = once()
    # The backlog scorer faded out from the start (no say at any busy share): the replicas
    # place otherwise, and the row names what they ran.
    faded = once(plugin_params={"prefill-backlog-scorer": {"fadeFrom": 0.0, "fadeTo": 1e-6}})
    assert faded["plugin_params"] == {"prefill-backlog-scorer": {"fadeFrom": 0.0, "fadeTo": 1e-6}}
    assert {k: v for k, v in faded.items() if k != "plugin_params"} != plain
    with pytest.raises(ValidationError):
        once(plugin_params={"prefill-backlog-scorer": {"fadeFrom": 2.0}})
    with pytest.raises(ValueError, match=r"plugin_params for \['no-such-scorer'\]"):
        once(plugin_params={"no-such-scorer": {}})


def test_a_replica_pump_runs_on_scrape_ticks_and_its_own_requests_only(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Live, each EPP's flow-control pump wakes on its scrape ticks and on its own requests'
    # ends (and first bytes while its hold is on), never on another replica's: record every
    # release of every replica and each replica's own request events, and check that a
    # release off a tick follows one of that replica's own events at that instant.
    from poolkeeper.bench.fleet import replica_run as module
    from poolkeeper.bench.fleet.replica_router import replica_policy as made
    from poolkeeper.bench.fleet.simrun import SCRAPE_INTERVAL_S

    releases: list[tuple[int, float]] = []
    own: set[tuple[int, float]] = set()
    made_policies: list[Any] = []

    def recorded(*args: Any, **kwargs: Any) -> Any:
        policy: Any = made(*args, **kwargs)
        k = len(made_policies)
        made_policies.append(policy)
        release, on_finish, on_first = policy.release, policy.on_finish, policy.on_first_token

        def rec_release(view: Any, now: float, send: Any) -> None:
            releases.append((k, now))
            release(view, now, send)

        def rec_finish(request_id: str, server: str, now: float) -> None:
            own.add((k, now))
            on_finish(request_id, server, now)

        def rec_first(request_id: str, now: float) -> None:
            own.add((k, now))
            on_first(request_id, now)

        policy.release, policy.on_finish, policy.on_first_token = rec_release, rec_finish, rec_first
        return policy

    monkeypatch.setattr(module, "replica_policy", recorded)
    run(4, servers=4, duration=3.0, seed=3, capacity_rps=100.0, load=0.9)
    every = SCRAPE_INTERVAL_S
    off_tick = [(k, t) for k, t in releases if round(t / every) * every != t]
    assert off_tick  # the run released on engine events, not only on ticks ...
    assert all((k, t) in own for k, t in off_tick)  # ... and only the replicas they concern
    assert {k for k, _ in off_tick} == {0, 1, 2, 3}
    assert any(round(t / every) * every == t for _, t in releases)


_KV = {"kvEvents": True, "kvEventsSubscribe": False}


def _cold_start(replicas: int, **kw: Any) -> dict[str, Any]:
    """The live-like cold start, short: 4 servers, 16 groups starting together, 0.9x."""
    return run(replicas, servers=4, groups=16, load=0.9, duration=2.0, seed=1,
               capacity_rps=150.0, exact=True, prefix_params=_KV, **kw)  # fmt: skip


def test_sync_without_peers_changes_nothing_and_is_deterministic() -> None:
    alone = _cold_start(1)
    synced = _cold_start(1, sync_delay_s=0.0)
    assert synced["sync_delay_ms"] == 0.0
    assert {k: v for k, v in synced.items() if k != "sync_delay_ms"} == alone
    four = _cold_start(4, sync_delay_s=0.005)
    assert four == _cold_start(4, sync_delay_s=0.005)


def test_sync_keeps_four_replicas_groups_together_in_a_cold_start() -> None:
    plain, synced = _cold_start(4), _cold_start(4, sync_delay_s=0.001)
    assert synced["requests"] == plain["requests"]
    # Each replica counts the others' sends (backlog, index, pending heads): a group's later
    # requests at another replica follow its first, and new prefixes are spread by load.
    assert synced["affinity"] > plain["affinity"]
    assert synced["ttft_p90_s"] < plain["ttft_p90_s"]
    # A peer's first byte wakes a replica's pump (its hold may release now): without that
    # wake-up the held requests wait for the replica's own events, and the run differs.
    unwoken = _cold_start(4, sync_delay_s=0.001, sync_folds={"wake": False})
    assert unwoken["sync_folds"] == {"wake": False}
    assert unwoken["held"] != synced["held"] or unwoken["ttft_p90_s"] != synced["ttft_p90_s"]


def test_with_sync_at_once_every_replica_counts_every_replicas_unanswered_sends() -> None:
    import random

    from poolkeeper.bench.fleet.replica_links import SyncLink
    from poolkeeper.bench.fleet.replica_router import Replica, replica_policy, scheduler_of
    from poolkeeper.scheduling.plugins.backlog_scorer import PrefillBacklogScorer
    from poolkeeper.scheduling.types import LLMRequest
    from tests.scheduling.sched_factories import state

    routers = [Replica(replica_policy("poolkeeper", random.Random(k))) for k in range(4)]
    link = SyncLink(routers, 0.0, {})
    schedulers = [scheduler_of(r) for r in routers]
    backlogs = []
    for s in schedulers:
        assert s is not None
        scorer = s.plugins["prefill-backlog-scorer"]
        assert isinstance(scorer, PrefillBacklogScorer)
        backlogs.append(scorer.backlog)
    pool = [state(i) for i in range(1, 5)]
    rng = random.Random(7)
    live: list[tuple[int, str]] = []  # (replica, request id) not answered or ended
    now = 100.0
    for i in range(200):
        now += 0.001
        k, rid = rng.randrange(4), f"r{i}"
        prompt = f"group {rng.randrange(12)} " * rng.randrange(10, 400) + rid
        request = LLMRequest(rid, "m", "base", prompt=prompt, prompt_tokens=len(prompt) // 4,
                             stream=True)  # fmt: skip
        scheduler = schedulers[k]
        assert scheduler is not None
        scheduler.schedule(request, pool, now=now)
        live.append((k, rid))
        link.flush(now)
        if live and rng.random() < 0.4:
            j, done = live.pop(rng.randrange(len(live)))
            other = schedulers[j]
            assert other is not None
            if rng.random() < 0.7:
                other.observe_first_token(done, None, now)
            else:
                other.request_ended(done)
            link.flush(now)
    # The property: each replica's backlog (own entries + folded ones) is the sum, per
    # endpoint, of every replica's own unanswered sends.
    total: dict[str, int] = {}
    for backlog in backlogs:
        for entry_key, entry in backlog._entries.items():
            if isinstance(entry_key, str):
                total[entry.endpoint] = total.get(entry.endpoint, 0) + entry.tokens
    assert sum(total.values()) > 0
    assert len(live) > 50
    for backlog in backlogs:
        assert len(backlog) == len(live)
        assert dict(backlog.snapshot()) == total


def test_the_replicas_flow_control_reaches_every_replica() -> None:
    """`flow_control` (`--flow-control`) is the replicas' `spec.flowControl`: without the
    hold nothing is held, where the defaults hold new prefixes on this small cold start."""

    def held(flow_control: FlowControlConfig | None) -> int:
        row = run(2, servers=4, duration=2.0, seed=3, capacity_rps=100.0, flow_control=flow_control)
        return int(row["held"])

    assert held(None) > 0
    assert held(FlowControlConfig.model_validate({"holdNewPrefixes": None})) == 0


def test_a_peers_batch_is_never_applied_before_an_own_event_it_precedes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Batches applied only at route/release time, stamped with their due time, moved a drain
    # clock back (a peer's first byte due at 10.5 applied after an own one at 10.7).
    from poolkeeper.scheduling.backlog import PrefillBacklog

    stamps: dict[tuple[int, str], list[float]] = {}
    real = PrefillBacklog.first_token

    def recording(self: PrefillBacklog, request_id: Any, now: float | None = None) -> bool:
        endpoint = self.endpoint_of(request_id)
        if now is not None and endpoint is not None:
            stamps.setdefault((id(self), endpoint), []).append(now)
        return real(self, request_id, now)

    monkeypatch.setattr(PrefillBacklog, "first_token", recording)
    _cold_start(4, sync_delay_s=0.05)
    assert sum(map(len, stamps.values())) > 100
    for times in stamps.values():
        assert times == sorted(times)


def test_a_workload_other_than_shared_prefix_is_replayed_and_named_in_the_row() -> None:
    def row(replicas: int, workload: str) -> dict[str, Any]:
        return run(replicas, servers=4, duration=2.0, seed=3, capacity_rps=100.0,
                   workload=workload)  # fmt: skip

    shared = row(1, "shared-prefix")
    assert "workload" not in shared  # the default's rows are as before
    assert "ttft_p90_by_criticality" not in shared  # one criticality: nothing to split
    mixed = row(1, "mixed-criticality")
    assert mixed["workload"] == "mixed-criticality"
    # Another workload's prompts: no shared system prompts to reuse.
    assert mixed["prefix_hit_rate"] < 0.05 < shared["prefix_hit_rate"]
    by_crit = mixed["ttft_p90_by_criticality"]
    assert {"Critical", "Standard", "Sheddable"} <= set(by_crit)
    assert all(v > 0 for v in by_crit.values())
    # Multi-LoRA runs on servers with its adapters' slots: without them every request fails.
    assert row(2, "multi-lora")["goodput_rps"] > 0


def test_the_replicas_command_takes_a_workload(capsys: pytest.CaptureFixture[str]) -> None:
    import json

    from poolkeeper.bench.fleet.replicas import main

    args = ["--servers", "4", "--duration", "1", "--replicas", "1", "--workload", "heavy-tail"]
    assert main(args) == 0
    (row,) = json.loads(capsys.readouterr().out)
    assert row["workload"] == "heavy-tail"
    with pytest.raises(SystemExit):
        main(["--workload", "no-such-workload"])


def test_the_unseen_part_counts_a_peers_send_in_the_replicas_view() -> None:
    import random

    from poolkeeper.bench.fleet.replica_links import SyncLink
    from poolkeeper.bench.fleet.replica_router import Replica, replica_policy
    from poolkeeper.scheduling.replicasync.events import Sent
    from tests.scheduling.sched_factories import state

    def link(folds: dict[str, bool]) -> tuple[list[Replica], SyncLink]:
        routers = [Replica(replica_policy("poolkeeper", random.Random(k))) for k in range(2)]
        return routers, SyncLink(routers, 0.0, folds)

    plain, lora = [state(1), state(2)], [state(1, active=("sql-lora",)), state(2)]
    cases: list[tuple[list[EndpointState], dict[str, bool], int]] = [
        (plain, {}, 0), (plain, {"unseen": True}, 1), (plain, {"unseen-lora": True}, 1),
        # A pool serving adapters: left alone, as `serve` does, unless the gate is off (A/B).
        (lora, {"unseen": True}, 0), (lora, {"unseen-lora": True}, 1),
    ]  # fmt: skip
    for pool, folds, seen in cases:
        routers, sync = link(folds)
        sync.hubs[0].publish(Sent("r1", pool[0].key, 500, True))
        sync.flush(100.0)  # after the pool's scrape (`state`: 99.99)
        first, second = routers[1].view(pool)
        assert (first.unseen_requests, first.unseen_tokens) == (seen, 500 * seen)
        assert second.unseen_requests == 0
        assert routers[0].view(pool) == pool  # its own send reaches the peers only


def test_a_replicas_view_counts_its_own_requests_per_model_only() -> None:
    # Live, an EPP's in-flight count per target model (flow control's adapter-deferred
    # requests, `flowcontrol/slots.py`) is its own; the fleet's states carry every replica's.
    import random
    from dataclasses import replace
    from types import MappingProxyType

    from poolkeeper.bench.fleet.replica_router import Replica, replica_policy
    from poolkeeper.flowcontrol.slots import deferred
    from tests.scheduling.sched_factories import state

    fleet = replace(
        state(1), inflight_requests=3, inflight_models=MappingProxyType({"a": 2, "b": 1})
    )
    fleet = replace(fleet, metrics=replace(fleet.metrics, waiting_adapters=frozenset({"a"})))
    mine = Replica(replica_policy("poolkeeper", random.Random(0)))
    mine.sent(fleet.key, "r1", 100.0, 10, "a")
    (view,) = mine.view([fleet])
    assert view.inflight_requests == 1
    assert dict(view.inflight_models) == {"a": 1}
    assert deferred(view) == 1  # not the fleet's 2, which left it holding -1 batch slots
    (idle,) = Replica(replica_policy("poolkeeper", random.Random(1))).view([fleet])
    assert (idle.inflight_requests, dict(idle.inflight_models)) == (0, {})
