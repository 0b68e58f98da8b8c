"""The plugin interfaces of the scheduler and the per-request cycle state they share.

A scheduling profile runs Filters -> weighted Scorers -> a Picker, then PostCycle hooks for the
profile whose result was chosen. A ProfileHandler decides which profiles run and which result is
primary. Plugins are synchronous and pure over the snapshot they are given; the only state they
keep across requests is their own (the prefix index), and randomness comes from the injected
`random.Random`.

Scores travel as lists aligned with the candidate sequence (index i scores candidates[i]) rather
than as mappings keyed by endpoint: at 1,000 endpoints a dict per scorer per decision costs more
than the scoring itself. A scorer may return one float when every candidate gets the same score.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

from poolkeeper.datastore.endpoint import EndpointState
from poolkeeper.scheduling.types import LLMRequest


@dataclass(frozen=True, slots=True)
class TypedName:
    """A plugin instance's registry type (e.g. `queue-scorer`) and its instance name."""

    type: str
    name: str

    def __str__(self) -> str:
        return self.name if self.name == self.type else f"{self.name} ({self.type})"


class CycleState:
    """Scratch space of one scheduling decision, shared by every plugin of every profile.

    `now` is the decision time (monotonic seconds, injected). Plugins store derived values under
    their own instance name so that e.g. the prefix hashes of a prompt are computed once.
    """

    __slots__ = ("_data", "get", "now", "put")

    # `get(key)` (None when absent) and `put(key, value)`: the scratch dict's own methods,
    # bound per decision, so each of a decision's many reads is a C call rather than a frame.
    get: Callable[[str], object | None]
    put: Callable[[str, object], None]

    def __init__(self, now: float) -> None:
        self.now = now
        data: dict[str, object] = {}
        self._data = data
        self.get = data.get
        self.put = data.__setitem__


@dataclass(frozen=True, slots=True)
class ProfileResult:
    """What one profile decided: endpoints in order of preference and their weighted scores."""

    profile: str
    targets: tuple[EndpointState, ...]
    scores: tuple[float, ...] = field(default=())


@dataclass(frozen=True, slots=True)
class AffineScores:
    """Scores given as `offset + scale * values[i]` (each must land in [0, 1]).

    Lets a normalising scorer (min-max, 1 - x) hand over its raw per-endpoint values: the
    profile folds `offset` into a constant and `scale` into the weight, so normalisation costs
    no pass over the candidates of its own.
    """

    values: Sequence[float]
    scale: float
    offset: float
    # >= 0: every value is an int in 0..top (request counts), so the profile may read each
    # weighted product from a table of top + 1 (`wsum.Summers`); -1: not known to be.
    top: int = -1

    def __len__(self) -> int:
        return len(self.values)

    def materialize(self) -> list[float]:
        """The scores as a list, clamped into [0, 1] (the affine form may be off by rounding,
        e.g. -2e-16 for the least loaded endpoint; the profile's weighted sum tolerates that)."""
        scale, offset = self.scale, self.offset
        return [min(1.0, max(0.0, offset + scale * v)) for v in self.values]


# Aligned with the candidates; one value for all of them; or an affine form of raw values.
Scores = Sequence[float] | float | AffineScores


@runtime_checkable
class Plugin(Protocol):
    @property
    def typed_name(self) -> TypedName: ...


@runtime_checkable
class Filter(Plugin, Protocol):
    def filter(
        self, cycle: CycleState, request: LLMRequest, candidates: Sequence[EndpointState]
    ) -> Sequence[EndpointState]:
        """The candidates that pass (a subset, in input order); empty means the filter failed."""
        ...


@runtime_checkable
class Scorer(Plugin, Protocol):
    def score(
        self, cycle: CycleState, request: LLMRequest, candidates: Sequence[EndpointState]
    ) -> Scores:
        """One score in [0, 1] per candidate (higher is better); out-of-range values are clamped
        by the profile unless the scorer sets `bounded = True` (built-ins do, tests prove it)."""
        ...


@runtime_checkable
class Picker(Plugin, Protocol):
    def pick(self, candidates: Sequence[EndpointState], scores: Sequence[float]) -> list[int]:
        """Indices into `candidates`, primary first, then fallbacks; never empty for non-empty
        input, no index twice."""
        ...


@runtime_checkable
class PostCycle(Plugin, Protocol):
    def post_cycle(self, cycle: CycleState, request: LLMRequest, result: ProfileResult) -> None:
        """Runs after the decision, for the primary profile's result (e.g. prefix insertion)."""
        ...


@runtime_checkable
class ReadsPostCycles(Plugin, Protocol):
    def post_cycles_read(self) -> Sequence[tuple[str, PostCycle]]:
        """The plugins whose PostCycle keeps state this one reads, each with the parameter
        naming it: they must run in this plugin's profiles (scorers of non-zero weight), or
        that state never fills (`build.py` refuses the config)."""
        ...


@runtime_checkable
class EndpointForgetter(Plugin, Protocol):
    def forget_endpoints(self, keep: set[str]) -> None:
        """Drop per-endpoint state of endpoints (ip:port) no longer in `keep`."""
        ...


@runtime_checkable
class EndpointFollower(Plugin, Protocol):
    @property
    def follows(self) -> bool:
        """Whether this instance connects to endpoints at all (a plugin type that can, as the
        prefix scorer with `kvEvents`, may be configured not to)."""
        ...

    def follow_endpoints(self, endpoints: Iterable[str]) -> None:
        """The pool's endpoints (ip:port), whenever they change, on the running loop: for
        plugins that connect to endpoints before any decision needs them."""
        ...

    async def stop_following(self) -> None:
        """Close what `follow_endpoints` opened (sockets, tasks); the runtime's stop awaits it
        once no decision is made any more."""
        ...


@runtime_checkable
class FirstTokenObserver(Plugin, Protocol):
    def observe_first_token(self, request_id: str, endpoint: str | None, now: float) -> None:
        """The first response byte of a scheduled request arrived from `endpoint` (ip:port,
        None if unknown) at `now`, on the clock of the decision's `CycleState.now`.
        `request_id` is the decided `LLMRequest.key` (unique per send, unlike client ids)."""
        ...

    def request_ended(self, request_id: str) -> None:
        """The request ended (any outcome); drop whatever was kept for it (`request_id`: the
        decided `LLMRequest.key`, as for `observe_first_token`)."""
        ...


class ProfileRunner(Protocol):
    """What a profile handler sees of a profile."""

    @property
    def name(self) -> str: ...


@runtime_checkable
class ProfileHandler(Plugin, Protocol):
    def pick_profiles(
        self,
        cycle: CycleState,
        request: LLMRequest,
        profiles: Mapping[str, ProfileRunner],
        results: Mapping[str, ProfileResult | None],
    ) -> list[str]:
        """Names of the profiles to run next, given the results so far; [] ends the loop."""
        ...

    def primary(
        self, cycle: CycleState, request: LLMRequest, results: Mapping[str, ProfileResult | None]
    ) -> str:
        """The name of the profile whose result is the decision."""
        ...


def is_bounded(scorer: Scorer) -> bool:
    """Whether the scorer guarantees scores in [0, 1], so the profile may skip clamping."""
    return bool(getattr(scorer, "bounded", False))
