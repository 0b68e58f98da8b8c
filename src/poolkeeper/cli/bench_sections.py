"""`poolkeeper bench`'s JSON options checked as the GatewayConfig sections they stand for.

`--flow-control` (`bench sim`, `bench live`) as a `spec.flowControl` and `--scheduling`
(`bench live`) as a `spec.scheduling`: a bad value is a ConfigError naming the field as
`poolkeeper serve` would (`spec.flowControl.bands...`), before any benchmark starts.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from poolkeeper.errors import ConfigError

if TYPE_CHECKING:
    from poolkeeper.flowcontrol.config import FlowControlConfig


def flow_control_config(text: str | None) -> FlowControlConfig | None:
    """`--flow-control` as a FlowControlConfig; ConfigError naming the field on bad input."""
    if text is None:
        return None
    from pydantic import ValidationError

    from poolkeeper.api.fielderrors import from_pydantic
    from poolkeeper.flowcontrol.config import FlowControlConfig

    try:
        return FlowControlConfig.model_validate_json(text)
    except ValidationError as exc:  # the wording of every other config error
        problems = "; ".join(str(e) for e in from_pydantic(exc, prefix=("spec", "flowControl")))
        raise ConfigError(f"--flow-control: {problems}") from None


def flow_control_section(text: str | None) -> dict[str, Any] | None:
    """`--flow-control` checked as a spec.flowControl section; the dict poolkeeper serve gets."""
    if text is None:
        return None
    import json

    flow_control_config(text)  # ConfigError naming the field
    doc = json.loads(text)
    if not isinstance(doc, dict):
        raise ConfigError("--flow-control: expected a JSON object")
    return doc


def scheduling_section(text: str | None) -> dict[str, Any] | None:
    """`--scheduling` checked as a spec.scheduling section; the dict poolkeeper serve gets."""
    if text is None:
        return None
    import json

    from pydantic import ValidationError

    from poolkeeper.api.fielderrors import from_pydantic
    from poolkeeper.scheduling.config import SchedulingConfig

    try:
        doc = json.loads(text)
        if not isinstance(doc, dict):
            raise ConfigError("--scheduling: expected a JSON object")
        SchedulingConfig.model_validate(doc)
    except ValueError as exc:
        if isinstance(exc, ValidationError):
            problems = "; ".join(str(e) for e in from_pydantic(exc, prefix=("spec", "scheduling")))
            raise ConfigError(f"--scheduling: {problems}") from None
        raise ConfigError(f"--scheduling: not JSON ({exc})") from None
    return doc
