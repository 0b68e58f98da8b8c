"""`single-profile-handler`: run the one profile; its result is the decision."""

from __future__ import annotations

from collections.abc import Mapping

from poolkeeper.scheduling.interfaces import CycleState, ProfileResult, ProfileRunner
from poolkeeper.scheduling.plugins.base import NamedPlugin
from poolkeeper.scheduling.types import LLMRequest


class SingleProfileHandler(NamedPlugin):
    """Runs every configured profile once (the loader allows exactly one with this handler)."""

    __slots__ = ()

    def pick_profiles(
        self,
        cycle: CycleState,
        request: LLMRequest,
        profiles: Mapping[str, ProfileRunner],
        results: Mapping[str, ProfileResult | None],
    ) -> list[str]:
        return [name for name in profiles if name not in results]

    def primary(
        self, cycle: CycleState, request: LLMRequest, results: Mapping[str, ProfileResult | None]
    ) -> str:
        return next(iter(results))
