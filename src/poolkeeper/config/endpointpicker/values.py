"""Value syntaxes of the upstream EPP's flags: Go booleans, integers and durations, pflag int
lists, Kubernetes quantities and label selectors. Each parser raises ValueError with a short
reason; `epp_flags` wraps it in pflag's "invalid argument" wording.
"""

from __future__ import annotations

import re
from typing import Final

_TRUE: Final = frozenset({"1", "t", "T", "TRUE", "true", "True"})
_FALSE: Final = frozenset({"0", "f", "F", "FALSE", "false", "False"})

# Go's time.ParseDuration units, in seconds.
_UNITS: Final = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "μs": 1e-6, "ms": 1e-3, "s": 1.0,
                 "m": 60.0, "h": 3600.0}  # fmt: skip
_DURATION_PART = re.compile(r"([0-9]*\.?[0-9]+)(ns|us|µs|μs|ms|s|m|h)")

# Kubernetes quantity suffixes (binary and decimal) in bytes.
_SUFFIXES: Final = {"": 1, "k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12, "P": 10**15,
                    "E": 10**18, "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40,
                    "Pi": 2**50, "Ei": 2**60}  # fmt: skip
_QUANTITY = re.compile(r"^([+-]?[0-9]+(?:\.[0-9]+)?)([a-zA-Z]*)$")

_LABEL_KEY = re.compile(
    r"^([a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*/)?"
    r"[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?$"
)
_LABEL_VALUE = re.compile(r"^([A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?)?$")
_SET_TERM = re.compile(r"^\s*(\S+)\s+(in|notin)\s+\(([^)]*)\)\s*$")
_EQUALITY_TERM = re.compile(r"^\s*([^!=\s]+)\s*(==|=|!=)\s*(\S*)\s*$")
_EXISTS_TERM = re.compile(r"^\s*(!?)\s*([^!=\s]+)\s*$")


def parse_bool(value: str) -> bool:
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise ValueError("strconv.ParseBool: parsing " + repr(value) + ": invalid syntax")


def parse_int(value: str) -> int:
    try:
        return int(value.strip(), 0) if value.strip().lower().startswith("0x") else int(value)
    except ValueError:
        raise ValueError("strconv.ParseInt: parsing " + repr(value) + ": invalid syntax") from None


def parse_duration(value: str) -> float:
    """Go's duration syntax (`50ms`, `1m30s`, `0`), in seconds."""
    text = value.strip()
    sign = -1.0 if text.startswith("-") else 1.0
    text = text.lstrip("+-")
    if text == "0":
        return 0.0
    total, pos = 0.0, 0
    for match in _DURATION_PART.finditer(text):
        if match.start() != pos:
            break
        total += float(match.group(1)) * _UNITS[match.group(2)]
        pos = match.end()
    if not text or pos != len(text):
        raise ValueError(f"time: invalid duration {value!r}")
    return sign * total


def parse_int_list(value: str) -> tuple[int, ...]:
    """pflag's IntSlice: comma-separated integers (an empty value is an empty list)."""
    if not value.strip():
        return ()
    return tuple(parse_int(part.strip()) for part in value.split(","))


def parse_size(value: str) -> int:
    """`10MiB`, `25MB`, `4194304`: a trailing B is dropped, the rest is a k8s quantity."""
    text = value.strip()
    if len(text) > 1 and text[-1] in "Bb":
        text = text[:-1]
    match = _QUANTITY.match(text)
    if match is None or match.group(2) not in _SUFFIXES:
        raise ValueError(f"quantities must match the regular expression (got {value!r})")
    return int(float(match.group(1)) * _SUFFIXES[match.group(2)])


def _split_terms(selector: str) -> list[str]:
    """Split at commas outside parentheses (`env in (a,b),tier!=x`)."""
    terms, depth, start = [], 0, 0
    for i, char in enumerate(selector):
        depth += {"(": 1, ")": -1}.get(char, 0)
        if depth < 0:
            raise ValueError("unbalanced parenthesis")
        if char == "," and depth == 0:
            terms.append(selector[start:i])
            start = i + 1
    if depth:
        raise ValueError("unbalanced parenthesis")
    terms.append(selector[start:])
    return terms


def _check_key(key: str) -> None:
    if not _LABEL_KEY.match(key) or len(key.rpartition("/")[2]) > 63:
        raise ValueError(f"invalid label key {key!r}")


def _check_value(value: str) -> None:
    if len(value) > 63 or not _LABEL_VALUE.match(value):
        raise ValueError(f"invalid label value {value!r}")


def parse_label_selector(selector: str) -> list[tuple[str, str, tuple[str, ...]]]:
    """A Kubernetes label selector as (key, operator, values) terms; operators are `=`, `!=`,
    `in`, `notin`, `exists` and `!` (does not exist)."""
    terms: list[tuple[str, str, tuple[str, ...]]] = []
    for term in _split_terms(selector):
        if not term.strip():
            raise ValueError("empty term in selector")
        if match := _SET_TERM.match(term):
            key, op, listed = match.groups()
            values = tuple(v.strip() for v in listed.split(",") if v.strip())
            _check_key(key)
            for value in values:
                _check_value(value)
            terms.append((key, op, values))
        elif match := _EQUALITY_TERM.match(term):
            key, op, value = match.groups()
            _check_key(key)
            _check_value(value)
            terms.append((key, "!=" if op == "!=" else "=", (value,)))
        elif match := _EXISTS_TERM.match(term):
            negated, key = match.groups()
            _check_key(key)
            terms.append((key, "!" if negated else "exists", ()))
        else:
            raise ValueError(f"unable to parse requirement {term.strip()!r}")
    return terms


def selector_to_match(
    terms: list[tuple[str, str, tuple[str, ...]]],
) -> tuple[dict[str, str], list[dict[str, object]]]:
    """The terms as a LabelSelector's (`matchLabels`, `matchExpressions`)."""
    labels: dict[str, str] = {}
    expressions: list[dict[str, object]] = []
    operators = {"in": "In", "notin": "NotIn", "exists": "Exists", "!": "DoesNotExist"}
    for key, op, values in terms:
        if op == "=":
            labels[key] = values[0]
        elif op == "!=":
            expressions.append({"key": key, "operator": "NotIn", "values": list(values)})
        else:
            entry: dict[str, object] = {"key": key, "operator": operators[op]}
            if values:
                entry["values"] = list(values)
            expressions.append(entry)
    return labels, expressions
