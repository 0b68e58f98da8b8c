"""Router-side approximate prefix state used by the baseline policies.

Two shapes, as the peers describe them (reference/peers.md §3):

- `ApproxRadixTree`: the sglang-router / vllm-router `cache_aware` structure: one character radix
  tree shared by all workers; each node remembers which workers ("tenants") were sent text
  through it and when. A match returns the number of leading characters found and the tenants
  of the deepest node reached. Each worker's character count is capped; when a periodic
  eviction pass finds a worker above the cap, its least recently used leaves are removed.
- `BlockPrefixIndex`: fixed-size character blocks with chained hashes (block i's hash covers
  blocks 0..i), a per-worker LRU of hashes with an optional time-to-live. Dynamo's approximate
  indexer (`--no-kv-events`, 120 s TTL) and AIBrix's `prefix-cache` router keep this shape.

Both learn only from their own routing decisions: they never see the servers' real caches.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

import xxhash


def common_prefix_len(a: str, b: str) -> int:
    """Length of the common prefix of `a` and `b` (slice comparisons run at C speed)."""
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    lo, hi = 0, n  # a[:lo] == b[:lo] and a[:hi] != b[:hi]
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[lo:mid] == b[lo:mid]:
            lo = mid
        else:
            hi = mid
    return lo


@dataclass(slots=True, eq=False)
class _Node:
    text: str
    parent: _Node | None
    children: dict[str, _Node] = field(default_factory=dict)
    tenants: dict[str, float] = field(default_factory=dict)  # worker -> last access time


@dataclass(frozen=True, slots=True)
class RadixMatch:
    matched_chars: int
    tenants: Mapping[str, float]  # workers holding the deepest matched node, with access times


class ApproxRadixTree:
    """Character radix tree with per-worker ownership and a per-worker size cap."""

    def __init__(self, max_chars_per_worker: int) -> None:
        self._root = _Node("", None)
        self._max_chars = max_chars_per_worker
        self._chars: dict[str, int] = {}

    def chars(self, worker: str) -> int:
        return self._chars.get(worker, 0)

    def insert(self, text: str, worker: str, now: float) -> None:
        node = self._root
        node.tenants[worker] = now
        i = 0
        while i < len(text):
            child = node.children.get(text[i])
            if child is None:
                leaf = _Node(text[i:], node, tenants={worker: now})
                node.children[text[i]] = leaf
                self._chars[worker] = self._chars.get(worker, 0) + len(leaf.text)
                return
            common = common_prefix_len(child.text, text[i : i + len(child.text)])
            if common < len(child.text):
                child = self._split(node, child, common)
            if worker not in child.tenants:
                self._chars[worker] = self._chars.get(worker, 0) + len(child.text)
            child.tenants[worker] = now
            i += len(child.text)
            node = child

    def _split(self, parent: _Node, child: _Node, at: int) -> _Node:
        mid = _Node(child.text[:at], parent, tenants=dict(child.tenants))
        child.text = child.text[at:]
        child.parent = mid
        mid.children[child.text[0]] = child
        parent.children[mid.text[0]] = mid
        return mid

    def match(self, text: str) -> RadixMatch:
        node = self._root
        matched = 0
        while matched < len(text):
            child = node.children.get(text[matched])
            if child is None:
                break
            common = common_prefix_len(child.text, text[matched : matched + len(child.text)])
            matched += common
            node = child
            if common < len(child.text):
                break
        return RadixMatch(matched, node.tenants)

    def remove_worker(self, worker: str) -> None:
        for node in list(self._iter_nodes()):
            node.tenants.pop(worker, None)
        self._chars.pop(worker, None)
        self._prune(self._root)

    def evict(self) -> None:
        """Bring every worker above its cap back under it, oldest leaves first."""
        for worker, size in list(self._chars.items()):
            if size > self._max_chars:
                self._evict_worker(worker, size - self._max_chars)
        self._prune(self._root)

    def _iter_nodes(self) -> Iterable[_Node]:
        stack = list(self._root.children.values())
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())

    def _is_tenant_leaf(self, node: _Node, worker: str) -> bool:
        return all(worker not in c.tenants for c in node.children.values())

    def _evict_worker(self, worker: str, excess: int) -> None:
        heap: list[tuple[float, int, _Node]] = []
        for node in self._iter_nodes():
            if worker in node.tenants and self._is_tenant_leaf(node, worker):
                heap.append((node.tenants[worker], id(node), node))
        heapq.heapify(heap)
        while heap and excess > 0:
            _, _, node = heapq.heappop(heap)
            del node.tenants[worker]
            excess -= len(node.text)
            self._chars[worker] -= len(node.text)
            parent = node.parent
            if (
                parent is not None
                and parent is not self._root
                and worker in parent.tenants
                and self._is_tenant_leaf(parent, worker)
            ):
                heapq.heappush(heap, (parent.tenants[worker], id(parent), parent))

    def _prune(self, node: _Node) -> None:
        for key, child in list(node.children.items()):
            self._prune(child)
            if not child.tenants and not child.children:
                del node.children[key]


class BlockPrefixIndex:
    """Chained block hashes -> workers, with a per-worker LRU capacity and optional TTL."""

    def __init__(
        self, block_chars: int, capacity_per_worker: int, ttl: float | None = None
    ) -> None:
        self.block_chars = block_chars
        self._capacity = capacity_per_worker
        self._ttl = ttl
        self._holders: dict[int, set[str]] = {}
        self._lru: dict[str, OrderedDict[int, float]] = {}

    def hashes(self, model: str, text: str, max_blocks: int | None = None) -> list[int]:
        """Hashes of the full blocks of `text`, the first seeded with the model name."""
        n = len(text) // self.block_chars
        if max_blocks is not None:
            n = min(n, max_blocks)
        out: list[int] = []
        prev = xxhash.xxh64_intdigest(model.encode())
        for i in range(n):
            chunk = text[i * self.block_chars : (i + 1) * self.block_chars]
            prev = xxhash.xxh64_intdigest(chunk.encode() + prev.to_bytes(8, "little"))
            out.append(prev)
        return out

    def match(self, hashes: list[int], now: float) -> dict[str, int]:
        """Leading blocks each worker holds (workers holding none are absent)."""
        if not hashes:
            return {}
        active = {w for w in self._holders.get(hashes[0], ()) if self._live(w, hashes[0], now)}
        counts: dict[str, int] = {}
        for i in range(1, len(hashes)):
            if not active:
                break
            holders = self._holders.get(hashes[i], set())
            nxt = {w for w in active if w in holders and self._live(w, hashes[i], now)}
            for w in active - nxt:
                counts[w] = i
            active = nxt
        for w in active:
            counts[w] = len(hashes)
        return counts

    def _live(self, worker: str, h: int, now: float) -> bool:
        if self._ttl is None:
            return True
        lru = self._lru.get(worker)
        seen = None if lru is None else lru.get(h)
        return seen is not None and now - seen <= self._ttl

    def insert(self, worker: str, hashes: list[int], now: float) -> None:
        lru = self._lru.setdefault(worker, OrderedDict())
        for h in hashes:
            if h in lru:
                lru.move_to_end(h)
            else:
                self._holders.setdefault(h, set()).add(worker)
            lru[h] = now
        while len(lru) > self._capacity:
            old, _ = lru.popitem(last=False)
            holders = self._holders.get(old)
            if holders is not None:
                holders.discard(worker)
                if not holders:
                    del self._holders[old]

    def blocks(self, worker: str) -> int:
        return len(self._lru.get(worker, ()))
