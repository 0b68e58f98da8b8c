"""Per-decision values two scorers share: residency and the observed-speed bar.

`residency` (a request's model resident on each candidate: `lora-affinity-scorer`'s active
score, the prefill-backlog scorer's adapter term) and `speed_bar` (`observed-speed-scorer`'s
rule, the backlog scorer's speed term) are worked out once per decision through the cycle
state, and with the caller's kept columns (`columns.py`) patched between decisions only where
a candidate changed. Also the backlog scorer's two rules built on them: `adapter_floor` (the
adapter term alone, what its fade leaves) and `slowed` (costs scaled past the speed bar).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Final, TypeVar

from poolkeeper.datastore.columns import MIN_CACHED, Column, Columns
from poolkeeper.datastore.endpoint import EndpointState
from poolkeeper.scheduling.interfaces import CycleState


def residency(
    candidates: Sequence[EndpointState],
    target: str,
    cycle: CycleState | None = None,
    kept: Columns[bool] | None = None,
) -> list[bool] | bool:
    """Whether `target` (a request's model) is resident on each candidate: the candidate's
    served base model or one of its active LoRA adapters; one bool when the same for all (a
    pool without LoRA, or one that runs the adapter nowhere). The one rule of "resident"
    (`lora-affinity-scorer`'s active score, the prefill-backlog scorer's adapter term). With
    `cycle`, worked out once per decision for the same candidates and target (read-only);
    with `kept` too (`residency_columns`, the caller's), kept between decisions."""
    if len(candidates) >= MIN_CACHED and cycle is not None and kept is not None:
        column = kept.of(target)
        return _per_decision(
            cycle, _RESIDENCY, candidates, target, lambda c, _: _uniform(column.values(cycle, c))
        )
    return _per_decision(cycle, _RESIDENCY, candidates, target, _residency)


def adapter_floor(resident: list[bool] | bool, own: int, miss: int) -> list[float] | float:
    """The ratio rule over a request's own cost (`own` tokens) plus `miss` where its adapter is
    not resident, no backlog: 1 where it is, own / (own + miss) where not; 1 for all where
    residency is the same everywhere."""
    if isinstance(resident, bool):
        return 1.0
    low = own / (own + miss)
    return [1.0 if r else low for r in resident]


def residency_columns() -> Columns[bool]:
    """A plugin's kept `residency` flags, per target model."""
    return Columns(
        lambda target: Column(lambda c: _flags(c, target), lambda s: _resident(s, target))
    )


def _residency(candidates: Sequence[EndpointState], target: str) -> list[bool] | bool:
    return _uniform(_flags(candidates, target))


def _flags(candidates: Sequence[EndpointState], target: str) -> list[bool]:
    return [
        target == (m := s.metrics).served_model or target in m.active_adapters for s in candidates
    ]


def _resident(s: EndpointState, target: str) -> bool:
    return target == s.metrics.served_model or target in s.metrics.active_adapters


def _uniform(flags: list[bool]) -> list[bool] | bool:
    return flags[0] if flags and flags.count(flags[0]) == len(flags) else flags


def speed_bar(
    candidates: Sequence[EndpointState],
    slack: float,
    cycle: CycleState | None = None,
    kept: Column[float | None] | None = None,
) -> tuple[list[float], float] | None:
    """Each candidate's observed seconds per output token (0.0 where not observed yet) and the
    bar `slack` x the fastest observed one: slower than the bar is slow. None when no candidate
    was observed. The one rule of "slower than the fastest" (`observed-speed-scorer`, the
    prefill-backlog scorer's speed term). With `cycle`, worked out once per decision for the
    same candidates and slack (both scorers of the default profile ask; read-only result);
    with `kept` too (`speed_column`, the caller's), the speeds kept between decisions."""
    if len(candidates) >= MIN_CACHED and cycle is not None and kept is not None:
        return _per_decision(
            cycle, _SPEED_BAR, candidates, slack,
            lambda c, sl: _speed_bar(c, sl, kept.values(cycle, c)),
        )  # fmt: skip
    return _per_decision(cycle, _SPEED_BAR, candidates, slack, _speed_bar)


def slowed(
    costs: list[float],
    candidates: Sequence[EndpointState],
    slack: float,
    cycle: CycleState,
    kept: Column[float | None] | None = None,
) -> list[float]:
    """Costs scaled by each endpoint's observed seconds per output token over `slack` x the
    fastest's (`speed_bar`, `observed-speed-scorer`'s rule, shared with it through the cycle);
    unobserved ones are fast."""
    found = speed_bar(candidates, slack, cycle, kept)
    if found is None:
        return costs
    speeds, bar = found
    return [c if v <= bar else c * v / bar for c, v in zip(costs, speeds, strict=True)]


def speed_column() -> Column[float | None]:
    """A plugin's kept observed speeds (`speed_bar`)."""
    return Column(_speeds, _speed)


def _speeds(candidates: Sequence[EndpointState]) -> list[float | None]:
    return [s.seconds_per_output_token for s in candidates]


def _speed(s: EndpointState) -> float | None:
    return s.seconds_per_output_token


# The cycle state's keys of `speed_bar`'s and `residency`'s (candidates, count, argument,
# result): module paths, which no plugin instance's name (the keys plugins use) can be.
_SPEED_BAR: Final = f"{__name__}.speed_bar"
_RESIDENCY: Final = f"{__name__}.residency"

_A = TypeVar("_A")
_R = TypeVar("_R")


def _per_decision(
    cycle: CycleState | None,
    key: str,
    candidates: Sequence[EndpointState],
    arg: _A,
    work: Callable[[Sequence[EndpointState], _A], _R],
) -> _R:
    """`work(candidates, arg)`, kept in `cycle` under `key` for the rest of the decision."""
    if cycle is None:
        return work(candidates, arg)
    done = cycle.get(key)
    # The same list object and length: a filter that reorders or trims a list in place
    # between two profiles would otherwise be handed the other's result.
    if (
        isinstance(done, tuple)
        and done[0] is candidates
        and done[1] == len(candidates)
        and done[2] == arg
    ):
        return done[3]  # type: ignore[no-any-return]
    found = work(candidates, arg)
    cycle.put(key, (candidates, len(candidates), arg, found))
    return found


def _speed_bar(
    candidates: Sequence[EndpointState], slack: float, speeds: list[float | None] | None = None
) -> tuple[list[float], float] | None:
    values = _speeds(candidates) if speeds is None else speeds
    try:
        fastest = min(values)  # type: ignore[type-var]  # the common case: all observed
    except TypeError:  # some endpoint not observed yet (None)
        if values.count(None) == len(values):
            return None  # none observed (a new pool): no pass over the values
        fastest = None
    if fastest is None or fastest <= 0.0:
        known = [v for v in values if v is not None and v > 0.0]
        if not known:
            return None
        fastest = min(known)
        values = [0.0 if v is None else v for v in values]  # unobserved: counts as fast
    return values, fastest * slack  # type: ignore[return-value]  # None replaced above
