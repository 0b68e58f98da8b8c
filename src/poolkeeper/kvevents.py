"""KV-cache events in vLLM's wire format, and the engine's block-hashing contract.

vLLM (`--kv-events-config`, `vllm/distributed/kv_events.py`) publishes one `KVEventBatch` per
engine step on a ZMQ PUB socket as a three-frame message: topic, an 8-byte big-endian sequence
number, and the msgpack payload. The payload is `[ts, [event, ...], data_parallel_rank]`, each
event an array whose first item is its tag:

- `["BlockStored", block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium]`
  (newer vLLM appends lora_name and more; extra trailing items are ignored)
- `["BlockRemoved", block_hashes, medium]`
- `["AllBlocksCleared"]`

Newer vLLM encodes structs as maps (`{"type": "BlockStored", "block_hashes": ...}`); `decode`
reads both forms. Hashes are 64-bit integers (the simulator's) or bytes (vLLM's sha256 digests,
folded to an int so one index type serves both).

`engine_block_hashes` is the simulator's hashing contract, which the exact prefix index must
reproduce from the prompt: chunks of block_size x 4 characters (poolkeeper.tokens' rule),
chained xxh3-64, seeded by the model name. A real vLLM hashes token ids (sha256/cbor); matching
its events from a prompt needs its tokenizer, which the EPP does not have (not done here).

`msgpack` is an optional dependency (the `kv-events` extra): only encoding and decoding need it.

Bounds: a batch comes from a peer, so `decode` refuses (`KVEventBoundsError`) what no real engine
sends rather than allocate it: msgpack lengths past `MAX_ARRAY_LEN` / `MAX_MAP_LEN` /
`MAX_STR_LEN` / `MAX_BIN_LEN` (checked against the declared length before anything is
allocated), nesting past msgpack's own stack, more than `MAX_EVENTS_PER_BATCH` events, or a
BlockStored / BlockRemoved past `MAX_BLOCKS_PER_EVENT` hashes or `MAX_TOKENS_PER_EVENT` token
ids. How they are derived from vLLM (docs/notes/2026-12-08-kv-event-bounds.md): one batch per
engine step; a step schedules at most max_num_batched_tokens tokens, so it fills at most
max_num_batched_tokens / block_size blocks (one BlockStored per request carrying those blocks'
hashes and token ids) and evicts at most as many (one BlockRemoved per evicted block). Each
bound is 4x what a step of 1M scheduled tokens in blocks of 16 can send; the message itself is
capped by the subscriber's ZMQ `MAXMSGSIZE` (`MAX_MESSAGE_BYTES`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import xxhash

from poolkeeper.errors import ConfigError
from poolkeeper.tokens import CHARS_PER_TOKEN

# A step of 1M scheduled tokens (an extreme max_num_batched_tokens) in blocks of 16 fills 65,536
# blocks: token ids ~5 bytes each, hashes ~34 (sha256 digests) in BlockStored and again in
# BlockRemoved: ~9.5 MB on the wire. Each bound has headroom over that.
MAX_MESSAGE_BYTES = 16 * 1024 * 1024  # ZMQ MAXMSGSIZE: larger frames are never allocated
MAX_TOKENS_PER_EVENT = 1 << 22  # token ids in one BlockStored (4x 1M tokens)
MAX_BLOCKS_PER_EVENT = 1 << 18  # hashes in one BlockStored / BlockRemoved (4x 65,536)
MAX_EVENTS_PER_BATCH = 1 << 18  # events in one batch (a BlockRemoved per evicted block)
MAX_ARRAY_LEN = MAX_TOKENS_PER_EVENT  # the longest array a batch holds: one event's token ids
MAX_MAP_LEN = 64  # a struct as a map: about 10 fields in vLLM today
MAX_STR_LEN = 4096  # tags, medium, lora_name
MAX_BIN_LEN = 1024  # a block hash: a 32-byte digest


def chain_root(model: str) -> int:
    """The parent of a sequence's first block: the model's name hashed (adapters do not
    share each other's cache)."""
    return xxhash.xxh3_64_intdigest(model.encode())


def next_block_hash(parent: int, piece: str) -> int:
    """The hash of one block of text (block_size x 4 characters) after `parent`."""
    return xxhash.xxh3_64_intdigest(piece.encode("utf-8", "surrogatepass"), seed=parent)


def engine_block_hashes(model: str, prompt: str, block_size: int) -> list[int]:
    """Chained hashes of each *full* block of `prompt` (block_size tokens = x4 characters).
    The simulator extends the same chain over a request's output text as its blocks fill
    (`sim/kvcache.py` `output_block_hash`), as vLLM hashes output blocks."""
    chunk = block_size * CHARS_PER_TOKEN
    parent = chain_root(model)
    hashes: list[int] = []
    # Chunks of characters, not bytes, so a gateway working on str gets the same blocks.
    for start in range(0, len(prompt) - chunk + 1, chunk):
        parent = next_block_hash(parent, prompt[start : start + chunk])
        hashes.append(parent)
    return hashes


@dataclass(slots=True)
class BlockStored:
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int] = field(default_factory=list)
    block_size: int = 16
    lora_id: int | None = None
    medium: str | None = "GPU"


@dataclass(slots=True)
class BlockRemoved:
    block_hashes: list[int]
    medium: str | None = "GPU"


@dataclass(slots=True)
class AllBlocksCleared:
    pass


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


@dataclass(slots=True)
class KVEventBatch:
    ts: float
    events: list[KVEvent]
    data_parallel_rank: int | None = None


def _msgpack() -> Any:
    try:
        import msgpack
    except ImportError as exc:  # pragma: no cover - depends on the install
        raise ConfigError(
            "KV events need the msgpack package: pip install 'poolkeeper[kv-events]'"
        ) from exc
    return msgpack


