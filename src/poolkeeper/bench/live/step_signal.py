"""How late, and how spread, the EPP learns a simulated engine's step ends (the pure part).

`scripts/step_signal.py` runs simulated servers, `poolkeeper serve` (Envoy + EPP) and an
open-loop client, and writes three record streams; this module turns them into the numbers
(docs/notes/2026-12-07-step-signal-timing.md):

- the engines' steps (`step_end`: one `StepEnd` per step, from the engine's bench-only
  `step_observer`): the step's end on the engine's clock (`loop.time()`, i.e. the system-wide
  CLOCK_MONOTONIC), when the driver delivered it, and which requests got their first token
  or their last in it (by the simulator's request id);
- the client's requests: its `x-request-id` and the simulator's id read back from the
  stream's `id` field;
- the EPP's observations (`extproc/signal_tap.py`): per request id, when the first-byte
  report and the access-log entry arrived (monotonic), and the entry's Envoy stamps (wall
  clock; turned to monotonic with the wall - monotonic offset the EPP's own records show).

`join` matches them per request; `delays_ms` summarises a list of seconds as p50 / p90 / p99
in milliseconds; `learned_fraction` is the share of steps whose end the EPP learns at all (a
step with a first token or a last token of a request it routed).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from poolkeeper.bench.results.paired import quantile
from poolkeeper.sim.batch import Step
from poolkeeper.sim.request import RequestStatus

RESPONSE_ID_PREFIX = "chatcmpl-"  # the simulator's chat response id: this + its request id


@dataclass(frozen=True, slots=True)
class StepEnd:
    """One engine step as it ended (the times on CLOCK_MONOTONIC, seconds)."""

    server: str
    end: float  # the step's modelled end
    delivered: float  # when the driver handed its tokens out (>= end: the loop is late)
    firsts: tuple[str, ...] = ()  # requests whose first token this step produced
    lasts: tuple[str, ...] = ()  # requests this step finished

    def as_record(self) -> dict[str, Any]:
        return {"server": self.server, "end": self.end, "delivered": self.delivered,
                "firsts": list(self.firsts), "lasts": list(self.lasts)}  # fmt: skip


def step_end(server: str, step: Step, delivered: float) -> StepEnd:
    """The `StepEnd` of `step`, told to the engine's `step_observer` before its tokens are
    applied: a scheduled request gets a token when the step computes the last token of its
    sequence (`BatchCore._complete`), its first if it had none, its last if that reaches
    `max_tokens`."""
    firsts: list[str] = []
    lasts: list[str] = []
    for request, n in step.scheduled:
        if request.status is not RequestStatus.RUNNING:
            continue  # cancelled during the step
        if request.num_computed + n < request.prompt_tokens + request.output_tokens:
            continue  # a prefill chunk short of the end of the sequence
        if request.last_token_time is None:
            firsts.append(request.request_id)
        if request.output_tokens + 1 >= request.max_tokens:
            lasts.append(request.request_id)
    return StepEnd(server, step.end, delivered, tuple(firsts), tuple(lasts))


def sim_id(response_id: str) -> str | None:
    """The simulator's request id in a chat stream's `id` (None for another server's id)."""
    if not response_id.startswith(RESPONSE_ID_PREFIX):
        return None
    return response_id[len(RESPONSE_ID_PREFIX) :] or None


@dataclass(frozen=True, slots=True)
class Matched:
    """One request's step ends and what the EPP learnt of them (seconds; None: not seen).

    `*_delay`: the EPP's receive time minus the step's end; `*_stamp`: an Envoy stamp (on
    monotonic) minus the step's end; `lua_first_stamp` is the Lua filter's whole-ms stamp."""

    rid: str
    server: str
    first_step: float
    last_step: float | None
    first_lag: float  # the driver's delivery of the first token's step, after its end
    last_lag: float | None
    first_delay: float | None
    end_delay: float | None
    lua_first_stamp: float | None
    upstream_first_stamp: float | None
    upstream_last_stamp: float | None


def wall_offset(epp: Iterable[Mapping[str, Any]]) -> float:
    """Wall clock minus monotonic clock, the median of the EPP records' pairs (both read
    together there): what turns Envoy's wall-clock stamps into monotonic time."""
    offsets = [r["wall"] - r["mono"] for r in epp]
    if not offsets:
        raise ValueError("no EPP records: cannot relate Envoy's wall clock to monotonic time")
    return quantile(offsets, 0.5)


def join(
    steps: Iterable[StepEnd],
    client: Mapping[str, str],
    epp: Sequence[Mapping[str, Any]],
) -> list[Matched]:
    """Each request the client sent (`client`: its request id -> the simulator's id) whose
    first token the engines recorded, with the EPP's records for the same request id."""
    firsts: dict[str, StepEnd] = {}
    lasts: dict[str, StepEnd] = {}
    for step in steps:
        for sid in step.firsts:
            firsts.setdefault(sid, step)
        for sid in step.lasts:
            lasts.setdefault(sid, step)
    seen_first: dict[str, float] = {}
    ends: dict[str, Mapping[str, Any]] = {}
    for record in epp:
        rid = record.get("rid")
        if not isinstance(rid, str):
            continue
        if record["kind"] == "first":
            seen_first.setdefault(rid, record["mono"])
        elif record["kind"] == "end":
            ends.setdefault(rid, record)
    offset = wall_offset(epp) if epp else 0.0
    out: list[Matched] = []
    for rid, sid in client.items():
        first = firsts.get(sid)
        if first is None:
            continue
        last = lasts.get(sid)
        end = ends.get(rid)
        lua = None
        if end is not None and "lua_first_ms" in end:
            lua = end["lua_first_ms"] / 1000.0 - offset - first.end
        out.append(
            Matched(
                rid=rid,
                server=first.server,
                first_step=first.end,
                last_step=None if last is None else last.end,
                first_lag=first.delivered - first.end,
                last_lag=None if last is None else last.delivered - last.end,
                first_delay=seen_first[rid] - first.end if rid in seen_first else None,
                end_delay=None if end is None or last is None else end["mono"] - last.end,
                lua_first_stamp=lua,
                upstream_first_stamp=_stamp(end, "time_to_first_upstream_rx_byte", first, offset),
                upstream_last_stamp=_stamp(end, "time_to_last_upstream_rx_byte", last, offset),
            )
        )
    return out


def _stamp(
    entry: Mapping[str, Any] | None, name: str, step: StepEnd | None, offset: float
) -> float | None:
    """Envoy's stamp `name` (a duration from the entry's wall-clock start) on monotonic time,
    minus `step`'s end; None when either is missing."""
    if entry is None or step is None or name not in entry:
        return None
    return float(entry["start"] + entry[name] - offset - step.end)


def minus(a: float | None, b: float | None) -> float | None:
    """`a - b`, None if either is (a part of a delay that was not seen)."""
    return None if a is None or b is None else a - b


def delays_ms(values: Iterable[float | None]) -> dict[str, float]:
    """p10 / p50 / p90 / p99 (and min, max, count) of the seconds in `values`, in ms; None
    skipped."""
    seen = [v * 1000.0 for v in values if v is not None]
    if not seen:
        return {"n": 0}
    return {"n": len(seen), "min": min(seen), "p10": quantile(seen, 0.1),
            "p50": quantile(seen, 0.5),
            "p90": quantile(seen, 0.9), "p99": quantile(seen, 0.99),
            "max": max(seen)}  # fmt: skip


def earliest_per_step(matched: Iterable[Matched]) -> dict[str, list[float]]:
    """Per step whose end the EPP learns, the earliest of what it has for that step (seconds
    after the step's end): "report" the first receipt (a first-byte report or an access-log
    entry), "stamp" the earliest Envoy stamp (the Lua first byte, the last upstream byte).
    A router groups the reports of one step and takes the earliest as the step's end."""
    report: dict[tuple[str, float], float] = {}
    stamp: dict[tuple[str, float], float] = {}
    for m in matched:
        pairs = ((m.first_step, m.first_delay, m.lua_first_stamp),
                 (m.last_step, m.end_delay, m.upstream_last_stamp))  # fmt: skip
        for step, delay, envoy in pairs:
            if step is None:
                continue
            key = (m.server, step)
            if delay is not None:
                report[key] = min(delay, report.get(key, delay))
            if envoy is not None:
                stamp[key] = min(envoy, stamp.get(key, envoy))
    return {"report": list(report.values()), "stamp": list(stamp.values())}


def learned_fraction(steps: Iterable[StepEnd], matched: Iterable[Matched]) -> dict[str, float]:
    """Per server (and "all"): the share of its steps whose end the EPP learns, i.e. a step
    holding a first token of a request whose first-byte report arrived or a last token of a
    request whose access-log entry arrived."""
    known: set[tuple[str, float | None]] = {
        (m.server, m.first_step) for m in matched if m.first_delay is not None
    }
    known |= {(m.server, m.last_step) for m in matched if m.end_delay is not None}
    total: dict[str, int] = {}
    learned: dict[str, int] = {}
    for step in steps:
        for key in (step.server, "all"):
            total[key] = total.get(key, 0) + 1
            learned[key] = learned.get(key, 0) + ((step.server, step.end) in known)
    return {key: learned[key] / total[key] for key in sorted(total)}


def kv_lateness(
    published: Sequence[Mapping[str, Any]],
    received: Iterable[Mapping[str, Any]],
    probe: Iterable[Mapping[str, Any]] = (),
    steps: int = 0,
) -> dict[str, Any]:
    """How late the KV-event batches (the engines' step clock) come, per batch (`--kv-events`).

    `published`: the simulator's record of each batch it sent (`port`: the server's HTTP port,
    `end`: the step's modelled end and `pub`: when it was sent, both monotonic, `ts`: the
    batch's stamp, wall clock); `received`: the tap's `kind == "kv"` records (`endpoint`
    ip:port, `ts`, `wall`: the EPP's receipt); `probe`: the same receipts by an idle process
    of its own (`port`, `ts`, `wall`), the transport's floor. Batches are matched by (port,
    ts). Returns ms p50/p90/p99: `publisher_lag_ms` (sent - modelled end: the simulator's
    loop), `epp_late_ms` (EPP receipt - ts), `epp_applied_ms` (the tap's `applied`, when the
    loop applied it - ts: later than the receipt with a receiving thread), `probe_late_ms`
    (idle receipt - ts),
    `epp_after_probe_ms` (the same batch's EPP receipt - idle receipt: the EPP's loop), and the
    share of `steps` (all servers) that published."""
    sent = {(int(r["port"]), float(r["ts"])) for r in published}
    epp: dict[tuple[int, float], float] = {}
    applied: dict[tuple[int, float], float] = {}
    for r in received:
        key = (int(str(r["endpoint"]).rpartition(":")[2]), float(r["ts"]))
        if key in sent:
            epp[key] = float(r["wall"])
            applied[key] = float(r.get("applied", r["wall"]))
    idle = {(int(r["port"]), float(r["ts"])): float(r["wall"]) for r in probe}
    idle = {k: v for k, v in idle.items() if k in sent}
    return {
        "batches": len(published),
        "received": len(epp),
        "probed": len(idle),
        "steps_publishing": len(published) / steps if steps else None,
        "publisher_lag_ms": delays_ms(float(r["pub"]) - float(r["end"]) for r in published),
        "epp_late_ms": delays_ms(wall - ts for (_, ts), wall in epp.items()),
        "epp_applied_ms": delays_ms(at - ts for (_, ts), at in applied.items()),
        "probe_late_ms": delays_ms(wall - ts for (_, ts), wall in idle.items()),
        "epp_after_probe_ms": delays_ms(wall - idle[k] for k, wall in epp.items() if k in idle),
    }
