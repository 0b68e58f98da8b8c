"""The approximate prefix-cache index: which endpoint probably holds which prompt prefix.

The router cannot see the servers' KV caches, so it mimics them from its own decisions: every
prompt is cut into fixed-size character blocks whose hashes are chained (block i's hash depends
on blocks 0..i, and block 0 on the target model), and after each decision the chosen endpoint is
recorded as holding all of the prompt's blocks, in a per-endpoint LRU as large as its cache.

Hashing: xxhash64 of block i (UTF-8), seeded with hash i-1; block 0 is seeded with the xxhash64
of the target model name, so different models or LoRA adapters never share entries. Chaining
through the seed instead of appending the previous hash to the content is equivalent in effect
and saves a copy per block. The trailing partial block is ignored; at most `max_blocks` count.

Not thread-safe (one event loop owns it). Memory: about 100-150 bytes per (endpoint, block)
entry in CPython, so size `capacity_per_endpoint` to the fleet (31,250 x 100 endpoints ~ 0.4 GB).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

import xxhash

_xxh64 = xxhash.xxh64_intdigest


def prefix_hashes(model: str, prompt: str, *, block_size: int, max_blocks: int) -> list[int]:
    """Chained block hashes of `prompt` for `model` (empty if shorter than one block)."""
    n = min(len(prompt) // block_size, max_blocks)
    if n <= 0:
        return []
    h = _xxh64(model.encode())
    out: list[int] = []
    append = out.append
    for start in range(0, n * block_size, block_size):
        h = _xxh64(prompt[start : start + block_size].encode(), h)
        append(h)
    return out


class PrefixIndex:
    """hash -> endpoints holding it, plus one LRU of hashes per endpoint (ip:port).

    A hash held by one endpoint (the common case) maps to that endpoint's key itself, not to
    a one-element set: strings are not tracked by the garbage collector, so a large index
    does not turn every full GC pass into a multi-millisecond stall on the request path.
    """

    __slots__ = ("_holders", "_lrus", "capacity_per_endpoint")

    def __init__(self, capacity_per_endpoint: int) -> None:
        if capacity_per_endpoint < 1:
            raise ValueError("capacity_per_endpoint must be >= 1")
        self.capacity_per_endpoint = capacity_per_endpoint
        self._holders: dict[int, str | set[str]] = {}
        self._lrus: dict[str, OrderedDict[int, None]] = {}

    def holders(self, h: int) -> frozenset[str]:
        """The endpoints recorded as holding block hash `h`."""
        held = self._holders.get(h)
        if held is None:
            return frozenset()
        return frozenset((held,)) if isinstance(held, str) else frozenset(held)

    def match(self, hashes: Sequence[int]) -> dict[str, int]:
        """Per endpoint, the number of consecutive leading blocks it holds (only those > 0)."""
        if not hashes:
            return {}
        holders = self._holders
        first = holders.get(hashes[0])
        if first is None:
            return {}
        if isinstance(first, str):
            # One candidate: walk its own LRU, no set arithmetic.
            lru = self._lrus[first]
            depth = 1
            for h in hashes[1:]:
                if h not in lru:
                    break
                depth += 1
            return {first: depth}
        matched: dict[str, int] = {}
        active = set(first)
        depth = 1
        for h in hashes[1:]:
            here = holders.get(h)
            if here is None:
                still: set[str] = set()
            elif isinstance(here, str):
                still = {here} if here in active else set()
            else:
                still = active & here
            if len(still) != len(active):
                for key in active - still:
                    matched[key] = depth
                if not still:
                    return matched
                active = still
            depth += 1
        for key in active:
            matched[key] = depth
        return matched

    def insert(self, endpoint: str, hashes: Sequence[int]) -> list[int]:
        """Record that `endpoint` now holds these blocks; evict its least recently used ones
        beyond the capacity and return them (oldest first; usually none).

        Blocks are touched from the last to the first, so the leading blocks (shared by the most
        prompts) are the most recent and a prompt's tail is evicted before its head, as in a
        server's prefix cache; evicting a head first would void the whole chain behind it.
        """
        lru = self._lrus.get(endpoint)
        if lru is None:
            lru = self._lrus[endpoint] = OrderedDict()
        holders = self._holders
        for h in reversed(hashes):
            if h in lru:
                lru.move_to_end(h)
                continue
            lru[h] = None
            held = holders.get(h)
            if held is None:
                holders[h] = endpoint
            elif isinstance(held, str):
                holders[h] = {held, endpoint}
            else:
                held.add(endpoint)
        excess = len(lru) - self.capacity_per_endpoint
        if excess <= 0:
            return []
        evicted = []
        for _ in range(excess):
            old, _none = lru.popitem(last=False)
            self._drop(old, endpoint)
            evicted.append(old)
        return evicted

    def holds(self, endpoint: str, h: int) -> bool:
        lru = self._lrus.get(endpoint)
        return lru is not None and h in lru

    def remove(self, endpoint: str, hashes: Sequence[int]) -> None:
        """`endpoint` no longer holds these blocks (the exact index's BlockRemoved)."""
        lru = self._lrus.get(endpoint)
        if lru is None:
            return
        for h in hashes:
            if h in lru:
                del lru[h]
                self._drop(h, endpoint)

    def clear(self, endpoint: str) -> None:
        """`endpoint` holds nothing any more (AllBlocksCleared, or its events were lost)."""
        for h in self._lrus.pop(endpoint, ()):
            self._drop(h, endpoint)

    def forget_endpoints(self, keep: set[str]) -> None:
        """Remove every endpoint not in `keep` (it left the pool) and its blocks."""
        for endpoint in [e for e in self._lrus if e not in keep]:
            for h in self._lrus.pop(endpoint):
                self._drop(h, endpoint)

    def _drop(self, h: int, endpoint: str) -> None:
        held = self._holders.get(h)
        if held is None:
            return
        if isinstance(held, str):
            if held == endpoint:
                del self._holders[h]
            return
        held.discard(endpoint)
        if len(held) == 1:
            self._holders[h] = next(iter(held))
        elif not held:
            del self._holders[h]

    def blocks(self, endpoint: str) -> int:
        """How many blocks the index attributes to `endpoint`."""
        lru = self._lrus.get(endpoint)
        return 0 if lru is None else len(lru)

    @property
    def size(self) -> int:
        """Total (endpoint, block) entries."""
        return sum(len(lru) for lru in self._lrus.values())

    def endpoints(self) -> list[str]:
        return list(self._lrus)
