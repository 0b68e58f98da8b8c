"""What the Director needs from its collaborators: the ports it is written against.

The datastore snapshot, the scheduler (and, when a plugin learns from first tokens, its
learning side), the in-flight tracker and the admission controller. The Director depends on
these protocols only; `requestcontrol/build.py` plugs the real objects in, tests plug fakes.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable

from poolkeeper.api.objective import InferenceObjective
from poolkeeper.api.pool import AnyInferencePool
from poolkeeper.datastore.endpoint import EndpointState
from poolkeeper.datastore.models import ModelRoute, RewriteRule
from poolkeeper.scheduling.types import LLMRequest, SchedulingResult


class SnapshotView(Protocol):
    """The part of a datastore snapshot the Director reads."""

    def pool_keys(self) -> Sequence[str]: ...

    def resolve(self, model_name: str) -> ModelRoute | None: ...

    def model_names(self) -> Sequence[str]: ...

    def rewrite_rule(self, pool_key: str, model_name: str) -> RewriteRule | None: ...

    def objective(self, pool_key: str, name: str) -> InferenceObjective | None: ...

    def states(self, pool_key: str) -> Sequence[EndpointState]: ...

    def pool(self, pool_key: str) -> AnyInferencePool | None: ...


class SnapshotSource(Protocol):
    def snapshot(self) -> SnapshotView: ...


class SchedulerLike(Protocol):
    def schedule(
        self, request: LLMRequest, candidates: Sequence[EndpointState], *, now: float
    ) -> SchedulingResult: ...


@runtime_checkable
class LearningSchedulerLike(SchedulerLike, Protocol):
    """A scheduler with a plugin that learns from first tokens (the predicted-TTFT scorer)."""

    @property
    def observes_first_tokens(self) -> bool: ...

    def observe_first_token(self, request_id: str, endpoint: str | None, now: float) -> None: ...

    def request_ended(self, request_id: str) -> None: ...


class InflightLike(Protocol):
    def start(self, request_id: str, endpoint_key: str, tokens: int, now: float) -> object: ...

    def finish(
        self, request_id: str, *, now: float | None = None, output_tokens: int | None = None
    ) -> object: ...

    def apply(self, states: Sequence[EndpointState]) -> list[EndpointState]: ...

    def first_token(self, request_id: str) -> object: ...


class AdmissionLike(Protocol):
    def admit(
        self, request: LLMRequest, states: Sequence[EndpointState], *, now: float
    ) -> object: ...
