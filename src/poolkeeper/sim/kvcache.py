"""The KV cache of one engine: a fixed pool of blocks, with automatic prefix caching.

Block accounting follows vLLM's V1 KV cache manager in spirit, without block ids:
- A request holds an ordered list of blocks. Blocks covering *full prompt blocks* are named by
  a chained hash (so identical prefixes share them); the rest (partial prompt block, output
  tokens) are private and anonymous.
- A hashed block is cached from the moment it is allocated for computation (as vLLM does) and
  shared by reference count. When its last user frees it, it stays cached but becomes
  evictable; evictable blocks are reused least-recently-freed first.
- Usage (what vllm:kv_cache_usage_perc reports) counts referenced blocks only: evictable cached
  blocks are free space.

With a `sink`, the cache reports what it stores and evicts, as vLLM's KV events do
(BlockStored when a hashed block is filled, BlockRemoved when an evictable one is reused).
Output blocks are named as they fill, as vLLM's are (`cache_private`, called by the engine
when it plans the step whose computation completes a block): the chain goes on over the output text
(`output_block_hash`), so a cached answer is found again by the prompt that repeats it. The
engine groups what one step stored and evicted into one batch (`EngineModel.kv_step_end`).

`prompt_block_hashes` is the hashing contract: chunks of block_size tokens = block_size * 4
characters of prompt text (poolkeeper.tokens' rule), chained with xxh3-64, seeded by the target
model so that adapters do not share each other's cache.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Protocol

from poolkeeper.kvevents import chain_root, engine_block_hashes, next_block_hash
from poolkeeper.sim.textgen import text_between
from poolkeeper.tokens import CHARS_PER_TOKEN


def prompt_block_hashes(text: str, block_size: int, model: str = "") -> list[int]:
    """Chained hashes of each *full* block of `text` (block_size * 4 characters per block);
    the contract lives with the KV events (`kvevents.py`), which the EPP matches."""
    return engine_block_hashes(model, text, block_size)


def output_block_hash(
    model: str, prompt: str, seed: int, index: int, parent: int | None, block_size: int
) -> int:
    """The hash of block `index` of prompt + output text (the output of stream `seed`,
    sim/textgen.py), chained to `parent` (the block before; None for the first): what
    `engine_block_hashes` gives for that block of the whole text."""
    chunk = block_size * CHARS_PER_TOKEN
    start, stop = index * chunk, (index + 1) * chunk
    head = prompt[start:stop]
    # The output's characters of this block, from its token pieces (4 characters each).
    first = max(0, start - len(prompt))
    last = stop - len(prompt)
    token0 = first // CHARS_PER_TOKEN
    tail = text_between(seed, token0, -(-last // CHARS_PER_TOKEN))
    offset = first - token0 * CHARS_PER_TOKEN
    piece = head + tail[offset : offset + chunk - len(head)]
    return next_block_hash(chain_root(model) if parent is None else parent, piece)


class KVEventSink(Protocol):
    """Who hears about the cache's contents: a KV-event publisher, or in virtual time the
    routers' exact indexes directly. Called synchronously from the engine's step."""

    def stored(self, hashes: list[int], parent: int | None) -> None: ...

    def removed(self, hashes: list[int]) -> None: ...


class PrefixKVCache:
    """Block pool with reference-counted, LRU-evicted prefix blocks. Pure bookkeeping."""

    __slots__ = ("_evictable", "_refcount", "caching", "num_blocks", "referenced", "sink")

    def __init__(self, num_blocks: int, *, caching: bool = True) -> None:
        self.num_blocks = num_blocks
        self.caching = caching
        self.referenced = 0  # blocks in use by at least one request
        self._refcount: dict[int, int] = {}  # hash -> users (0 = evictable, still cached)
        self._evictable: OrderedDict[int, None] = OrderedDict()  # LRU order, oldest first
        self.sink: KVEventSink | None = None

    @property
    def free(self) -> int:
        """Blocks that can be handed out now (empty or evictable)."""
        return self.num_blocks - self.referenced

    @property
    def empty(self) -> int:
        """Free blocks that hold no cached prefix (taking them evicts nothing)."""
        return self.num_blocks - self.referenced - len(self._evictable)

    @property
    def usage(self) -> float:
        return self.referenced / self.num_blocks

    @property
    def cached_blocks(self) -> int:
        return len(self._refcount)

    def cached_prefix(self, hashes: list[int]) -> int:
        """How many leading blocks of `hashes` are in the cache right now."""
        if not self.caching:
            return 0
        count = 0
        refcount = self._refcount
        for h in hashes:
            if h not in refcount:
                break
            count += 1
        return count

    def can_allocate(self, hashes: list[int], private: int) -> bool:
        """Whether taking these hashed blocks and `private` new blocks fits now."""
        needed = private
        refcount = self._refcount
        for h in hashes:
            users = refcount.get(h)
            # A block someone else is using costs nothing; an evictable one is taken back
            # from the free pool; an absent one needs a fresh block.
            if users is None or users == 0:
                needed += 1
        return needed <= self.free

    def take_hashed(self, h: int, parent: int | None = None) -> None:
        """Reference the block named `h` (sharing it if cached, else filling a free block);
        `parent` is the block before it in its chain (for the BlockStored event)."""
        users = self._refcount.get(h)
        if users is None:
            self._make_room(1)
            self._refcount[h] = 1
            self.referenced += 1
            if self.sink is not None and self.caching:
                self.sink.stored([h], parent)
        elif users == 0:
            del self._evictable[h]
            self._refcount[h] = 1
            self.referenced += 1
        else:
            self._refcount[h] = users + 1

    def cache_private(self, h: int, parent: int | None) -> None:
        """One of a request's private blocks just filled and is named `h` (an output block:
        vLLM's `cache_full_blocks`); `parent` is the block before it in its chain. If an
        identical block is cached already, the request shares it and its own is freed (vLLM
        keeps both; the count of free blocks is what matters here)."""
        users = self._refcount.get(h)
        if users is None:
            self._refcount[h] = 1  # the same block, now named: `referenced` is unchanged
            if self.sink is not None and self.caching:
                self.sink.stored([h], parent)
        elif users == 0:
            del self._evictable[h]  # referenced again (+1), the private one freed (-1)
            self._refcount[h] = 1
        else:
            self._refcount[h] = users + 1
            self.referenced -= 1

    def take_private(self, count: int) -> None:
        self._make_room(count)
        self.referenced += count

    def release(self, hashes: list[int], private: int) -> None:
        """Give back a request's blocks. Hashed ones stay cached; the tail is evicted first."""
        self.referenced -= private
        refcount = self._refcount
        for h in reversed(hashes):
            users = refcount[h] - 1
            if users == 0:
                self.referenced -= 1
                if self.caching:
                    refcount[h] = 0
                    self._evictable[h] = None
                else:
                    del refcount[h]
            else:
                refcount[h] = users

    def _make_room(self, count: int) -> None:
        """Evict least-recently-freed cached blocks until `count` empty blocks exist."""
        if self.referenced + count > self.num_blocks:
            raise RuntimeError("KV cache over-allocated; callers must check can_allocate")
        empty = self.num_blocks - self.referenced - len(self._evictable)
        evicted: list[int] = []
        while empty < count:
            h, _ = self._evictable.popitem(last=False)
            del self._refcount[h]
            evicted.append(h)
            empty += 1
        if evicted and self.sink is not None:
            self.sink.removed(evicted)
