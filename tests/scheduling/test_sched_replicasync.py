"""Cross-replica sync's core: the hub's outbox and peer table, and the fold into a scheduler."""

from __future__ import annotations

from dataclasses import replace

import pytest

from poolkeeper.datastore.endpoint import EndpointState
from poolkeeper.scheduling.plugins.backlog_scorer import PrefillBacklogScorer
from poolkeeper.scheduling.plugins.prefix_scorer import PrefixCacheScorer
from poolkeeper.scheduling.replicasync.events import Answered, Batch, Ended, Sent
from poolkeeper.scheduling.replicasync.fold import SchedulerFold, bind_scheduler
from poolkeeper.scheduling.replicasync.hub import SEQ_WINDOW, ReplicaSync, clears
from poolkeeper.scheduling.scheduler import Scheduler
from tests.scheduling.sched_factories import NOW, key, request, scheduler, state

A, B = key(1), key(2)
SHARED = "a long shared system prompt " * 100  # 2,800 characters


def _pool(n: int = 4) -> list[EndpointState]:
    return [state(i) for i in range(1, n + 1)]


def _backlog(s: Scheduler) -> PrefillBacklogScorer:
    scorer = s.plugins["prefill-backlog-scorer"]
    assert isinstance(scorer, PrefillBacklogScorer)
    return scorer


def _exact_default() -> Scheduler:
    """The default preset with the prefix scorer's exact index (fed in-process)."""
    from poolkeeper.scheduling.presets import preset_document

    doc = preset_document("default")
    for plugin in doc["plugins"]:
        if plugin["type"] == "prefix-cache-scorer":
            params = plugin.setdefault("parameters", {})
            params.update(kvEvents=True, kvEventsSubscribe=False)
    return scheduler(doc)


# -- the hub ---------------------------------------------------------------------------------


def test_take_batches_what_was_published_with_increasing_sequence_numbers() -> None:
    hub = ReplicaSync("a")
    assert hub.take() is None  # nothing published: nothing to send
    hub.publish(Answered("r1"))
    hub.publish(Ended("r2"))
    assert hub.pending == 2
    assert hub.take() == Batch("a", 1, (Answered("r1"), Ended("r2")))
    assert hub.take() is None
    hub.publish(Ended("r3"))
    assert hub.take() == Batch("a", 2, (Ended("r3"),))


def test_a_full_outbox_drops_its_oldest_events_and_counts_them() -> None:
    hub = ReplicaSync("a", max_outbox=3)
    for i in range(5):
        hub.publish(Ended(f"r{i}"))
    assert hub.dropped == 2
    batch = hub.take()
    assert batch is not None
    assert [e.request_id for e in batch.events] == ["r2", "r3", "r4"]


class _Sink:
    def __init__(self) -> None:
        self.folded: list[tuple[str, object, float]] = []
        self.gone: list[str] = []

    def fold(self, origin: str, event: object, now: float) -> None:
        self.folded.append((origin, event, now))

    def peer_gone(self, origin: str) -> None:
        self.gone.append(origin)


def test_deliver_refuses_own_and_replayed_batches_and_accepts_gaps_and_reordering() -> None:
    hub, sink = ReplicaSync("a"), _Sink()
    hub.bind(sink)
    assert not hub.deliver(Batch("a", 1, (Ended("x"),)), NOW)  # its own, looped back
    assert hub.deliver(Batch("b", 1, (Ended("r1"),)), NOW)
    assert not hub.deliver(Batch("b", 1, (Ended("r1"),)), NOW)  # replayed
    assert hub.deliver(Batch("b", 5, (Ended("r5"),)), NOW)  # datagrams 2-4 lost: fine
    # Reordered: 3 arrives after 5. Dropped, its Answered/Ended would leave a phantom backlog.
    assert hub.deliver(Batch("b", 3, (Ended("r3"),)), NOW)
    assert not hub.deliver(Batch("b", 3, (Ended("r3"),)), NOW)  # but only once
    assert hub.deliver(Batch("b", 5 + SEQ_WINDOW, (Ended("r"),)), NOW)
    assert not hub.deliver(Batch("b", 4, (Ended("r4"),)), NOW)  # too far behind to tell
    assert hub.refused == 4
    folded = [e for _, e, _ in sink.folded]
    assert folded == [Ended("r1"), Ended("r5"), Ended("r3"), Ended("r")]


