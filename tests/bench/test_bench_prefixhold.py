"""`poolkeeper-fade-early-hold`: flow control's `holdNewPrefixes` on the virtual fleet, with the
facts read from the real scheduler (its prefix index and prefill backlog)."""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import replace

import pytest

from poolkeeper.api.criticality import Criticality
from poolkeeper.bench.policies.flowpolicy import FlowPolicy, SendFn, flow_policy
from poolkeeper.bench.policies.routers import make_policy
from poolkeeper.datastore.endpoint import Endpoint, EndpointMetrics, EndpointState
from poolkeeper.flowcontrol.config import FlowControlConfig
from poolkeeper.scheduling.types import LLMRequest

SYSTEM = 2100  # tokens of a group's system prompt: one prefill over the 2,048 backlog


def _pool() -> list[EndpointState]:
    return [
        EndpointState(
            Endpoint(f"s{i}", f"10.0.0.{i}", 8000),
            EndpointMetrics(updated_at=1.0, served_model="m"),
        )
        for i in (1, 2)
    ]


def _request(rid: str, group: str, user: str = "", tokens: int = SYSTEM) -> LLMRequest:
    """A prompt of `group`'s system prompt (distinct per group from its first block) and a
    short user part."""
    system = (f"[{group}] you are helpful. " * 400)[: 4 * SYSTEM]
    prompt = system + user
    return LLMRequest(  # streamed, as the simulator's: the hold reads seen first bytes only
        rid, "m", "m", prompt=prompt, prompt_tokens=tokens + len(user) // 4, max_tokens=8,
        stream=True,
    )  # fmt: skip


def _policy(name: str = "poolkeeper-fade-early-hold") -> FlowPolicy:
    policy = make_policy(name, random.Random(1))
    assert isinstance(policy, FlowPolicy)
    return policy


def _backlogged(policy: FlowPolicy, pool: Sequence[EndpointState]) -> dict[str, str]:
    """Two cold prefixes sent, one to each endpoint, no first byte back: every endpoint has
    a 2,100-token backlog. Returns group -> endpoint key."""
    where: dict[str, str] = {}
    for group in ("a", "b"):
        chosen = policy.offer(_request(f"{group}0", group), pool, now=1.0)
        assert chosen is not None  # nothing backlogged yet (or only one endpoint): not held
        where[group] = chosen.key
    assert sorted(where.values()) == sorted(s.key for s in pool)
    return where


def _sent() -> tuple[list[tuple[str, str | None, str | None]], SendFn]:
    out: list[tuple[str, str | None, str | None]] = []

    def send(rid: str, ep: EndpointState | None, err: str | None) -> None:
        out.append((rid, None if ep is None else ep.key, err))

    return out, send


def test_a_new_prefix_is_held_while_every_endpoint_is_backlogged_and_placed_ones_pass() -> None:
    policy, pool = _policy(), _pool()
    assert policy.hold is not None
    where = _backlogged(policy, pool)
    assert policy.offer(_request("c0", "c"), pool, now=1.1) is None  # opens prefix c: held
    assert policy.hold.waiting() == 1
    # Behind it, a request whose prefix is placed goes at once, to its holder.
    chosen = policy.offer(_request("a1", "a", user=" hi there"), pool, now=1.2)
    assert chosen is not None
    assert chosen.key == where["a"]
    assert policy.hold.waiting() == 1
    assert policy.summary()["held"] == 1


def test_not_held_when_an_endpoint_is_under_the_backlog() -> None:
    policy, pool = _policy(), _pool()
    where = _backlogged(policy, pool)
    policy.on_first_token("b0", now=1.3)  # b's prefill is over: that endpoint has no backlog
    chosen = policy.offer(_request("c0", "c"), pool, now=1.4)
    assert chosen is not None
    assert chosen.key == where["b"]
    assert policy.hold is not None
    assert policy.hold.total == 0


def test_held_request_is_released_when_a_backlog_falls() -> None:
    policy, pool = _policy(), _pool()
    _backlogged(policy, pool)
    assert policy.offer(_request("c0", "c"), pool, now=1.1) is None
    sent, send = _sent()
    policy.release(pool, 1.2, send)
    assert sent == []  # still every endpoint backlogged
    policy.on_first_token("a0", now=1.3)
    policy.release(pool, 1.3, send)
    assert [(rid, err) for rid, _ep, err in sent] == [("c0", None)]
    assert sent[0][1] is not None
    assert policy.waited["c0"] > 0.19  # held 0.2 s, counted as the router's wait
    assert policy.hold is not None
    assert policy.hold.waiting() == 0


def test_held_request_is_released_at_the_cap() -> None:
    config = FlowControlConfig.model_validate({"holdNewPrefixes": {"maxHoldMs": 500}})
    policy, pool = _policy_with(config), _pool()
    _backlogged(policy, pool)
    assert policy.offer(_request("c0", "c"), pool, now=1.1) is None
    sent, send = _sent()
    policy.release(pool, 1.59, send)
    assert sent == []
    policy.release(pool, 1.6, send)  # backlogs unchanged
    assert [rid for rid, ep, _err in sent if ep is not None] == ["c0"]


