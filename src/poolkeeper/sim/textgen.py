"""Deterministic pseudo-text for generated tokens: cheap, seeded, 4 characters per token.

Each token is one 4-character piece from a fixed list (a space and a 3-letter word), so the
text of n tokens is 4n characters and poolkeeper.tokens counts it back as n tokens. Pieces are
plain ASCII letters and spaces: they need no JSON escaping, which keeps streaming cheap.
"""

from __future__ import annotations

import xxhash

_WORDS_TEXT = (
    "the and for are but not you all any can had her was one our out day get has him his how "
    "man new now old see two way who boy did its let put say she too use act add age ago air "
    "arm art ask bad bag bed big bit box bus buy car cat cup cut dog dry due eat end eye far "
    "few fit fly fun gas god gun hat hit hot ice job key kid law lay leg lie lot low map mix "
    "net oil own pay per raw red run sea set sit six sky son sun tax tea ten tie top try war "
    "web win yes yet"
)
PIECES: tuple[str, ...] = tuple(" " + w for w in _WORDS_TEXT.split(" "))


def token_text(seed: int, index: int) -> str:
    """The text of token `index` of the stream named by `seed`."""
    return PIECES[(seed + index * 7919) % len(PIECES)]


def text_between(seed: int, start: int, stop: int) -> str:
    """Text of tokens start..stop-1 (4 characters each)."""
    n = len(PIECES)
    return "".join(PIECES[(seed + i * 7919) % n] for i in range(start, stop))


def stream_seed(server_seed: int, request_id: str) -> int:
    """A per-request text seed, stable for a given server seed and request id."""
    return xxhash.xxh3_64_intdigest(request_id.encode(), seed=server_seed & 0xFFFFFFFFFFFFFFFF)