def test_quiet_peers_expire_and_the_origin_table_is_bounded() -> None:
    hub, sink = ReplicaSync("a", max_peers=2, peer_ttl_s=10.0), _Sink()
    hub.bind(sink)
    assert hub.deliver(Batch("b", 1, ()), NOW)
    assert hub.deliver(Batch("c", 1, ()), NOW + 5)
    assert not hub.deliver(Batch("d", 1, ()), NOW + 6)  # a third origin: the table is full
    assert hub.peers() == ["b", "c"]
    assert hub.expire(NOW + 10) == ["b"]  # silent for 10 s
    assert sink.gone == ["b"]
    assert hub.deliver(Batch("d", 1, ()), NOW + 11)  # room again
    # A restarted "b" starts again at seq 1: heard once its old entry expired.
    assert hub.deliver(Batch("b", 1, ()), NOW + 12) is False  # table full (c, d)
    hub.expire(NOW + 15)  # c goes
    assert hub.deliver(Batch("b", 1, ()), NOW + 15)


def test_a_batch_clears_a_backlog_when_it_ends_a_prefill() -> None:
    assert not clears(Batch("b", 1, (Sent("r", A, 10, True),)))
    assert clears(Batch("b", 1, (Sent("r", A, 10, True), Answered("q"))))
    assert clears(Batch("b", 1, (Ended("q"),)))


def test_bad_hub_settings_are_refused() -> None:
    with pytest.raises(ValueError, match="origin"):
        ReplicaSync("")
    with pytest.raises(ValueError, match="positive"):
        ReplicaSync("a", max_outbox=0)


# -- the fold --------------------------------------------------------------------------------


def test_own_decisions_first_bytes_and_ends_are_published() -> None:
    s = _exact_default()
    hub = ReplicaSync("a")
    bind_scheduler(hub, s)
    pool = _pool()
    req = request(prompt=SHARED + "q1", request_id="q1")
    picked = s.schedule(req, pool, now=NOW).primary.key
    s.schedule(request(prompt=SHARED + "q2", request_id="q2"), pool, now=NOW)
    s.observe_first_token("q1", picked, NOW + 0.1)
    s.observe_first_token("nobody", picked, NOW + 0.1)  # never counted: not told
    s.request_ended("q2")
    batch = hub.take()
    assert batch is not None
    sent, sent2, answered, ended = batch.events
    assert isinstance(sent, Sent)
    assert isinstance(sent2, Sent)
    assert (sent.request_id, sent.endpoint, sent.seen) == ("q1", picked, False)
    assert sent.tokens == req.prompt_tokens  # nothing cached yet
    assert len(sent.blocks) == len(SHARED + "q1") // 64
    assert sent.head is not None
    # q2 shares the prompt: its tokens there are the uncached rest.
    assert 0 < sent2.tokens < req.prompt_tokens // 10
    assert (answered, ended) == (Answered("q1"), Ended("q2"))


def test_a_peers_sends_count_in_the_backlog_index_and_pending_heads_until_answered() -> None:
    peer, mine = _exact_default(), _exact_default()
    out, hub = ReplicaSync("b"), ReplicaSync("a")
    bind_scheduler(out, peer)
    bind_scheduler(hub, mine)
    pool = _pool()
    req = replace(request(prompt=SHARED + "q1", request_id="q1"), stream=True)
    picked = peer.schedule(req, pool, now=NOW).primary.key
    batch = out.take()
    assert batch is not None
    assert hub.deliver(batch, NOW + 0.01)
    backlog = _backlog(mine).backlog
    assert backlog.tokens(picked) == req.prompt_tokens
    assert backlog.seen_snapshot() == {picked: req.prompt_tokens}
    prefix = _backlog(mine).prefix
    assert isinstance(prefix, PrefixCacheScorer)
    assert prefix.exact is not None
    assert prefix.exact.heads(picked, NOW + 0.01) == 1
    # The group's next request, at this replica, goes where the peer placed the first.
    nxt = request(prompt=SHARED + "q2", request_id="q2")
    assert mine.schedule(nxt, pool, now=NOW + 0.02).primary.key == picked
    peer.observe_first_token("q1", picked, NOW + 0.2)
    batch = out.take()
    assert batch is not None
    hub.deliver(batch, NOW + 0.21)
    # Answered: the peer's entry is gone; this replica's own q2 (a few uncached tokens) stays.
    assert backlog.tokens(picked) < req.prompt_tokens // 10
    assert len(backlog) == 1


