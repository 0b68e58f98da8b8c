"""What the KV-event path counted, as plain data for /metrics (`telemetry/kv_collector.py`).

The counting is plain integer attributes on the objects that do the work: a followed
endpoint's `EndpointFeed` (the subscriber), the `ExactPrefixIndex`'s counters, and the receive
thread's `handed`. Nothing is locked or allocated per message for it; a scrape reads them into
a `KVEventsReading` (`KVEventSubscriber.reading`), on the event loop that writes all of them
but `handed`. Why that one is safe to read from the loop: only the receive thread writes it
(an int attribute read under the GIL is whole, never torn) and it is incremented before the
message is handed to the loop, so it is never below the loop's own count of messages taken
(`KVEventSubscriber.delivered`), read first: the queue depth it gives is never negative. What
is derived is not counted: batches applied are the messages neither malformed nor undecodable,
and the loop's deliveries the sum of its endpoints' messages (measured: the counting adds
about 0.1 us to the 6 us a one-event batch costs on the loop; the note of 2026-12-08).

Labels stay bounded by configuration: one reading per prefix scorer with kvEvents (its plugin
name), one row per endpoint it follows (the pool's endpoints; forgotten ones leave).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, get_args

# Why an endpoint is on the approximate fallback (`ExactPrefixIndex.staleness`); the metrics
# list every value, in this order (one home: a new reason is a new label value there).
Staleness = Literal["no_events", "lost", "silent"]
STALENESS_REASONS: tuple[Staleness, ...] = get_args(Staleness)


@dataclass(slots=True)
class EndpointFeed:
    """One followed endpoint's subscription: its sequence and counters (written on the loop)."""

    expected: int = -1  # the next sequence number (-1: nothing heard yet)
    messages: int = 0  # messages taken off its socket
    gaps: int = 0  # sequence gaps (lost messages: its view dropped)
    bad_frames: int = 0  # messages not (topic, 8-byte sequence, payload): ignored
    bad_payloads: int = 0  # payloads that are not a KV-event batch: its view dropped
    over_bounds: int = 0  # payloads past a bound (`kvevents.py`): dropped, its view too
    connect_errors: int = 0  # its address refused by ZMQ (nothing is received then)
    reconnections: int = 0  # its subscription reopened (`KVEventSubscriber.reopen_unanswered`)
    backoff_s: float = 0.0  # the wait after its last reopening (0: not reopened lately)
    reopen_at: float = float("-inf")  # the decisions' clock: no reopening before then
    warned_at: float = float("-inf")  # monotonic time of its last warning (rate-limited)

    @property
    def applied(self) -> int:
        """Batches applied to the index: every other message (one increment less per batch)."""
        return self.messages - self.bad_frames - self.bad_payloads - self.over_bounds


@dataclass(frozen=True, slots=True)
class EndpointReading:
    endpoint: str  # ip:port, as the pool lists it
    feed: EndpointFeed  # a copy
    blocks: int  # blocks the index holds for it
    staleness: Staleness | None  # why its exact view is not used now (None: it is)


@dataclass(frozen=True, slots=True)
class KVEventsReading:
    """One subscriber and its index, read at scrape time."""

    endpoints: tuple[EndpointReading, ...]
    queued: int  # handed over by the receive thread, not applied yet (0 without it)
    admissions: int
    removals: int
    evictions: int
    unanchored: int
    lookups: int
    lookup_blocks: int
    lookup_hits: int
    max_blocks_per_endpoint: int
