"""The events EPP replicas exchange about their own decisions, and the batch that carries them.

Why: N active-active replicas each see 1/N of the requests, so each one's prefill backlog,
in-flight counts and approximate prefix index hold only its own sends, and in a cold start each
replica places new prefixes as if the others had sent nothing (4 replicas, live: 1.29x one
replica's p90 TTFT with every other remedy; an oracle sharing one backlog: 0.91x;
docs/notes/2026-12-07-cold-placement-replicas.md). Each replica therefore publishes, as they
happen, the three facts the others cannot see:

- `Sent`: a request went to `endpoint` with `tokens` prompt tokens to prefill there (what the
  prefill backlog counts), `seen` whether its first byte will be reported (a streamed answer),
  `blocks` the approximate prefix index's block hashes of its prompt (the same function and
  parameters in every replica of a pool, so a peer can insert them as its own), `head` the
  engine block hash of its first block (the exact index's chain head), or None;
- `Answered`: its first byte came back (its prefill is over);
- `Ended`: it ended, whatever the outcome.

A `Batch` is what one replica (`origin`, a name unique among the replicas, stable for the
process's life) sends in one message: `seq` increases by one per batch from that origin, so a
receiver drops replays and sees gaps. Request ids are the origin's own, so a receiver keys
what it keeps by `(origin, request_id)`.

A batch may end with an `Open` statement: which of the origin's sends are still open (counted
in its own backlog) as of that batch. UDP loses datagrams, and a lost `Answered` or `Ended`
would otherwise leave its entry in every peer's backlog until the backlog's age limit (60 s);
a receiver drops that origin's entries, sent in this batch or before, that the statement no
longer covers (`openset.py`).

Plain frozen dataclasses: no I/O, no clock. The codec and transport (the edge) and the fold into
the scheduler's state (the core) are separate modules of this package.
"""

from __future__ import annotations

from dataclasses import dataclass

MAX_BLOCKS = 256  # block hashes carried per `Sent` (a longer prompt's tail is not shared)


@dataclass(frozen=True, slots=True)
class Sent:
    request_id: str
    endpoint: str  # the endpoint's key (hostport), as the datastore names it
    tokens: int  # prompt tokens to prefill there (the backlog's count)
    seen: bool  # its first byte will be reported
    blocks: tuple[int, ...] = ()  # approximate-index block hashes, at most MAX_BLOCKS
    head: int | None = None  # engine block hash of the prompt's first block


@dataclass(frozen=True, slots=True)
class Answered:
    request_id: str


@dataclass(frozen=True, slots=True)
class Ended:
    request_id: str


SyncEvent = Sent | Answered | Ended


@dataclass(frozen=True, slots=True)
class Open:
    """The origin's open sends as of its batch, one slice of them: the digests
    (`openset.digest`) of its open request ids whose digest modulo `2**shift` is `residue`
    (shift 0: all of them). Slices rotate, so a large open set is stated over several batches,
    each fitting one datagram."""

    shift: int
    residue: int
    digests: frozenset[int]


@dataclass(frozen=True, slots=True)
class Batch:
    origin: str
    seq: int
    events: tuple[SyncEvent, ...]
    open: Open | None = None  # the origin's open sends as of this batch (after its events)
