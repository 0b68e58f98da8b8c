"""`weighted_sum`: a profile's total per candidate, `sum_j columns[j][i] x factors[j] + offset`.

The profile sums one column per scorer that did not return a constant (its raw values, with
the scorer's weight folded into a factor). The obvious C-level form, `map(sum, zip(*map(mul,
column, repeat(factor)) ...))`, makes a float object per column per candidate before it adds
anything: at 1,000 candidates and five columns it cost about 225 us, a sixth of a default
decision. One comprehension that multiplies and adds inline (`x0 * w0 + x1 * w1 + ... + off`)
cost 140 us: the interpreter's float-specialised arithmetic, and one tuple unpack per candidate.
A comprehension cannot take a variable number of columns, so one is compiled per column count
up to `MAX_INLINE` (with and without the offset), once at import; more columns take the
general form.

Integer columns (the queue and running scorers' request counts, `AffineScores.top`) may come
with a table of their products instead of a factor (`table[x]` is `x * factor`, made once):
the product of an int and a float takes the interpreter's generic path, the table read its
specialised list index (two such columns: about 25 us of the sum at 1,000 candidates). Each
combination of table columns compiles once per `Summers` (one per profile), on first use.

Same floats: each term is the same product, added left to right (`0 + x` is `x`), then the
offset last, so the totals are bit-identical to the general form's (pickers compare them
exactly). The general form adds with `operator.add`, not `sum`: from Python 3.12 `sum`
compensates float rounding, which would make the two forms differ by a last bit. So the
totals equal the former `sum` form's on Python 3.11; on 3.12+ they can differ from what that
form gave there by a last bit (a near-tie may break the other way).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from functools import reduce
from itertools import repeat
from operator import add, mul
from typing import Final, cast

MAX_INLINE: Final = 8

_Summer = Callable[..., list[float]]


def _compile(k: int, offset: bool, tables: int = 0) -> _Summer:
    """`lambda c0..ck-1, w0..wk-1[, off]: [x0 * w0 + ... (+ off) for x0.. in zip(c0..)]`, with
    `w{j}[x{j}]` for each column j whose bit is set in `tables`."""
    cols = ", ".join(f"c{j}" for j in range(k))
    weights = ", ".join(f"w{j}" for j in range(k))
    names = ", ".join(f"x{j}" for j in range(k))
    terms = (f"w{j}[x{j}]" if tables >> j & 1 else f"x{j} * w{j}" for j in range(k))
    expr = " + ".join(terms) + (" + off" if offset else "")
    args = f"{cols}, {weights}" + (", off" if offset else "")
    # Generated from the column count only (no outside input reaches the source).
    source = (
        f"lambda {args}: [{expr} for {names}{',' if k == 1 else ''} in zip({cols}, strict=True)]"
    )
    return cast(_Summer, eval(source, {"zip": zip}))


# (k - 1) -> the summer of k columns, without and with an offset.
_PLAIN: Final = tuple(_compile(k, False) for k in range(1, MAX_INLINE + 1))
_OFFSET: Final = tuple(_compile(k, True) for k in range(1, MAX_INLINE + 1))


def weighted_sum(
    columns: Sequence[Sequence[float]], factors: Sequence[float], offset: float, n: int
) -> list[float]:
    """Per candidate `i < n`: `columns[0][i] * factors[0] + ... + offset` (each column `n`
    long; no column: `offset` for every candidate)."""
    k = len(columns)
    if not k:
        return [offset] * n if offset else [0.0] * n
    if k <= MAX_INLINE:
        if offset:
            return _OFFSET[k - 1](*columns, *factors, offset)
        return _PLAIN[k - 1](*columns, *factors)
    parts: list[Iterable[float]] = [
        map(mul, c, repeat(f)) for c, f in zip(columns, factors, strict=True)
    ]
    if offset:
        parts.append(repeat(offset, n))
    return [reduce(add, row, 0.0) for row in zip(*parts, strict=True)]


Factor = float | Sequence[float]  # a column's factor, or the table of its products


class Summers:
    """`weighted_sum` where some columns come with product tables (`tables`: bit j set when
    `factors[j]` is column j's table, `table[x] == x * factor` for its every value x); the
    compiled forms made on first use and kept here (one instance per profile)."""

    __slots__ = ("_compiled",)

    def __init__(self) -> None:
        self._compiled: dict[tuple[int, int, bool], _Summer] = {}

    def sum(
        self,
        columns: Sequence[Sequence[float]],
        factors: Sequence[Factor],
        offset: float,
        n: int,
        tables: int,
    ) -> list[float]:
        """As `weighted_sum`, each table column's term read from its table."""
        if not tables:
            return weighted_sum(columns, cast(Sequence[float], factors), offset, n)
        k = len(columns)
        if k > MAX_INLINE:  # the general form, each table read by a C-level map
            parts: list[Iterable[float]] = [
                map(cast(Sequence[float], f).__getitem__, c)  # type: ignore[arg-type]
                if tables >> j & 1
                else map(mul, c, repeat(cast(float, f)))
                for j, (c, f) in enumerate(zip(columns, factors, strict=True))
            ]
            if offset:
                parts.append(repeat(offset, n))
            return [reduce(add, row, 0.0) for row in zip(*parts, strict=True)]
        key = (k, tables, bool(offset))
        summer = self._compiled.get(key)
        if summer is None:
            summer = self._compiled[key] = _compile(k, bool(offset), tables)
        if offset:
            return summer(*columns, *factors, offset)
        return summer(*columns, *factors)
