"""Build a Scheduler from a SchedulingConfig: instantiate each plugin of its plan once.

The plan was resolved when the config was validated (`SchedulingConfig.plan`); nothing is
resolved here unless the scheduler is built against another registry than the config was
validated with.

A plugin instance referenced by several profiles (or decision trees) is shared, so e.g. one
prefix index serves every profile that scores prefixes.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable

from poolkeeper.datastore.endpoint import DEFAULT_STALENESS_S
from poolkeeper.errors import ConfigError
from poolkeeper.scheduling.config import SchedulingConfig
from poolkeeper.scheduling.interfaces import (
    Filter,
    Picker,
    Plugin,
    ProfileHandler,
    ReadsPostCycles,
    Scorer,
)
from poolkeeper.scheduling.profile import SchedulerProfile
from poolkeeper.scheduling.registry import BuildContext, PluginRegistry
from poolkeeper.scheduling.scheduler import Scheduler


def build_scheduler(
    config: SchedulingConfig,
    *,
    rng: random.Random,
    registry: PluginRegistry | None = None,
    staleness_s: float = DEFAULT_STALENESS_S,
    clock: Callable[[], float] = time.monotonic,
) -> Scheduler:
    """The scheduler `config` describes; raises ConfigError listing every problem.

    `staleness_s` is the gateway's freshness setting (`spec.scraping.stalenessMs`), handed to the
    plugins that skip endpoints with stale metrics. `clock`: the runtime's (the decisions'
    `now`), for what plugins stamp between decisions.
    """
    plan = config.plan(registry)
    instances: dict[str, Plugin] = {}
    building: list[str] = []

    def instance(name: str) -> Plugin:
        existing = instances.get(name)
        if existing is not None:
            return existing
        if name in building:  # the resolver rejects cycles; this guards custom registries
            raise ConfigError(f"plugins refer to each other in a cycle: {' -> '.join(building)}")
        building.append(name)
        rp = plan.plugins[name]
        plugin = rp.spec.factory(rp.typed_name, rp.params, ctx)
        building.pop()
        instances[name] = plugin
        return plugin

    def resolve_filter(name: str) -> Filter:
        plugin = instance(name)
        if not isinstance(plugin, Filter):
            raise ConfigError(f"plugin {name!r} is not a filter")
        return plugin

    def resolve_plugin(name: str) -> Plugin:
        if name not in plan.plugins:
            known = ", ".join(sorted(plan.plugins))
            raise ConfigError(f"no plugin named {name!r} in the configuration (plugins: {known})")
        return instance(name)

    ctx = BuildContext(
        rng=rng,
        resolve_filter=resolve_filter,
        resolve_plugin=resolve_plugin,
        staleness_s=staleness_s,
        clock=clock,
    )
    profiles: list[SchedulerProfile] = []
    for prof in plan.profiles:
        filters = [resolve_filter(n) for n in prof.filters]
        scorers: list[tuple[Scorer, float]] = []
        for n, w in prof.scorers:
            scorer = instance(n)
            if not isinstance(scorer, Scorer):
                raise ConfigError(f"plugin {n!r} is not a scorer")
            scorers.append((scorer, w))
        picker = instance(prof.picker)
        if not isinstance(picker, Picker):
            raise ConfigError(f"plugin {prof.picker!r} is not a picker")
        profiles.append(SchedulerProfile(prof.name, filters, scorers, picker))
    _check_post_cycles_read(profiles)
    handler = instance(plan.handler)
    if not isinstance(handler, ProfileHandler):
        raise ConfigError(f"plugin {plan.handler!r} is not a profile handler")
    return Scheduler(profiles, handler, instances, source=plan.source)


def learns_from_first_tokens(config: SchedulingConfig) -> bool:
    """Whether the scheduler `config` describes learns from first tokens (its built form's
    `Scheduler.observes_first_tokens`), e.g. to ask Envoy to report them as they happen."""
    return build_scheduler(config, rng=random.Random(0)).observes_first_tokens


def _check_post_cycles_read(profiles: list[SchedulerProfile]) -> None:
    """Refuse a plugin reading state that another plugin's PostCycle keeps when that one runs
    in no profile (not a member, or a scorer of weight 0): the state would never fill, and the
    option silently do nothing. (PostCycles run for the decision's primary profile, which the
    handler picks per request; a reader and its source in different profiles pass here.)"""
    running = {id(plugin) for profile in profiles for plugin in profile.post_cycles}
    for profile in profiles:
        members = [*profile.filters, *(w.scorer for w in profile.scorers), profile.picker]
        for member in members:
            if not isinstance(member, ReadsPostCycles):
                continue
            for parameter, read in member.post_cycles_read():
                if id(read) not in running:
                    raise ConfigError(
                        f"plugin {member.typed_name.name!r}: {parameter} "
                        f"{read.typed_name.name!r} must be a scorer with a non-zero weight in a "
                        "profile (its state is kept after the decisions it scores in)"
                    )