def test_a_quiet_peers_entries_stop_counting() -> None:
    mine = _exact_default()
    hub = ReplicaSync("a", peer_ttl_s=5.0)
    bind_scheduler(hub, mine)
    hub.deliver(Batch("b", 1, (Sent("x", A, 3000, True),)), NOW)
    backlog = _backlog(mine).backlog
    assert backlog.tokens(A) == 3000
    hub.expire(NOW + 5)
    assert backlog.tokens(A) == 0
    assert len(backlog) == 0


def test_peers_may_name_at_most_max_endpoints() -> None:
    mine = _exact_default()
    hub = ReplicaSync("a")
    fold = bind_scheduler(hub, mine)
    fold.max_endpoints = 2
    events = tuple(Sent(f"r{i}", key(i), 10, True) for i in range(1, 4))
    hub.deliver(Batch("b", 1, events), NOW)
    assert fold.ignored == 1
    assert set(_backlog(mine).backlog.snapshot()) == {key(1), key(2)}
    fold.forget_endpoints({key(1), key(3)})  # the pool is known now: key(2) left it
    hub.deliver(Batch("b", 2, (Sent("r9", key(3), 10, True),)), NOW)
    assert set(_backlog(mine).backlog.snapshot()) == {key(1), key(3)}


def test_a_bound_hub_without_peers_changes_no_decision() -> None:
    plain, synced = _exact_default(), _exact_default()
    hub = ReplicaSync("a")
    bind_scheduler(hub, synced)
    pool = _pool()
    for i in range(60):
        prompt = f"group {i % 7} " * 120 + f"question {i}"
        now = NOW + i * 0.01
        one = plain.schedule(request(prompt=prompt, request_id=f"r{i}"), pool, now=now)
        two = synced.schedule(request(prompt=prompt, request_id=f"r{i}"), pool, now=now)
        assert one.primary.key == two.primary.key
        assert one.scores == two.scores
        if i % 3 == 0:
            plain.observe_first_token(f"r{i - 1}", None, now)
            synced.observe_first_token(f"r{i - 1}", None, now)
    assert hub.take() is not None  # it did publish


def test_a_scheduler_without_a_backlog_scorer_cannot_be_bound() -> None:
    with pytest.raises(ValueError, match="prefill-backlog-scorer"):
        bind_scheduler(ReplicaSync("a"), scheduler("classic"))


def test_unbind_stops_publishing() -> None:
    s = _exact_default()
    hub = ReplicaSync("a")
    fold = bind_scheduler(hub, s)
    assert isinstance(fold, SchedulerFold)
    fold.unbind()
    s.schedule(request(prompt=SHARED, request_id="q"), _pool(), now=NOW)
    assert hub.take() is None


def test_every_decision_is_published_even_when_a_request_id_repeats() -> None:
    # Client x-request-ids can repeat; a dedup by the cycle's id() skipped some (ids reused).
    s = _exact_default()
    hub = ReplicaSync("a", max_outbox=1000)
    bind_scheduler(hub, s)
    pool = _pool()
    for i in range(200):
        s.schedule(request(prompt=f"prompt {i} " * 20, request_id="same"), pool, now=NOW + i)
    batch = hub.take()
    assert batch is not None
    assert sum(isinstance(e, Sent) for e in batch.events) == 200


def test_peers_sends_outside_the_pool_are_ignored_and_a_shrinking_pool_drops_their_entries() -> (
    None
):
    mine = _exact_default()
    hub = ReplicaSync("a")
    fold = bind_scheduler(hub, mine, pool={A, B})
    head = 12345
    events = (
        Sent("r1", A, 100, True, (1, 2, 3), head),
        Sent("r2", B, 200, True, (4, 5, 6), head),
        Sent("r3", key(9), 300, True, (7, 8, 9), head),  # not in this replica's pool
    )
    assert hub.deliver(Batch("b", 1, events), NOW)
    backlog = _backlog(mine).backlog
    prefix = _backlog(mine).prefix
    assert prefix is not None
    assert prefix.exact is not None
    assert fold.ignored == 1
    assert dict(backlog.snapshot()) == {A: 100, B: 200}
    assert prefix.exact.heads(key(9), NOW) == 0
    assert prefix.index.match((7, 8, 9)).get(key(9), 0) == 0
    fold.forget_endpoints({A})  # B left the pool: peers' entries there go
    assert dict(backlog.snapshot()) == {A: 100}
    # Peers' blocks and pending heads cannot be told from own ones: they stay until the
    # scheduler's own forgetter drops B (with its grace), not at the fold's first event.
    assert prefix.exact.heads(B, NOW) == 1
    assert prefix.index.match((4, 5, 6)).get(B, 0) == 3
    hub.deliver(Batch("b", 2, (Sent("r4", B, 50, True),)), NOW)
    assert B not in backlog.snapshot()  # and stays out


