"""Field errors in the Kubernetes API server's wording, and the translation from pydantic's errors.

A `FieldError` is a field path (`spec.targetModels[0].weight`) and a message exactly as an API
server would phrase it (`Invalid value: 0: spec.targetModels[0].weight in body should be greater
than or equal to 1`). Validators in this package raise `rule_error(...)`; everything else comes
from pydantic's own constraint checks and is reworded here, so pydantic's phrasing never leaks.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError
from pydantic_core import ErrorDetails, PydanticCustomError

RULE_ERROR_TYPE = "k8s_rule"


@dataclass(frozen=True, slots=True)
class FieldError:
    """One validation problem: where (`spec.poolRef.name`) and what, in API-server wording."""

    path: str
    message: str

    def __str__(self) -> str:
        return f"{self.path}: {self.message}" if self.path else self.message


def rule_error(*issues: tuple[str, str]) -> PydanticCustomError:
    """A pydantic error carrying ready-made `(relative path, message)` pairs.

    The relative path is appended to the location of the validator that raises it: "" for the
    validated value itself, ".field" or "[3].field" below it.
    """
    first = issues[0][1] if issues else "invalid"
    return PydanticCustomError(RULE_ERROR_TYPE, "{detail}", {"detail": first, "issues": issues})


def checked(value: str, errors: Sequence[str]) -> str:
    """`value` when `errors` is empty, else a rule error: `Invalid value: "...": <msg>` each."""
    if errors:
        raise rule_error(*(("", f"Invalid value: {go_value(value)}: {msg}") for msg in errors))
    return value


def go_value(value: Any) -> str:
    """Render a value the way the API server prints it inside `Invalid value: ...`."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if value is None:
        return "null"
    if isinstance(value, int | float | str):
        return json.dumps(value)
    return json.dumps(json_type(value))


def json_type(value: Any) -> str:
    """The JSON type name of a decoded value (`string`, `integer`, `object`, ...)."""
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "integer"
    if isinstance(value, float):
        return "number"
    if isinstance(value, str):
        return "string"
    if isinstance(value, dict):
        return "object"
    if isinstance(value, list | tuple):
        return "array"
    if value is None:
        return "null"
    return type(value).__name__


def join_path(loc: Sequence[int | str]) -> str:
    """`("spec", "targetModels", 0, "weight")` -> `spec.targetModels[0].weight`."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += f".{part}" if out else part
    return out


def supported_values(values: Sequence[str]) -> str:
    return ", ".join(json.dumps(v) for v in values)


def unsupported_value(value: Any, values: Sequence[str]) -> str:
    return f"Unsupported value: {go_value(value)}: supported values: {supported_values(values)}"


_TYPE_OF_ERROR = {
    "int": "integer",
    "string": "string",
    "dict": "object",
    "model": "object",
    "list": "array",
    "bool": "boolean",
    "float": "number",
    "datetime": "string",
}


def from_pydantic(exc: ValidationError, *, prefix: Sequence[int | str] = ()) -> list[FieldError]:
    """Translate every error of a pydantic ValidationError into API-server wording."""
    out: list[FieldError] = []
    for detail in exc.errors(include_url=False):
        out.extend(_translate(detail, tuple(prefix)))
    return out


def _translate(detail: ErrorDetails, prefix: tuple[int | str, ...]) -> list[FieldError]:
    kind = detail["type"]
    loc = prefix + tuple(detail["loc"])
    path = join_path(loc)
    ctx: dict[str, Any] = dict(detail.get("ctx") or {})
    value = detail.get("input")
    if kind == RULE_ERROR_TYPE:
        return [FieldError(_extend(path, rel), msg) for rel, msg in ctx["issues"]]
    if kind == "missing":
        return [FieldError(path, "Required value")]
    if kind == "extra_forbidden":
        return [FieldError(path, f'unknown field "{path}"')]
    if kind == "string_too_long":
        return [FieldError(path, f"Too long: may not be more than {ctx['max_length']} bytes")]
    if kind == "string_too_short":
        msg = f"{path} in body should be at least {ctx['min_length']} chars long"
        return [FieldError(path, f"Invalid value: {go_value(value)}: {msg}")]
    if kind == "string_pattern_mismatch":
        msg = f"{path} in body should match '{ctx['pattern']}'"
        return [FieldError(path, f"Invalid value: {go_value(value)}: {msg}")]
    bound = _BOUNDS.get(kind)
    if bound is not None:
        word, key = bound
        msg = f"{path} in body should be {word} {ctx[key]}"
        return [FieldError(path, f"Invalid value: {go_value(value)}: {msg}")]
    if kind == "too_long":
        unit = "items" if ctx.get("field_type") != "Dictionary" else "properties"
        actual, most = ctx.get("actual_length"), ctx["max_length"]
        if actual is None and isinstance(value, dict | list):
            actual = len(value)  # pydantic stops counting a dict at the first excess item
        return [FieldError(path, f"Too many: {actual}: must have at most {most} {unit}")]
    if kind == "too_short":
        unit = "properties" if ctx.get("field_type") == "Dictionary" else "items"
        msg = f"{path} in body should have at least {ctx['min_length']} {unit}"
        return [FieldError(path, f"Invalid value: {ctx['actual_length']}: {msg}")]
    if kind in ("enum", "literal_error"):
        allowed = re.findall(r"'((?:[^'\\]|\\.)*)'", str(ctx.get("expected", "")))
        return [FieldError(path, unsupported_value(value, allowed))]
    if kind.startswith(("datetime", "timezone")):
        msg = f"{path} in body must be of type string (RFC 3339 date-time)"
        return [FieldError(path, f"Invalid value: {go_value(value)}: {msg}")]
    expected = _expected_type(kind)
    if expected is not None:
        actual = json_type(value)
        msg = f"{path} in body must be of type {expected}: {json.dumps(actual)}"
        return [FieldError(path, f"Invalid value: {json.dumps(actual)}: {msg}")]
    # A rule we do not know how to phrase: keep the location, use a neutral wording.
    return [FieldError(path, f"Invalid value: {go_value(value)}: {detail['msg']}")]


def _extend(path: str, rel: str) -> str:
    if not rel:
        return path
    if rel[0] in ".[":
        return (path + rel).lstrip(".")
    return f"{path}.{rel}" if path else rel


_BOUNDS = {
    "greater_than_equal": ("greater than or equal to", "ge"),
    "less_than_equal": ("less than or equal to", "le"),
    "greater_than": ("greater than", "gt"),
    "less_than": ("less than", "lt"),
}


def _expected_type(kind: str) -> str | None:
    for stem, name in _TYPE_OF_ERROR.items():
        if kind.startswith(stem + "_") or kind == stem:
            return name
    if kind == "model_attributes_type":
        return "object"
    return None
