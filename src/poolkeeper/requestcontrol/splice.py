"""A large body's long JSON string, decoded piece by piece while the body is still arriving.

A 1 MiB chat request is almost all one string (the prompt), and decoding it (orjson: UTF-8,
escapes, control characters, the new `str`) was the largest single piece of work left after
the last body byte: ~0.5 ms on the request's path. The ext_proc stream brings the body in a
few messages over a millisecond or more; `StringSplice` is fed each as it comes and decodes
the string's part in it then, so that after the last one only that message's part, the
joining of the parts and the rest of the body (with the string cut out) remain.

Exactness: the result is used only where it is provably what `body.decode_json_object(body)`
returns, and anything else falls back to that (which also words every error):

- each part is decoded by orjson as a whole JSON string (`"` + part + `"`), cut only where
  no escape sequence or UTF-8 character is split, so the parts' concatenation is the exact
  content of a string that starts at the opening quote and ends at the closing one;
- the rest of the body, with the content replaced by a random alphanumeric *placeholder*,
  goes through `decode_json_object` (every guard of the fast path applies to it unchanged),
  and the placeholder must occur once in its text and once among its decoded string values.
  Then the bytes before the opening quote are the body's own, so the quote opens a string
  in the body as in the stand-in; the string ends at the closing quote in both; the bytes
  after it are the body's own. So the body decodes exactly as the stand-in does, with the
  placeholder's value replaced by the decoded parts.

Where the string is found does not matter for that argument (a wrong guess fails a check):
the last unescaped quote of the body so far once it has `SPLICE_FROM` bytes. A string that
holds more than `_MAX_HOPS` quotes in all is given up (each costs a step in Python).
Pure and synchronous.
"""

from __future__ import annotations

import uuid
from typing import Any

from poolkeeper.errors import BadRequest
from poolkeeper.requestcontrol.body import decode_json_object, fast_string

SPLICE_FROM = 65_536  # the body so far, before a string is looked for (small bodies: never)
_MAX_HOPS = 1_024  # quotes looked at per body (escaped quotes in the string, the search)
_QUOTE = 0x22
_BACKSLASH = 0x5C


