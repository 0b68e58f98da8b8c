"""Label values that come from clients, capped and sanitised as upstream caps them: at most
`MAX_LABEL_CHARS` characters, control characters replaced, and at most a set number of distinct
values per label (the rest reported as `OTHER`), so neither many names nor long ones can bloat
/metrics."""

from __future__ import annotations

OTHER = "other"

MAX_LABEL_CHARS = 128  # longer client-supplied label values are cut (with a "..." marker)


def sanitize_label(value: str, limit: int = MAX_LABEL_CHARS) -> str:
    """A client-supplied label value made safe: control characters become "?", and a value
    longer than `limit` characters is cut to `limit` ending in "..."."""
    if value.isprintable() and len(value) <= limit:
        return value
    clean = "".join(c if c.isprintable() else "?" for c in value[: limit + 1])
    return clean if len(clean) <= limit else clean[: limit - 3] + "..."


class LabelCap:
    """Admits at most `limit` distinct (sanitised) values; the rest collapse into "other"."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._seen: set[str] = set()

    def __call__(self, value: str) -> str:
        # Empty stays empty (as upstream's bound); one admitted before is clean already.
        if not value or value in self._seen:
            return value
        value = sanitize_label(value)
        if value in self._seen:
            return value
        if len(self._seen) >= self.limit:
            return OTHER
        self._seen.add(value)
        return value
