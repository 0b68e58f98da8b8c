"""`FullBatches`: which endpoints run a full batch, learned from the scraped gauges.

The saturation filter's `learnMaxNumSeqs` (saturation_filter.py): a queue at an engine means two
different things. With every batch slot taken (vLLM's `--max-num-seqs`), a waiting request
waits for a running one to finish, about a slot's share of an answer per place in the queue;
with a free slot it starts at the engine's next step, and the queue is only the current step's
arrivals (a step that prefills a new 2,000-token prompt holds them for its whole length). Only
the first is worth a prompt's prefill to avoid, so the filter counts a queue only on a full
batch, and this learns where that is without being told the engines' batch size:

- the batch is the most requests ever seen running there (running never exceeds it);
- it is *confirmed* full when two scrapes in a row show it running that many and the second
  shows a shorter queue that is not empty: requests left the queue (slots turned over) and the
  batch stayed full. A long prefill step cannot do that: nothing is admitted during it, so its
  queue only grows, and when it ends the queued requests join the batch and running grows past
  the old most (which starts the learning over).

Flow control learns slots on its own (`flowcontrol/slots.py`, per band, with the EPP's exact
in-flight count); this is the scheduler's view, from the gauges alone. One per filter instance.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from itertools import compress

from poolkeeper.datastore.columns import MIN_CACHED, changed, where_of
from poolkeeper.datastore.endpoint import EndpointState
from poolkeeper.scheduling.interfaces import CycleState

_MAX_TRACKED = 4096  # endpoints remembered at most (forgotten all at once beyond it)


@dataclass(slots=True)
class _Batch:  # (always true: no `__len__` or `__bool__`, which `FullBatches.full` relies on)
    slots: int = 0  # the most requests seen running
    full: bool = False  # confirmed: still `slots` running after its queue shrank
    at: float = -1.0  # `updated_at` of the scrape last looked at
    running: int = 0  # ... and what it showed
    waiting: int = 0


class FullBatches:
    """Per-endpoint learned batch (see the module docstring). Not thread-safe (the scheduler's
    loop calls it)."""

    __slots__ = ("_before", "_flags", "_reads", "_reads_then", "_seen")

    def __init__(self) -> None:
        self._seen: dict[str, _Batch] = {}
        self._reads = 0  # `_read` calls (each may change a batch)
        # `full`'s flags of its previous states (`columns.py`), valid while no batch was read
        # since but by `full` itself (`_reads_then`) and those states' ip:ports are distinct.
        self._before: list[EndpointState] | None = None
        self._flags: list[bool] = []
        self._reads_then = 0

    def slots(self, state: EndpointState) -> int | None:
        """`state`'s learned batch size once confirmed full, else None; reads a new scrape."""
        batch = self._seen.get(state.key)
        if batch is None or batch.at != state.metrics.updated_at:
            batch = self._read(state)
        return batch.slots if batch.full else None

    def full(
        self, states: Sequence[EndpointState], cycle: CycleState | None = None
    ) -> list[EndpointState]:
        """The states whose batch is confirmed full and runs at least that many (running,
        plus the unseen requests that answered), in order; reads every state's new scrape,
        in order (as `slots` per state). The saturation filter's pass: one lookup per state,
        and the scrape read only where it changed (once per scrape, not per decision). With
        `cycle`, each state's answer is kept for the next call, which works out only the
        states that are other objects than before (`columns.changed`): an unchanged state's
        batch was read by no one since (else all are worked out again), so its answer stands."""
        if cycle is None or len(states) < MIN_CACHED:
            return list(compress(states, self._full_flags(states)))
        snapshot, positions = changed(cycle, self._before, states)
        if (
            positions is None
            or self._reads != self._reads_then
            or len(self._seen) + len(positions) >= _MAX_TRACKED  # (no clear amid a patch)
        ):
            flags = self._full_flags(snapshot)
            self._before = snapshot if where_of(cycle, snapshot) is not None else None
        else:
            flags = self._flags
            before = self._before
            assert before is not None  # (`positions` are relative to it)
            if positions:
                flags = flags.copy()
                one = self._full_flag
                for i in positions:
                    s = snapshot[i]
                    if s.endpoint.hostport != before[i].endpoint.hostport:
                        break  # another endpoint there: ip:ports may repeat; all again
                    flags[i] = one(s)
                else:
                    positions = []
                if positions:
                    flags = self._full_flags(snapshot)
                    self._before = snapshot if where_of(cycle, snapshot) is not None else None
                else:
                    self._before = snapshot
            else:
                self._before = snapshot
        self._flags, self._reads_then = flags, self._reads
        return list(compress(snapshot, flags))

    def _full_flag(self, s: EndpointState) -> bool:
        """`_full_flags` of one state (a kept answer's patch)."""
        b = self._seen.get(s.endpoint.hostport)
        if b is None or b.at != s.metrics.updated_at:
            b = self._read(s)
        return b.full and s.metrics.running + s.unseen_answered >= b.slots

    def _full_flags(self, states: Sequence[EndpointState]) -> list[bool]:
        """Whether each state's batch is confirmed full and runs at least that many."""
        get, read = self._seen.get, self._read
        # One comprehension (no appends): a batch is read where it is new or its scrape is.
        # (Always a bool: `read`'s batch is true, so `b.full and ...` decides; mypy cannot
        # see through the walrus.)
        return [
            (  # type: ignore[misc]
                ((b := get(s.endpoint.hostport)) is not None and b.at == s.metrics.updated_at)
                or (b := read(s))
            )
            and b.full
            and s.metrics.running + s.unseen_answered >= b.slots
            for s in states
        ]

    def _read(self, state: EndpointState) -> _Batch:
        """`state`'s batch after reading its scrape (made on its first sight)."""
        m = state.metrics
        seen = self._seen
        self._reads += 1
        batch = seen.get(state.key)
        if batch is None:
            if len(seen) >= _MAX_TRACKED:
                seen.clear()
            batch = seen[state.key] = _Batch()
        if m.updated_at != batch.at:
            if m.running > batch.slots:
                batch.slots, batch.full = m.running, False
            elif (
                m.running == batch.slots
                and batch.running == batch.slots
                and 0 < m.waiting < batch.waiting
            ):
                batch.full = True
            batch.at, batch.running, batch.waiting = m.updated_at, m.running, m.waiting
        return batch

    def most(self, key: str) -> int | None:
        """The most requests seen running at `key` (its batch, confirmed full or not; None
        before any scrape showed one running)."""
        batch = self._seen.get(key)
        return batch.slots if batch is not None and batch.slots > 0 else None
