"""HPACK decoding for the lean transport: the `hpack` package's decoder, with Envoy's repeats
remembered.

Envoy opens every ext_proc stream with the same request headers (method, path, authority,
content type, the EPP's token). After the first stream each of them is in HPACK's dynamic
table, so every later block is the same few bytes of indexed fields, and decoding it again
(about 40 µs in `hpack`, a third of the transport's work per request) gives the same list.
A block made only of indexed fields neither reads nor changes anything but the table, and the
table changes only through other blocks, so such a block's headers are remembered until the
next block that is not (RFC 7541 section 6.1). A size update or a literal clears them.
"""

from __future__ import annotations

from typing import Any

import hpack

_REMEMBERED = 32  # distinct all-indexed blocks kept: Envoy sends one or two kinds


def only_indexed(block: bytes) -> bool:
    """Whether `block` is nothing but Indexed Header Field representations (RFC 7541 6.1):
    each starts with bit 7 set, its index a 7-bit-prefix integer (5.1)."""
    at, size = 0, len(block)
    while at < size:
        first = block[at]
        at += 1
        if not first & 0x80:
            return False
        if first & 0x7F == 0x7F:  # the index goes on in continuation bytes
            while True:
                if at >= size:
                    return False
                more = block[at]
                at += 1
                if not more & 0x80:
                    break
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
        headers = list(self._decoder.decode(block, raw=True))
        if not only_indexed(block):
            self._remembered.clear()  # the dynamic table may have changed
        elif len(self._remembered) < _REMEMBERED:
            self._remembered[block] = headers
        return headers