def _policy_with(config: FlowControlConfig) -> FlowPolicy:
    policy = flow_policy("poolkeeper-fade-early", random.Random(1), config)
    assert isinstance(policy, FlowPolicy)
    return policy


def test_on_by_default_off_with_null_and_the_same_decisions() -> None:
    assert _policy("poolkeeper").hold is not None  # the default holds (flow control's default)
    assert _policy("poolkeeper-classic").hold is None  # the default before the switch
    off = FlowControlConfig.model_validate({"holdNewPrefixes": None})
    plain, pool = flow_policy("poolkeeper-fade-early", random.Random(1), off), _pool()
    assert isinstance(plain, FlowPolicy)
    assert plain.hold is None
    assert plain.config.hold_new_prefixes is None
    _backlogged(plain, pool)
    assert plain.offer(_request("c0", "c"), pool, now=1.1) is not None  # not held
    # With the hold on and no endpoint backlogged (every first byte back at once), the
    # decisions are the plain candidate's, one by one.
    a, b = flow_policy("poolkeeper-fade-early", random.Random(1), off), _policy()
    assert isinstance(a, FlowPolicy)
    pa, pb = _pool(), _pool()
    for i in range(30):
        req = _request(f"r{i}", f"g{i % 7}", user=f" q{i}")
        ca, cb = a.offer(req, pa, now=1.0 + i / 10), b.offer(req, pb, now=1.0 + i / 10)
        assert ca is not None
        assert cb is not None
        assert ca.key == cb.key
        for p in (a, b):
            p.on_first_token(req.request_id, now=1.0 + i / 10)
    assert b.hold is not None
    assert b.hold.total == 0


def test_a_shed_band_is_never_held_and_a_hold_needs_flow_control() -> None:
    """A `shed` band's request is decided at once (sent, or its 429), never held; a hold
    without flow control would silently not run, so it is refused."""
    config = FlowControlConfig.model_validate(
        {"bands": {"sheddable": {"mode": "shed"}}, "holdNewPrefixes": {}}
    )
    policy, pool = flow_policy("poolkeeper-fade-early", random.Random(1), config), _pool()
    assert isinstance(policy, FlowPolicy)
    assert policy.hold is not None
    _backlogged(policy, pool)
    shed = replace(_request("c0", "c"), criticality=Criticality.SHEDDABLE)
    # Decided now (here dispatched: the endpoints have slots), where a queue band's is held.
    assert policy.offer(shed, pool, now=1.1) is not None
    assert policy.hold.waiting() == 0
    assert policy.offer(_request("d0", "d"), pool, now=1.2) is None  # Standard: held
    with pytest.raises(ValueError, match="holdNewPrefixes needs flow control"):
        FlowControlConfig.model_validate({"enabled": False, "holdNewPrefixes": {}})
    with pytest.raises(ValueError, match="needs enabled: true"):
        flow_policy(
            "poolkeeper-fade-early-hold", random.Random(1), FlowControlConfig(enabled=False)
        )


def test_the_fleet_releases_on_first_tokens_only_while_the_hold_is_on() -> None:
    """The EPP's Director wakes the pump on each first byte while `holdNewPrefixes` is on (a
    prefill ended: a held request may go); the virtual fleet does the same for such a policy
    only, so a queue without the hold still waits for completions and scrape ticks."""
    held = flow_policy("poolkeeper-fade-early", random.Random(1), FlowControlConfig())
    unheld = flow_policy(
        "poolkeeper-fade-early", random.Random(1),
        FlowControlConfig.model_validate({"holdNewPrefixes": None}),
    )  # fmt: skip
    assert isinstance(held, FlowPolicy)
    assert isinstance(unheld, FlowPolicy)
    assert held.wakes_on_first_token
    assert not unheld.wakes_on_first_token


class _Stopped(Exception):
    """Raised by the stand-in `VirtualFleet.run` once it has seen its arguments."""


def test_both_drivers_ask_the_fleet_for_first_token_releases_only_with_the_hold(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The property alone (above) is not enough: each driver must pass it to the fleet.
    from poolkeeper.bench.fleet import replica_run, simrun
    from poolkeeper.sim.params import EngineConfig
    from poolkeeper.sim.virtual import VirtualFleet

    asked: list[object] = []

    def run(self: VirtualFleet, *args: object, **kwargs: object) -> None:
        asked.append(kwargs.get("release_on_first_token"))
        raise _Stopped

    monkeypatch.setattr(VirtualFleet, "run", run)
    holds: list[dict[str, object] | None] = [{}, None]
    for hold in holds:
        config = FlowControlConfig.model_validate({"holdNewPrefixes": hold})
        policy = flow_policy("poolkeeper", random.Random(1), config)
        with pytest.raises(_Stopped):
            simrun.replay([EngineConfig()], [], policy, seed=1)
    with pytest.raises(_Stopped):  # the replica driver runs the default (the hold on)
        replica_run.run(1, servers=2, duration=1.0, capacity_rps=10.0)
    assert asked == [True, False, True]
