"""Shared builders of the flow-control tests that drive one Standard flow."""

from __future__ import annotations

from typing import Any

from poolkeeper.api.criticality import Criticality
from poolkeeper.flowcontrol.config import FlowControlConfig
from poolkeeper.flowcontrol.dispatcher import FlowItem

S = Criticality.STANDARD


def standard_config(**standard: Any) -> FlowControlConfig:
    """The default configuration with `standard`'s keys on Standard's defaults."""
    return FlowControlConfig.model_validate({"bands": {"standard": standard}})


def standard_item(name: str) -> FlowItem[str]:
    """A Standard request of flow "m" (10 prompt tokens, 100 bytes)."""
    return FlowItem(name, S, "m", 10, 100)


def never(_item: FlowItem[str]) -> bool:
    """A `fits` with no room."""
    return False