class StringSplice:
    """Feed a request body's chunks in order (`feed`), then ask for the decoded body
    (`payload`). Keeps references to the chunks it has not decoded yet, never copies them
    whole."""

    __slots__ = ("_base", "_chunks", "_dead", "_done", "_end", "_hops", "_size", "_start", "_texts")

    def __init__(self) -> None:
        self._chunks: list[bytes | memoryview] = []  # from absolute offset `_base` on
        self._base = 0
        self._size = 0
        self._start = -1  # the string's opening quote (absolute), -1 until chosen
        self._done = 0  # its content decoded up to here (absolute)
        self._end = -1  # its closing quote, -1 while open
        self._texts: list[str] = []
        self._hops = 0
        self._dead = False

    def feed(self, chunk: bytes | memoryview, *, last: bool = False) -> None:
        """The body's next chunk (`last`: the body ends with it)."""
        if not chunk:
            return
        self._size += len(chunk)
        if self._dead or self._end >= 0:
            return
        self._chunks.append(chunk)
        if self._start < 0:
            # Chosen only while more is to come: a body complete in one message gains nothing.
            if last or self._size < SPLICE_FROM:
                return
            self._start = self._opening_quote()
            if self._start < 0:
                self._dead = True
                return
            self._done = self._start + 1
        self._decode_more(last=last)

    @property
    def decoded_bytes(self) -> int:
        """How far into the body the string is decoded (0: not taken on, or given up)."""
        if self._dead or self._start < 0:
            return 0
        return self._end + 1 if self._end >= 0 else self._done

    def payload(self, body: bytes) -> dict[str, Any] | None:
        """The decoded `body` (all chunks fed), exactly `decode_json_object(body)`'s; None
        where that cannot be shown (then decode the body whole)."""
        if self._dead or self._end < 0 or self._size != len(body):
            return None
        placeholder = "pk" + uuid.uuid4().hex
        marker = placeholder.encode()
        view = memoryview(body)
        stand_in = b"".join((view[: self._start + 1], marker, view[self._end :]))
        first = stand_in.find(marker)
        if stand_in.find(marker, first + 1) >= 0:
            return None
        try:
            value = decode_json_object(stand_in)
        except BadRequest:
            return None
        if not _replace_once(value, placeholder, "".join(self._texts)):
            return None
        return value

    # -- the string's parts ---------------------------------------------------------------
    def _opening_quote(self) -> int:
        """The last quote of the body so far not preceded by an odd backslash run, or -1."""
        at = self._size
        while self._hops < _MAX_HOPS:
            self._hops += 1
            at = self._rfind_quote(at)
            if at < 0 or self._backslashes_before(at) % 2 == 0:
                return at
        return -1

    def _decode_more(self, *, last: bool) -> None:
        # The undecoded bytes between stand-in quotes, as one buffer (the one copy).
        window = bytearray().join([b'"', *self._views(self._done, self._size), b'"'])
        close = self._closing_quote(window)
        if close < 0 and self._dead:
            return
        if close >= 0:
            del window[close + 1 :]
            self._end = self._done + close - 1
        elif last:
            self._dead = True  # the string does not end: not a string after all
            return
        else:
            cut = _safe_cut(window, len(window) - 1)
            if cut <= 1:
                return  # nothing whole yet
            window[cut] = _QUOTE  # shortened in place: no new buffer
            del window[cut + 1 :]
            self._done += cut - 1
        text = fast_string(window)
        if text is None:
            self._dead = True
            return
        self._texts.append(text)
        self._drop_before(self._done if self._end < 0 else self._size)

    def _closing_quote(self, window: bytearray) -> int:
        """Index in `window` of the first unescaped quote between its stand-in quotes, or -1."""
        at, stop = 0, len(window) - 1
        while True:
            at = window.find(b'"', at + 1, stop)
            if at < 0:
                return -1
            self._hops += 1
            if self._hops > _MAX_HOPS:
                self._dead = True
                return -1
            run = 0
            while window[at - 1 - run] == _BACKSLASH:  # window[0] is a quote: stops there
                run += 1
            if run % 2 == 0:
                return at

    # -- bytes across chunks ----------------------------------------------------------------
    def _views(self, lo: int, hi: int) -> list[memoryview]:
        out: list[memoryview] = []
        at = self._base
        for chunk in self._chunks:
            n = len(chunk)
            if at + n > lo and at < hi:
                out.append(memoryview(chunk)[max(lo - at, 0) : min(hi - at, n)])
            at += n
        return out

    def _drop_before(self, position: int) -> None:
        while self._chunks and self._base + len(self._chunks[0]) <= position:
            self._base += len(self._chunks.pop(0))

    def _rfind_quote(self, before: int) -> int:
        """The last quote before absolute `before` among the chunks kept, or -1."""
        hi = self._size
        for chunk in reversed(self._chunks):
            lo = hi - len(chunk)
            if lo < before:
                found = bytes(chunk[: before - lo]).rfind(b'"')
                if found >= 0:
                    return lo + found
            hi = lo
        return -1

    def _backslashes_before(self, position: int) -> int:
        """How many backslashes end the body just before absolute `position`."""
        run = 0
        while position - run > self._base and self._byte(position - run - 1) == _BACKSLASH:
            run += 1
        return run

    def _byte(self, position: int) -> int:
        at = self._base
        for chunk in self._chunks:
            if position < at + len(chunk):
                return chunk[position - at]
            at += len(chunk)
        raise IndexError(position)


def _safe_cut(window: bytearray, cut: int) -> int:
    """Where a part of `window[:cut]` may end (an index > 0; the rest waits for the next
    chunk): not inside a UTF-8 character nor inside an escape sequence."""
    # An incomplete UTF-8 character at the end: cut before its first byte.
    lead = cut - 1
    while lead > 0 and cut - lead < 4 and 0x80 <= window[lead] < 0xC0:
        lead -= 1
    if window[lead] >= 0xC0:
        need = 2 if window[lead] < 0xE0 else 3 if window[lead] < 0xF0 else 4
        if cut - lead < need:
            cut = lead
    # An escape that starts in the last 6 bytes and does not end before the cut.
    for start in range(cut - 1, max(cut - 6, 1) - 1, -1):
        if window[start] != _BACKSLASH:
            continue
        run = 1
        while window[start - run] == _BACKSLASH:
            run += 1
        if run % 2 == 0:
            continue  # an escaped backslash: complete
        size = 6 if start + 1 < cut and window[start + 1] == ord("u") else 2
        if start + size > cut:
            cut = start
        break
    return cut


def _replace_once(value: Any, placeholder: str, text: str) -> bool:
    """Put `text` where the one string value equal to `placeholder` is; False unless there
    is exactly one."""
    found: list[tuple[Any, Any]] = []
    stack: list[Any] = [value]
    while stack:
        item = stack.pop()
        pairs = item.items() if type(item) is dict else enumerate(item)
        for key, child in pairs:
            if type(child) is str:
                if child == placeholder:
                    found.append((item, key))
            elif type(child) is dict or type(child) is list:
                stack.append(child)
    if len(found) != 1:
        return False
    container, key = found[0]
    container[key] = text
    return True
