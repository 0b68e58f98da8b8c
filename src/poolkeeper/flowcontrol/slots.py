"""`BatchSlots`: how many requests a server can run at once, learned from what the EPP sees.

Fair order holds only where the queue is: a request sent to a server whose batch is full waits
in the server's own first-come-first-served queue, out of the EPP's reach. So a queueing band
dispatches to a server only while it can *start* the request there (`dispatch: slot`, the
default), and the contended queue stays in the EPP whatever the servers' batch size.

What a server can run at once is not configured: it is learned per endpoint from the scraped
gauges. `running` never exceeds the batch (vLLM's `max_num_seqs`, or fewer when the KV cache
is the limit), so the most ever seen running is a number of slots the server really has; a
scrape with requests waiting *and* running says the batch was full then. Until a server has
shown a full batch, nothing is known and the band's saturation limit alone decides (batches
fill as before, and the first full batch seen is the server's real one). Once it has, the
server has a free slot while the EPP's own in-flight count there (exact, and current between
scrapes: it drops the moment a response ends) is below the learned slots. The saturation
limit (queue and KV thresholds) still applies on top: this only ever removes room.

No probing past the learned slots: a request sent as a probe waits in the server's queue
and takes the next slot that frees there, ahead of the EPP's fair order (measured on the
issue 35 case: beta/alpha 0.62 with a probe, see docs/flowcontrol.md).

Known limits: the learned slots never shrink (a server restarted at the same address with a
smaller batch queues up to the old count until the saturation limit holds it), and a server
first seen full while its KV cache limited the batch keeps that smaller count.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from poolkeeper.datastore.endpoint import EndpointState

_MAX_TRACKED = 4096  # endpoints remembered at most (pruned to the current ones beyond it)


@dataclass(slots=True)
class _Seen:
    slots: int = 0  # the most requests seen running at once
    full: bool = False  # a scrape showed requests waiting while some ran


class BatchSlots:
    """Per-endpoint learned batch slots (see the module docstring). One per EPP (or bench run)."""

    __slots__ = ("_seen",)

    def __init__(self) -> None:
        self._seen: dict[str, _Seen] = {}

    def observe(self, states: Sequence[EndpointState]) -> None:
        seen = self._seen
        if len(seen) > _MAX_TRACKED:
            keep = {s.key for s in states}
            self._seen = seen = {k: v for k, v in seen.items() if k in keep}
        for s in states:
            m = s.metrics
            if m.running <= 0:
                continue
            entry = seen.get(s.key)
            if entry is None:
                entry = seen[s.key] = _Seen()
            if m.running > entry.slots:
                entry.slots = m.running
            if m.waiting > 0 and not entry.full:
                entry.full = True

    def can_start(self, state: EndpointState) -> bool:
        """Whether `state`'s server would start one more request now (True while unknown)."""
        entry = self._seen.get(state.key)
        if entry is None or not entry.full:
            return True
        return state.inflight_requests < entry.slots

    def slots(self, state: EndpointState) -> int | None:
        """The learned slots of a server that has shown a full batch (None: not yet)."""
        entry = self._seen.get(state.key)
        return entry.slots if entry is not None and entry.full else None
