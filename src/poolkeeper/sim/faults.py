"""Fault injection: what can go wrong with a model server, chosen by config or per request.

Per request, through the header `x-sim-fault` (comma- or semicolon-separated `key=value`), only
on a server started with `--fault-headers` (`header_faults`; a client of a gateway in front of
it must not be able to make it fail: the gateway also strips `x-sim-*`):

    status=503        answer with this HTTP error status (OpenAI-shaped error body)
    latency=0.5       wait 0.5 s (wall) before the request reaches the engine
    stall=2.0         hold the response 2 s (wall) before its first byte (the engine runs on)
    cut-after=5       streaming: close the connection after 5 SSE events, without [DONE];
                      non-streaming: close it without answering
    metrics=garbage   (on GET /metrics) answer unparseable text; metrics=slow: answer late

By configuration (`faults:` of a server in the --config file, or POST /sim/faults at run time)
the same faults apply to a fraction of requests: `error_rate` with `error_status`,
`latency_spike_rate` with `latency_spike_s`, plus fixed `latency_s`, `stall_s`, `cut_after`, and
`metrics` (ok | garbage | slow) with `metrics_delay_s`; with `cut_rate`, `cut_after` (2 when
unset) applies to that fraction of requests only. Header values win over configuration.
Fault durations are wall seconds; they are not scaled by --time-scale.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Literal

MetricsFault = Literal["ok", "garbage", "slow"]
FAULT_HEADER = "x-sim-fault"


class FaultSpecError(ValueError):
    """An x-sim-fault header that cannot be understood."""


@dataclass(frozen=True, slots=True)
class FaultConfig:
    """Standing faults of one server."""

    error_rate: float = 0.0
    error_status: int = 503
    latency_s: float = 0.0
    latency_spike_rate: float = 0.0
    latency_spike_s: float = 1.0
    stall_s: float = 0.0
    cut_after: int | None = None
    metrics: MetricsFault = "ok"
    metrics_delay_s: float = 2.0
    cut_rate: float = 0.0  # > 0: cut only this fraction of responses (after `cut_after` events)
    header_faults: bool = False  # obey the `x-sim-fault` header


@dataclass(frozen=True, slots=True)
class RequestFaults:
    """What to do to one request."""

    status: int | None = None
    latency_s: float = 0.0
    stall_s: float = 0.0
    cut_after: int | None = None
    metrics: MetricsFault = "ok"

    @property
    def any(self) -> bool:
        return self != _NO_FAULTS


_NO_FAULTS = RequestFaults()


def parse_fault_header(value: str) -> dict[str, str]:
    """`status=503; stall=2` -> {"status": "503", "stall": "2"}, with precise errors."""
    out: dict[str, str] = {}
    for part in value.replace(";", ",").split(","):
        part = part.strip()
        if not part:
            continue
        key, sep, val = part.partition("=")
        key = key.strip().lower().replace("_", "-")
        if not sep or not val.strip():
            raise FaultSpecError(f"{FAULT_HEADER}: expected key=value, got {part!r}")
        if key not in ("status", "latency", "stall", "cut-after", "metrics"):
            raise FaultSpecError(
                f"{FAULT_HEADER}: unknown fault {key!r} "
                "(known: status, latency, stall, cut-after, metrics)"
            )
        out[key] = val.strip()
    return out


def _number(key: str, raw: str, *, integer: bool = False) -> float:
    try:
        value = int(raw) if integer else float(raw)
    except ValueError:
        kind = "an integer" if integer else "a number"
        raise FaultSpecError(f"{FAULT_HEADER}: {key} must be {kind}, got {raw!r}") from None
    if value < 0:
        raise FaultSpecError(f"{FAULT_HEADER}: {key} must be >= 0, got {raw!r}")
    return value


def decide_faults(config: FaultConfig, header: str | None, rng: random.Random) -> RequestFaults:
    """Combine standing faults (drawn with `rng`) and the request's header."""
    status = config.error_status if config.error_rate and rng.random() < config.error_rate else None
    latency = config.latency_s
    if config.latency_spike_rate and rng.random() < config.latency_spike_rate:
        latency += config.latency_spike_s
    stall = config.stall_s
    cut_after = config.cut_after
    if config.cut_rate:
        cut_after = (
            (2 if cut_after is None else cut_after) if rng.random() < config.cut_rate else None
        )
    metrics: MetricsFault = config.metrics
    if header and config.header_faults:
        spec = parse_fault_header(header)
        if "status" in spec:
            status = int(_number("status", spec["status"], integer=True))
            if not 400 <= status <= 599:
                raise FaultSpecError(f"{FAULT_HEADER}: status must be 400..599, got {status}")
        if "latency" in spec:
            latency = _number("latency", spec["latency"])
        if "stall" in spec:
            stall = _number("stall", spec["stall"])
        if "cut-after" in spec:
            cut_after = int(_number("cut-after", spec["cut-after"], integer=True))
        if "metrics" in spec:
            mode = spec["metrics"].lower()
            if mode not in ("ok", "garbage", "slow"):
                raise FaultSpecError(f"{FAULT_HEADER}: metrics must be ok, garbage or slow")
            metrics = "ok" if mode == "ok" else "garbage" if mode == "garbage" else "slow"
    return RequestFaults(status, latency, stall, cut_after, metrics)


GARBAGE_METRICS = (
    '# HELP vllm:num_requests_running\nvllm:num_requests_running{model_name="x" 1..2\n'
    "\x00\x01 not prometheus at all {{{\n"
)
