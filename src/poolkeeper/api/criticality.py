"""Criticality of an InferenceModel (and the band of an InferenceObjective priority): how its
requests are admitted when the pool is saturated."""

from __future__ import annotations

from enum import StrEnum


class Criticality(StrEnum):
    """Critical is never shed; Standard is shed only under heavy overload; Sheddable first."""

    CRITICAL = "Critical"
    STANDARD = "Standard"
    SHEDDABLE = "Sheddable"

    @property
    def rank(self) -> int:
        """Higher rank = more important (Critical 2, Standard 1, Sheddable 0)."""
        return _RANK[self]


_RANK = {Criticality.CRITICAL: 2, Criticality.STANDARD: 1, Criticality.SHEDDABLE: 0}


def effective_criticality(value: Criticality | None) -> Criticality:
    """An unset criticality behaves as Standard (the API leaves it unset in the object)."""
    return Criticality.STANDARD if value is None else value


def criticality_of_priority(priority: int) -> Criticality:
    """The band an InferenceObjective priority (upstream v1.x) is served in.

    Upstream: unset = 0, negative = sheddable, higher = served first. poolkeeper keeps its three
    bands (admission shedding levels, flow-control queues) and maps onto them: > 0 Critical,
    0 Standard, < 0 Sheddable. Priorities within one band are not ordered further.
    """
    if priority > 0:
        return Criticality.CRITICAL
    if priority < 0:
        return Criticality.SHEDDABLE
    return Criticality.STANDARD