def test_a_batch_gives_at_most_one_drain_sample_per_endpoint() -> None:
    mine = _exact_default()
    hub = ReplicaSync("a")
    bind_scheduler(hub, mine)
    backlog = _backlog(mine).backlog
    sends = tuple(Sent(f"r{i}", A, 1000, True) for i in range(4))
    hub.deliver(Batch("b", 1, sends), NOW)
    hub.deliver(Batch("b", 2, tuple(Answered(f"r{i}") for i in range(4))), NOW + 1.0)
    drain = backlog._drain[A]
    assert drain.samples == 1  # not 4: the other three would add 3,000 tokens over 0 s
    assert len(backlog) == 0  # all four cleared


def test_two_backlog_scorers_in_one_profile_tell_each_event_once() -> None:
    from poolkeeper.scheduling.presets import preset_document

    doc = preset_document("default")
    doc["plugins"].append(
        {"type": "prefill-backlog-scorer", "name": "second-backlog", "parameters": {}}
    )
    doc["schedulingProfiles"][0]["plugins"].append({"pluginRef": "second-backlog", "weight": 1})
    s = scheduler(doc)
    hub = ReplicaSync("a")
    fold = bind_scheduler(hub, s)
    second = s.plugins["second-backlog"]
    assert isinstance(second, PrefillBacklogScorer)
    assert fold.backlogs == (_backlog(s), second)  # both record own sends: both fold peers'
    assert _backlog(s).sync is fold
    assert second.sync is None
    s.schedule(replace(request(prompt=SHARED, request_id="q"), stream=True), _pool(), now=NOW)
    s.observe_first_token("q", None, NOW + 0.1)
    s.request_ended("q")
    batch = hub.take()
    assert batch is not None
    assert [type(e) for e in batch.events] == [Sent, Answered]  # once each; no Ended after it


def test_an_empty_batch_keeps_its_origin_heard() -> None:
    mine = _exact_default()
    hub = ReplicaSync("a", peer_ttl_s=30.0)
    bind_scheduler(hub, mine)
    hub.deliver(Batch("b", 1, (Sent("long", A, 3000, True),)), NOW)
    for k in range(1, 7):  # a heartbeat every 10 s, the request still in flight
        assert hub.deliver(Batch("b", 1 + k, ()), NOW + 10.0 * k)
    hub.expire(NOW + 65.0)
    assert _backlog(mine).backlog.tokens(A) == 3000
    assert hub.peers() == ["b"]


def test_a_shrinking_pool_leaves_this_replicas_own_state_to_the_scheduler() -> None:
    # A readiness flap seen for one event must not erase own entries, measured drain rates or
    # own prefix blocks: that is the scheduler's forgetter's call, with its grace.
    mine = _exact_default()
    hub = ReplicaSync("a")
    fold = bind_scheduler(hub, mine, pool={A, B})
    backlog = _backlog(mine).backlog
    backlog.min_samples = 1
    for i in range(3):  # own sends to A, answered: a drain rate measured there
        backlog.sent(f"m{i}", A, 1000, NOW + i)
        backlog.first_token(f"m{i}", NOW + i + 0.5)
    backlog.sent("own", A, 500, NOW + 10)
    hub.deliver(Batch("b", 1, (Sent("peer", A, 200, True, (4, 5, 6)),)), NOW + 10)
    rates, own = backlog.rates(), backlog.own_ids()
    assert A in rates
    assert backlog.tokens(A) == 700
    fold.forget_endpoints({B})  # A absent for one event
    assert backlog.own_ids() == own == ["own"]
    assert backlog.rates() == rates
    assert backlog.tokens(A) == 500  # the peer's entry went, the own one stays
    assert backlog.endpoint_of(("b", "peer")) is None
    prefix = _backlog(mine).prefix
    assert prefix is not None
    assert prefix.index.match((4, 5, 6)).get(A, 0) == 3  # the index is left alone
