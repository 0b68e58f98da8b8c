"""The live feed of the `step-phase-scorer`: KV-event batches from the subscriber's `on_batch`
hook, their engine stamps moved onto the decisions' clock (issue #38;
docs/notes/2026-12-08-step-clock-live.md).

`feeds(plugins)` pairs each step-phase scorer with the prefix scorer its `prefixScorer` names
when that one subscribes to exact KV events (`kvEvents: true`), and `StepBatchFeed` is what the
runtime's composition root sets as that subscriber's `on_batch` (chaining any observer already
there: the bench's signal tap). The scorer knows nothing of ZMQ; the subscriber nothing of
step clocks.

Clocks. A batch's `ts` is the engine's wall clock (vLLM: `time.time()` at the step's end); the
decisions run on the runtime's monotonic clock. On one host the two differ by an offset that
`time.time() - time.monotonic()` samples (taken at each batch: a wall-clock step, NTP's slew
included, moves it and the next batch follows). Across hosts the engine's wall clock is off
the EPP's by the hosts' clock offset too, which NTP keeps to ~1 ms at best, several times the
phase's budget; such a deployment would learn each engine's offset from the batches themselves
(the minimum of `received_at - ts` over a window is the offset plus the fastest transit,
sub-millisecond on a LAN) and subtract it. Not built here: every engine of this project's live
runs shares the EPP's host.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from poolkeeper.scheduling.exact_prefix import ExactPrefixIndex
from poolkeeper.scheduling.interfaces import Plugin
from poolkeeper.scheduling.plugins.prefix_scorer import PrefixCacheScorer
from poolkeeper.scheduling.plugins.stepphase_scorer import StepPhaseScorer

BatchObserver = Callable[[str, float, float], None]  # (endpoint, engine ts, wall receipt)


@dataclass(slots=True)
class StepBatchFeed:
    """`on_batch` for one subscriber: each batch's stamp, on the decisions' clock, to its
    scorers; then to the observer that was there before (`then`)."""

    scorers: Sequence[StepPhaseScorer]
    clock: Callable[[], float] = time.monotonic  # the decisions' clock
    wall: Callable[[], float] = time.time  # the engines' (same host)
    then: BatchObserver | None = None
    batches: int = field(default=0)

    def __call__(self, endpoint: str, ts: float, received_at: float) -> None:
        at = ts - (self.wall() - self.clock())
        for scorer in self.scorers:
            scorer.step_ended(endpoint, at)
        self.batches += 1
        if self.then is not None:
            self.then(endpoint, ts, received_at)


def feeds(
    plugins: Mapping[str, Plugin],
) -> tuple[dict[str, tuple[PrefixCacheScorer, list[StepPhaseScorer]]], list[str]]:
    """Per prefix scorer (by name) with exact KV events, the step-phase scorers it feeds
    (each put in live mode); and the names of step-phase scorers with no such feed (they
    stay neutral: no batch, no clock)."""
    fed: dict[str, tuple[PrefixCacheScorer, list[StepPhaseScorer]]] = {}
    neutral: list[str] = []
    for name, plugin in plugins.items():
        if not isinstance(plugin, StepPhaseScorer):
            continue
        prefix = plugin.prefix
        exact: ExactPrefixIndex | None = None if prefix is None else prefix.exact
        if prefix is None or exact is None or prefix.subscriber is None:
            neutral.append(name)
            continue
        plugin.live(exact)
        fed.setdefault(prefix.typed_name.name, (prefix, []))[1].append(plugin)
    return fed, neutral
