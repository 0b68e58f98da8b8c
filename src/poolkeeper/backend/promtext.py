"""A fast filter reader for the Prometheus text exposition format (0.0.4), sans I/O.

A model server's `/metrics` page has ~200 lines; the gateway needs five or six families of it,
twenty times a second per endpoint. `prometheus_client`'s parser builds every family and costs
milliseconds per page, so this reader looks only at the lines whose metric name is wanted and
parses just those (labels with escapes, NaN/±Inf values, optional millisecond timestamps).

Contract:
- `# HELP` / `# TYPE` / comment lines, blank lines and every sample line of an unwanted family
  are skipped without being validated.
- A sample line belongs to wanted family `F` when its metric name is `F`, or `F` followed by
  `_bucket`, `_sum`, `_count` or `_total` (histograms, summaries, counters) unless that longer
  name is itself wanted. Results are keyed by the wanted family name, lines in page order.
- Sample names given only through a `{__name__="..."}` label are not recognised.
- A malformed line of a wanted family raises `PromParseError` carrying its 1-based line number;
  the whole page is rejected (the scraper records the error and keeps the previous metrics),
  because a server that emits a broken line for a gauge we route on is not to be trusted for the
  rest of that page either.
- Timestamps are returned in seconds (the text format carries milliseconds), like
  `prometheus_client`.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Final

__all__ = ["FamilyFilter", "PromParseError", "Sample", "parse_families"]

_SUFFIXES: Final = ("_bucket", "_sum", "_count", "_total")

# One label `name="value"` (value with backslash escapes), then the following separator.
_LABEL_RE: Final = re.compile(
    r'[ \t]*([a-zA-Z_][a-zA-Z0-9_]*)[ \t]*=[ \t]*"((?:[^"\\]|\\.)*)"[ \t]*'
)
# Fast path: a whole well-formed `{...}` label block, then its pairs in one findall.
_PAIR: Final = r'[ \t]*[a-zA-Z_][a-zA-Z0-9_]*[ \t]*=[ \t]*"(?:[^"\\]|\\.)*"[ \t]*'
_BLOCK_RE: Final = re.compile(rf"\{{((?:{_PAIR},)*(?:{_PAIR})?)[ \t]*\}}")
_PAIR_RE: Final = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)[ \t]*=[ \t]*"((?:[^"\\]|\\.)*)"')
_ESCAPE_RE: Final = re.compile(r'\\[\\n"]')
_ESCAPES: Final = {"\\\\": "\\", "\\n": "\n", '\\"': '"'}


class PromParseError(ValueError):
    """A sample line of a wanted family is not valid Prometheus text."""

    def __init__(self, line_no: int, reason: str, line: str) -> None:
        shown = line if len(line) <= 120 else line[:117] + "..."
        super().__init__(f"line {line_no}: {reason}: {shown!r}")
        self.line_no = line_no
        self.reason = reason


@dataclass(frozen=True, slots=True)
class Sample:
    """One sample line: full sample name, its labels, value and optional timestamp (seconds).

    `labels` is a plain dict owned by this sample; treat it as read-only.
    """

    name: str
    labels: Mapping[str, str] = field(hash=False)
    value: float
    timestamp: float | None = None


def _unescape(match: re.Match[str]) -> str:
    return _ESCAPES[match.group(0)]


def _parse_number(token: str) -> float:
    # float() also accepts "1_000" and " 1"; the exposition format does not.
    if "_" in token:
        raise ValueError(token)
    return float(token)


class FamilyFilter:
    """A compiled reader for one set of wanted family names; reuse it across scrapes."""

    __slots__ = ("_family_of", "_line_re", "wanted")

    def __init__(self, wanted: frozenset[str]) -> None:
        self.wanted = wanted
        family_of: dict[str, str] = {}
        for family in wanted:
            for suffix in _SUFFIXES:
                family_of.setdefault(family + suffix, family)
        for family in wanted:
            family_of[family] = family  # an exactly wanted name wins over a suffixed one
        self._family_of = family_of
        # Longest names first so `a_count` is not read as `a` + garbage.
        names = sorted(family_of, key=len, reverse=True)
        alternatives = "|".join(re.escape(name) for name in names) or r"(?!)"
        # A wanted line: newline, optional indentation, the name, then `{`, a blank or the end.
        # Anchoring on a literal "\n" (instead of `^` with re.MULTILINE) lets the regex engine
        # jump between line starts with a memchr-style scan: ~6x faster on a vLLM page.
        self._line_re = re.compile(rf"\n[ \t]*({alternatives})(?=[{{ \t\r\n]|\Z)([^\n]*)")

    def parse(self, text: bytes | str) -> dict[str, list[Sample]]:
        """Samples of the wanted families found in `text`, by family name (absent if none)."""
        if isinstance(text, bytes | bytearray | memoryview):
            text = bytes(text).decode("utf-8", errors="replace")
        padded = "\n" + text  # so the first line starts after a newline too
        found: dict[str, list[Sample]] = {}
        family_of = self._family_of
        for match in self._line_re.finditer(padded):
            name, rest = match.group(1), match.group(2)
            try:
                sample = _parse_rest(name, rest)
            except ValueError as exc:
                line_no = padded.count("\n", 0, match.start() + 1)
                reason = str(exc) or "malformed sample"
                raise PromParseError(line_no, reason, match.group(0).strip()) from None
            found.setdefault(family_of[name], []).append(sample)
        return found


def _labels_fast(rest: str) -> tuple[dict[str, str], int] | None:
    """Labels of a well-formed block without duplicates, and where it ends; else None."""
    block = _BLOCK_RE.match(rest)
    if block is None:
        return None
    body = block.group(1)
    pairs = _PAIR_RE.findall(body)
    labels = dict(pairs)
    if len(labels) != len(pairs):
        return None
    if "\\" in body:
        labels = {k: _ESCAPE_RE.sub(_unescape, v) for k, v in labels.items()}
    return labels, block.end()


def _labels_checked(rest: str) -> tuple[dict[str, str], int]:
    """Label by label, to say exactly what is wrong (raises ValueError)."""
    labels: dict[str, str] = {}
    pos, end = 1, len(rest)
    while True:
        while pos < end and rest[pos] in " \t":
            pos += 1
        if pos < end and rest[pos] == "}":
            return labels, pos + 1
        match = _LABEL_RE.match(rest, pos)
        if match is None:
            raise ValueError("bad label syntax")
        label, value = match.group(1), match.group(2)
        if label in labels:
            raise ValueError(f"duplicate label {label!r}")
        labels[label] = _ESCAPE_RE.sub(_unescape, value) if "\\" in value else value
        pos = match.end()
        if pos < end and rest[pos] == ",":
            pos += 1
        elif pos < end and rest[pos] == "}":
            return labels, pos + 1
        else:
            raise ValueError("expected ',' or '}' after a label")


def _parse_rest(name: str, rest: str) -> Sample:
    """Parse what follows the metric name: `{labels}` (optional), value, timestamp (optional)."""
    labels: dict[str, str] = {}
    pos = 0
    if rest.startswith("{"):
        labels, pos = _labels_fast(rest) or _labels_checked(rest)
    elif rest and rest[0] not in " \t\r":
        raise ValueError("expected '{' or a blank after the metric name")
    tokens = rest[pos:].split()
    if not tokens:
        raise ValueError("missing value")
    if len(tokens) > 2:
        raise ValueError("unexpected text after the timestamp")
    try:
        value = _parse_number(tokens[0])
    except ValueError:
        raise ValueError(f"invalid value {tokens[0]!r}") from None
    timestamp: float | None = None
    if len(tokens) == 2:
        try:
            millis = _parse_number(tokens[1])
        except ValueError:
            raise ValueError(f"invalid timestamp {tokens[1]!r}") from None
        if not math.isfinite(millis):
            raise ValueError(f"invalid timestamp {tokens[1]!r}")
        timestamp = millis / 1000.0
    return Sample(name, labels, value, timestamp)


def parse_families(text: bytes | str, wanted: frozenset[str]) -> dict[str, list[Sample]]:
    """One-shot form of `FamilyFilter(wanted).parse(text)` (compile once when scraping)."""
    return FamilyFilter(wanted).parse(text)
