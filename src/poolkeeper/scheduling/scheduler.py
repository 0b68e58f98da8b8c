"""Scheduler: runs the profiles its handler chooses and returns the primary profile's result.

`schedule` is pure over its inputs except for the plugins' own state (the prefix index, updated
by PostCycle for the primary pick) and the injected RNG. It never returns an endpoint that is not
one of `candidates`, and raises NoReadyEndpoint (503) when nothing is left to pick from.
Its `stats` collect per-plugin durations and prefix-index lookups for the metrics endpoint.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from types import MappingProxyType

from poolkeeper.datastore.endpoint import EndpointState
from poolkeeper.errors import FilteredOut, GatewayError, NoReadyEndpoint
from poolkeeper.scheduling.interfaces import (
    CycleState,
    EndpointFollower,
    EndpointForgetter,
    FirstTokenObserver,
    Plugin,
    ProfileHandler,
    ProfileResult,
)
from poolkeeper.scheduling.plugins.profile_handlers import SingleProfileHandler
from poolkeeper.scheduling.profile import SchedulerProfile
from poolkeeper.scheduling.stats import SchedulingStats
from poolkeeper.scheduling.types import LLMRequest, SchedulingResult


class Scheduler:
    """Profiles + a profile handler, built from a SchedulingConfig by `build_scheduler`."""

    __slots__ = (
        "_followers",
        "_forgetters",
        "_observers",
        "_only",
        "_usage_learners",
        "handler",
        "plugins",
        "profiles",
        "source",
        "stats",
    )

    def __init__(
        self,
        profiles: Sequence[SchedulerProfile],
        handler: ProfileHandler,
        plugins: Mapping[str, Plugin],
        source: str = "config",
    ) -> None:
        if not profiles:
            raise ValueError("a scheduler needs at least one profile")
        self.profiles: Mapping[str, SchedulerProfile] = MappingProxyType(
            {p.name: p for p in profiles}
        )
        self.handler = handler
        # The built-in single-profile handler's loop is known: run the one profile, its result
        # is primary. Taken directly (two handler calls and a loop fewer per decision).
        self._only = (
            profiles[0] if len(profiles) == 1 and type(handler) is SingleProfileHandler else None
        )
        self.plugins: Mapping[str, Plugin] = MappingProxyType(dict(plugins))
        self.source = source  # "config" or "preset <name>", for logs and `poolkeeper status`
        self._forgetters = tuple(p for p in plugins.values() if isinstance(p, EndpointForgetter))
        self._observers = tuple(p for p in plugins.values() if isinstance(p, FirstTokenObserver))
        # Those that also count steps by a successful end's usage (`step-phase-scorer`): found
        # once here, not looked up on every request's end.
        self._usage_learners: tuple[Callable[[str, float, int], None], ...] = tuple(
            done for p in self._observers if (done := getattr(p, "request_done", None)) is not None
        )
        # Only plugins that connect: a listener per datastore write for nothing otherwise.
        self._followers = tuple(
            p for p in plugins.values() if isinstance(p, EndpointFollower) and p.follows
        )
        self.stats = SchedulingStats()
        for profile in profiles:
            profile.attach_stats(self.stats)
        for plugin in plugins.values():
            attach = getattr(plugin, "attach_stats", None)
            if callable(attach):
                attach(self.stats)

    def schedule(
        self, request: LLMRequest, candidates: Sequence[EndpointState], *, now: float
    ) -> SchedulingResult:
        """Pick the endpoint (then fallbacks) for `request` among `candidates`."""
        if not candidates:
            raise NoReadyEndpoint(f"no ready endpoint for model {request.model!r}")
        cycle = CycleState(now)
        only = self._only
        if only is not None:
            result = only.run(cycle, request, candidates)
            if result is None:
                raise self._filtered_out(request, only.name, candidates)
            only.post_cycle(cycle, request, result)
            return _scheduling_result(result, only.name)
        results: dict[str, ProfileResult | None] = {}
        # Each profile runs at most once, so the loop ends after len(profiles) + 1 rounds.
        for _ in range(len(self.profiles) + 1):
            names = [
                n
                for n in self.handler.pick_profiles(cycle, request, self.profiles, results)
                if n not in results
            ]
            if not names:
                break
            for name in names:
                profile = self.profiles.get(name)
                if profile is None:
                    raise GatewayError(f"profile handler chose unknown profile {name!r}")
                results[name] = profile.run(cycle, request, candidates)
        if not results:
            raise GatewayError("profile handler ran no profile")
        primary = self.handler.primary(cycle, request, results)
        result = results.get(primary)
        if result is None:
            raise self._filtered_out(request, primary, candidates)
        self.profiles[primary].post_cycle(cycle, request, result)
        return _scheduling_result(result, primary)

    @staticmethod
    def _filtered_out(
        request: LLMRequest, profile: str, candidates: Sequence[EndpointState]
    ) -> FilteredOut:
        return FilteredOut(
            f"no endpoint for model {request.model!r} passed the filters of scheduling "
            f"profile {profile!r} ({len(candidates)} candidates)"
        )

    @property
    def observes_first_tokens(self) -> bool:
        """Whether a plugin learns from first tokens (callers may skip reporting them)."""
        return bool(self._observers)

    def observe_first_token(self, request_id: str, endpoint: str | None, now: float) -> None:
        """Report the first response byte of a request this scheduler decided."""
        for plugin in self._observers:
            plugin.observe_first_token(request_id, endpoint, now)

    def request_done(self, request_id: str, now: float, output_tokens: int) -> None:
        """A request this scheduler decided ended well at `now` with `output_tokens` (the
        usage): for the plugins that count steps by it (`step-phase-scorer`); `request_ended`
        follows for every outcome."""
        for done in self._usage_learners:
            done(request_id, now, output_tokens)

    def request_ended(self, request_id: str) -> None:
        """Report the end of a request this scheduler decided (any outcome)."""
        for plugin in self._observers:
            plugin.request_ended(request_id)

    @property
    def follows_endpoints(self) -> bool:
        """Whether a plugin wants the pool's endpoints ahead of decisions (callers may skip
        `follow_endpoints` when none does)."""
        return bool(self._followers)

    def follow_endpoints(self, endpoints: Iterable[str]) -> None:
        """Tell the plugins that connect to endpoints (KV-event subscriptions) the pool's
        endpoints (ip:port); called on the running loop whenever they change."""
        keys = tuple(endpoints)
        for plugin in self._followers:
            plugin.follow_endpoints(keys)

    async def stop_following(self) -> None:
        """Close the plugins' endpoint connections (KV-event subscriptions) at shutdown."""
        for plugin in self._followers:
            await plugin.stop_following()

    def forget_endpoints(self, keep: set[str]) -> None:
        """Drop plugin state (prefix index) of endpoints (ip:port) that left the pool."""
        for plugin in self._forgetters:
            plugin.forget_endpoints(keep)


def _scheduling_result(result: ProfileResult, profile: str) -> SchedulingResult:
    return SchedulingResult(
        targets=result.targets,
        profile=profile,
        scores={t.endpoint.hostport: s for t, s in zip(result.targets, result.scores, strict=True)},
    )