def _event_array(event: KVEvent) -> list[Any]:
    if isinstance(event, BlockStored):
        return [
            "BlockStored",
            event.block_hashes,
            event.parent_block_hash,
            event.token_ids,
            event.block_size,
            event.lora_id,
            event.medium,
        ]
    if isinstance(event, BlockRemoved):
        return ["BlockRemoved", event.block_hashes, event.medium]
    return ["AllBlocksCleared"]


def encode(batch: KVEventBatch) -> bytes:
    """The msgpack payload of one batch, in vLLM's array form."""
    events = [_event_array(e) for e in batch.events]
    payload: bytes = _msgpack().packb([batch.ts, events, batch.data_parallel_rank])
    return payload


class KVEventError(ValueError):
    """A payload that is not a KV event batch."""


class KVEventBoundsError(KVEventError):
    """A payload past one of the module's bounds (dropped as a bad payload, counted apart)."""


def _hash(value: Any) -> int:
    if isinstance(value, bool):
        raise KVEventError(f"block hash must be an integer or bytes, not {value!r}")
    if isinstance(value, int):
        return value
    if isinstance(value, bytes):
        return int.from_bytes(value[:8], "big")
    raise KVEventError(f"block hash must be an integer or bytes, not {type(value).__name__}")


def _hashes(value: Any) -> list[int]:
    if not isinstance(value, list):
        raise KVEventError("block_hashes must be a list")
    if len(value) > MAX_BLOCKS_PER_EVENT:
        raise KVEventBoundsError(
            f"{len(value)} block hashes in one event, more than {MAX_BLOCKS_PER_EVENT}"
        )
    return [_hash(v) for v in value]


def _check_tokens(value: Any) -> None:
    """Token ids are not kept, but a peer must not send more than a step can store."""
    if isinstance(value, list) and len(value) > MAX_TOKENS_PER_EVENT:
        raise KVEventBoundsError(
            f"{len(value)} token ids in one BlockStored, more than {MAX_TOKENS_PER_EVENT}"
        )


def _event(raw: Any) -> KVEvent | None:
    """One event (None for an unknown tag: newer engines may add kinds)."""
    if isinstance(raw, dict):
        tag = raw.get("type")
        get = raw.get
        if tag == "BlockStored":
            _check_tokens(get("token_ids"))
            parent = get("parent_block_hash")
            return BlockStored(
                _hashes(get("block_hashes")),
                None if parent is None else _hash(parent),
                block_size=int(get("block_size") or 16),
                lora_id=get("lora_id"),
                medium=get("medium"),
            )
        if tag == "BlockRemoved":
            return BlockRemoved(_hashes(get("block_hashes")), get("medium"))
        return AllBlocksCleared() if tag == "AllBlocksCleared" else None
    if not isinstance(raw, list) or not raw:
        raise KVEventError("an event must be a non-empty array or a map")
    tag = raw[0]
    if tag == "BlockStored":
        if len(raw) < 5:
            raise KVEventError("BlockStored needs block_hashes, parent, token_ids, block_size")
        _check_tokens(raw[3])
        parent = raw[2]
        return BlockStored(
            _hashes(raw[1]),
            None if parent is None else _hash(parent),
            block_size=int(raw[4]),
            lora_id=raw[5] if len(raw) > 5 else None,
            medium=raw[6] if len(raw) > 6 else None,
        )
    if tag == "BlockRemoved":
        if len(raw) < 2:
            raise KVEventError("BlockRemoved needs block_hashes")
        return BlockRemoved(_hashes(raw[1]), raw[2] if len(raw) > 2 else None)
    return AllBlocksCleared() if tag == "AllBlocksCleared" else None


def decode(payload: bytes) -> KVEventBatch:
    """One batch from its msgpack payload (array or map form); `KVEventError` if malformed.
    Token ids are not kept: the index matches by hash, and they are most of a batch's size."""
    msgpack = _msgpack()
    try:
        raw = msgpack.unpackb(
            payload,
            raw=False,
            strict_map_key=False,
            max_array_len=MAX_ARRAY_LEN,
            max_map_len=MAX_MAP_LEN,
            max_str_len=MAX_STR_LEN,
            max_bin_len=MAX_BIN_LEN,
            max_ext_len=MAX_BIN_LEN,
        )
    except msgpack.StackError as exc:  # (a ValueError too: checked first)
        raise KVEventBoundsError("msgpack nested deeper than its unpacker's stack") from exc
    except ValueError as exc:
        if "exceeds max_" in str(exc):  # a declared length past a bound, before allocating
            raise KVEventBoundsError(f"msgpack length past a bound: {exc}") from exc
        raise KVEventError(f"not msgpack: {exc}") from exc
    if isinstance(raw, dict):
        ts, events, rank = raw.get("ts"), raw.get("events"), raw.get("data_parallel_rank")
    elif isinstance(raw, list) and len(raw) >= 2:
        ts, events, rank = raw[0], raw[1], raw[2] if len(raw) > 2 else None
    else:
        raise KVEventError("a batch must be [ts, events, rank] or a map")
    if not isinstance(ts, int | float) or not isinstance(events, list):
        raise KVEventError("a batch needs a numeric ts and a list of events")
    if len(events) > MAX_EVENTS_PER_BATCH:
        raise KVEventBoundsError(
            f"{len(events)} events in one batch, more than {MAX_EVENTS_PER_BATCH}"
        )
    decoded = [e for e in (_event(r) for r in events) if e is not None]
    return KVEventBatch(float(ts), decoded, rank if isinstance(rank, int) else None)
