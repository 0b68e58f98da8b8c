"""The pure part of scripts/step_signal.py: step ends from a step, matching, percentiles."""

from __future__ import annotations

import pytest

from poolkeeper.bench.live.step_signal import (
    Matched,
    StepEnd,
    delays_ms,
    earliest_per_step,
    join,
    learned_fraction,
    minus,
    sim_id,
    step_end,
)
from poolkeeper.sim.batch import Step
from poolkeeper.sim.request import RequestStatus, SimRequest


def _request(rid: str, *, prompt: int, out: int, computed: int, produced: int) -> SimRequest:
    request = SimRequest(rid, "m", None, prompt, out, 0.0, [], status=RequestStatus.RUNNING)
    request.num_computed, request.output_tokens = computed, produced
    if produced:
        request.last_token_time = 0.0
    return request


def test_step_end_names_first_and_last_tokens() -> None:
    prefilled = _request("a", prompt=10, out=5, computed=0, produced=0)  # whole prefill: first
    chunked = _request("b", prompt=100, out=5, computed=0, produced=0)  # a chunk: no token
    finishing = _request("c", prompt=10, out=3, computed=12, produced=2)  # last decode
    decoding = _request("d", prompt=10, out=9, computed=12, produced=2)
    one_token = _request("e", prompt=4, out=1, computed=0, produced=0)  # first and last at once
    gone = _request("f", prompt=4, out=1, computed=0, produced=0)
    gone.status = RequestStatus.ABORTED
    step = Step(1.0, 1.5, [(prefilled, 10), (chunked, 50), (finishing, 1), (decoding, 1),
                           (one_token, 4), (gone, 4)])  # fmt: skip
    got = step_end("sim-0", step, 1.6)
    assert got == StepEnd("sim-0", 1.5, 1.6, ("a", "e"), ("c", "e"))


def test_sim_id() -> None:
    assert sim_id("chatcmpl-sim-1-7") == "sim-1-7"
    assert sim_id("cmpl-sim-1-7") is None
    assert sim_id("chatcmpl-") is None


def _epp(kind: str, rid: str | None, mono: float, **more: float) -> dict[str, object]:
    return {"kind": kind, "rid": rid, "mono": mono, "wall": mono + 1000.0, **more}


def test_join_matches_each_request_and_moves_envoy_stamps_to_monotonic() -> None:
    steps = [
        StepEnd("sim-0", 10.0, 10.001, ("sim-0-0",)),
        StepEnd("sim-0", 10.010, 10.010),  # nobody's first or last: not learnt
        StepEnd("sim-0", 10.020, 10.022, (), ("sim-0-0",)),
        StepEnd("sim-1", 10.005, 10.005, ("sim-1-0",)),  # its request got no EPP record
    ]
    epp = [
        _epp("first", "t0", 10.004),
        _epp("first", "t0", 10.009),  # a second report: the first one counts
        _epp(
            "end",
            "t0",
            10.040,
            start=1009.0,
            time_to_first_upstream_rx_byte=1.0005,
            time_to_last_upstream_rx_byte=1.021,
            lua_first_ms=1010002.0,
        ),
        _epp("first", None, 10.006),  # an exchange without a tag: ignored
    ]
    client = {"t0": "sim-0-0", "t1": "sim-1-0", "t2": "sim-9-9"}  # t2: no step recorded
    matched = {m.rid: m for m in join(steps, client, epp)}
    assert set(matched) == {"t0", "t1"}
    m = matched["t0"]
    assert (m.server, m.first_step, m.last_step) == ("sim-0", 10.0, 10.020)
    assert m.first_delay == pytest.approx(0.004)
    assert m.end_delay == pytest.approx(0.020)
    assert (m.first_lag, m.last_lag) == pytest.approx((0.001, 0.002))
    # wall - mono = 1000 s: Envoy's 1009 + 1.0005 is 10.0005 on monotonic, 0.5 ms after the step
    assert m.upstream_first_stamp == pytest.approx(0.0005)
    assert m.upstream_last_stamp == pytest.approx(0.001)
    assert m.lua_first_stamp == pytest.approx(0.002)
    other = matched["t1"]
    assert (other.first_delay, other.end_delay, other.last_step) == (None, None, None)
    assert learned_fraction(steps, matched.values()) == {
        "all": 0.5, "sim-0": pytest.approx(2 / 3), "sim-1": 0.0,
    }  # fmt: skip


def test_earliest_per_step() -> None:
    def m(rid: str, first: float, delay: float | None, lua: float | None) -> Matched:
        return Matched(rid, "sim-0", first, 2.0, 0.0, 0.0, delay, 0.05, lua, None, 0.01)

    got = earliest_per_step([m("a", 1.0, 0.004, 0.002), m("b", 1.0, 0.003, 0.0025),
                             m("c", 1.5, None, None)])  # fmt: skip
    # step 1.0: two reports (3 and 4 ms) and stamps (2, 2.5 ms); step 2.0: the ends (50 ms,
    # 10 ms stamps, all three); step 1.5: nothing learnt
    assert sorted(got["report"]) == pytest.approx([0.003, 0.05])
    assert sorted(got["stamp"]) == pytest.approx([0.002, 0.01])


def test_join_without_epp_records_matches_steps_only() -> None:
    matched = join([StepEnd("sim-0", 1.0, 1.0, ("x",))], {"t": "x"}, [])
    assert [(m.rid, m.first_delay, m.lua_first_stamp) for m in matched] == [("t", None, None)]


def test_minus() -> None:
    assert minus(3.0, 1.0) == 2.0
    assert minus(None, 1.0) is None
    assert minus(1.0, None) is None


def test_delays_ms() -> None:
    assert delays_ms([None]) == {"n": 0}
    got = delays_ms([i / 1000 for i in range(101)] + [None])
    assert got["n"] == 101
    assert (got["min"], got["p10"], got["p50"], got["p90"], got["max"]) == pytest.approx(
        (0.0, 10.0, 50.0, 90.0, 100.0)
    )
    assert got["p99"] == pytest.approx(99.0)


def test_kv_lateness_matches_batches_by_port_and_stamp() -> None:
    from poolkeeper.bench.live.step_signal import kv_lateness

    published = [
        {"port": 8000, "end": 10.0, "pub": 10.001, "ts": 1000.001},
        {"port": 8001, "end": 10.0, "pub": 10.003, "ts": 1000.003},
    ]
    received = [
        {"kind": "kv", "endpoint": "127.0.0.1:8000", "ts": 1000.001, "wall": 1000.004},
        {
            "kind": "kv",
            "endpoint": "127.0.0.1:8001",
            "ts": 1000.003,
            "wall": 1000.010,
            "applied": 1000.013,
        },
        {"kind": "kv", "endpoint": "127.0.0.1:8001", "ts": 999.0, "wall": 999.5},  # no match
    ]
    probe = [{"port": 8001, "ts": 1000.003, "wall": 1000.004}]
    out = kv_lateness(published, received, probe, steps=4)
    assert (out["batches"], out["received"], out["probed"]) == (2, 2, 1)
    assert out["steps_publishing"] == 0.5
    assert out["publisher_lag_ms"]["max"] == pytest.approx(3.0)
    assert out["epp_late_ms"]["max"] == pytest.approx(7.0)
    assert out["epp_late_ms"]["min"] == pytest.approx(3.0)
    assert out["epp_applied_ms"]["max"] == pytest.approx(10.0)
    assert out["probe_late_ms"]["n"] == 1
    assert out["epp_after_probe_ms"]["max"] == pytest.approx(6.0)
