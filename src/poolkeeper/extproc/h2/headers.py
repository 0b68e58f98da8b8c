"""HPACK decoding for the lean transport: the `hpack` package's decoder, with Envoy's repeats
remembered.

Envoy opens every ext_proc stream with the same request headers (method, path, authority,
content type, the EPP's token). After the first stream most of them are in HPACK's dynamic
table, and Envoy sends the rest (`:path` among them) as literals *without indexing*, so every
later block is the same bytes, and decoding it again (40-100 µs in `hpack`, Huffman strings
included, about a tenth of the EPP's work per request) gives the same list. A block whose
fields are indexed fields or literals without (or never) indexing reads the dynamic table but
does not change it (RFC 7541 sections 6.1, 6.2.2, 6.2.3), and the table changes only through
blocks with a literal *with* incremental indexing (6.2.1) or a size update (6.3); so such a
block's headers are remembered until the next block that may change the table, which clears
them.
"""

from __future__ import annotations

from typing import Any

import hpack

_REMEMBERED = 32  # distinct table-neutral blocks kept: Envoy sends one per method it calls


def _integer(block: bytes, at: int, prefix_bits: int) -> int:
    """Where the integer starting at `at` (RFC 7541 5.1, `prefix_bits` prefix) ends; -1 when
    the block ends inside it. The value itself is not needed."""
    if at >= len(block):
        return -1
    mask = (1 << prefix_bits) - 1
    first = block[at]
    at += 1
    if first & mask != mask:
        return at
    while at < len(block):
        more = block[at]
        at += 1
        if not more & 0x80:
            return at
    return -1


def _string(block: bytes, at: int) -> int:
    """Where the string literal at `at` (5.2: H bit, 7-bit-prefix length, octets) ends; -1
    when the block ends inside it."""
    if at >= len(block):
        return -1
    first = block[at]
    length = first & 0x7F
    at += 1
    if length == 0x7F:
        shift = 0
        length = 0
        while True:
            if at >= len(block) or shift > 28:
                return -1
            more = block[at]
            at += 1
            length |= (more & 0x7F) << shift
            shift += 7
            if not more & 0x80:
                break
        length += 0x7F
    end = at + length
    return end if end <= len(block) else -1


def table_neutral(block: bytes) -> bool:
    """Whether `block` is, whole and well-formed, nothing but indexed fields (6.1) and literals
    without or never indexing (6.2.2, 6.2.3): it neither changes the dynamic table nor depends
    on anything but it."""
    at, size = 0, len(block)
    while at < size:
        first = block[at]
        if first & 0x80:  # indexed field, 7-bit prefix
            at = _integer(block, at, 7)
        elif first & 0xE0 == 0:  # 0000xxxx / 0001xxxx: literal, 4-bit-prefix name index
            named = first & 0x0F
            at = _integer(block, at, 4)
            if at < 0:
                return False
            if named == 0:  # a new name as a string literal
                at = _string(block, at)
                if at < 0:
                    return False
            at = _string(block, at)
        else:  # 01xxxxxx: literal with incremental indexing; 001xxxxx: table size update
            return False
        if at < 0:
            return False
    return True


class HeaderDecoder:
    """`decode(block)`: the (name, value) byte pairs of one header block, in order."""

    __slots__ = ("_decoder", "_remembered")

    def __init__(self, max_header_list_size: int) -> None:
        self._decoder = hpack.Decoder(max_header_list_size=max_header_list_size)
        self._remembered: dict[bytes, list[Any]] = {}

    def decode(self, block: bytes) -> list[Any]:
        """Raises hpack's errors for a malformed block (the caller's COMPRESSION_ERROR)."""
        remembered = self._remembered.get(block)
        if remembered is not None:
            return remembered
        try:
            headers = list(self._decoder.decode(block, raw=True))
        except Exception:
            self._remembered.clear()  # a block cut short may have changed the table already
            raise
        if not table_neutral(block):
            self._remembered.clear()  # the dynamic table may have changed
        elif len(self._remembered) < _REMEMBERED:
            self._remembered[block] = headers
        return headers
