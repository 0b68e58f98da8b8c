"""`BatchSlots`: how many requests a server can run at once, learned from what the EPP sees.

Fair order holds only where the queue is: a request sent to a server whose batch is full waits
in the server's own first-come-first-served queue, out of the EPP's reach. So a queueing band
dispatches to a server only while it can *start* the request there (`dispatch: slot`, the
default), and the contended queue stays in the EPP whatever the servers' batch size.

What a server can run at once is not configured: it is learned per endpoint from the scraped
gauges. `running` never exceeds the batch (vLLM's `max_num_seqs`, or fewer when the KV cache
is the limit), so the most ever seen running is a number of slots the server really has; two
scrapes in a row with requests waiting and no more running say the batch is full (one is not
enough: a request that just arrived waits for the engine's next step, and a batch filling up
shows a queue while its running count still grows; learning the batch then froze it half
full: 2 x 64 slots served half the tokens). Once it has, the server has a free slot while
the EPP's own in-flight count there (exact, and current between scrapes: it drops the moment
a response ends) is below the learned slots plus a short server queue (`_cap`). Until then,
while the EPP's requests there exceed the most seen running by less than the band's queue
allowance (`queueDepthThreshold` x `saturationLimit`, 6 for Standard) and fewer than that
wait as scraped (other senders): the in-flight count being exact, a batch fills at once
instead of 6 requests per scrape (what counting the requests sent since the last scrape as
waiting allowed: 24 of 64 slots busy with 30-token answers). The band's KV threshold still
applies on top (`headroom.py`), and a band with `dispatch: slot` places a request only on
an endpoint that can start it (a busy server's queue would take it out of the fair order).

A full batch is believed only while its server keeps showing a queue, and for `FULL_FOR_S`
after: a queue can also come from a long prefill step (a 2,000-token prompt holds the next
requests for a step of a third of a second over several scrapes), and a batch believed full at
4 of 256 slots held shared-prefix chat at 0.5x capacity to p90 TTFT 28 s until it was
forgotten. The short server queue of `_cap` (at least one request, even on a 2-slot server)
is what keeps a full batch showing its queue while the EPP holds work back, and what finds a
larger batch (the extra request starts: the most seen running grows). With no queue at all
(`slots // 8`, zero below 8 slots), a 2-slot server showed none, its batch was forgotten
every second, and the band's whole allowance of 7 went into its own FCFS queue each time:
live, beta/alpha 0.39-0.61 on the issue 35 case (virtual time hid it: there a request waits
for the engine's next step, so scrapes kept catching a queue). Forgotten or not yet full, a
server seen running N gets at most max(min(allowance, N), N / 2) more (`can_start`).
When every endpoint's gauges are stale (a scraper late on a loaded machine), a learned batch
and the in-flight count still judge (`can_start_blind`, used by `headroom.py`). On a LoRA
server that defers adapter requests, the in-flight count used is `holding`: the EPP's requests
there for adapters without a slot wait for an adapter slot, not a batch slot (`deferred`, by
the in-flight count per target model), and the scraped queue less them is `queued`.

Known limits: the learned slots never shrink (a server restarted at the same address with a
smaller batch queues up to the old count), and a server first seen full while its KV cache
limited the batch keeps that smaller count.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from poolkeeper.datastore.endpoint import EndpointState

FULL_FOR_S = 1.0  # a full batch is believed this long after its server last showed a queue
_MAX_TRACKED = 4096  # endpoints remembered at most (pruned to the current ones beyond it)


@dataclass(slots=True)
class _Seen:
    slots: int = 0  # the most requests seen running at once
    full: bool = False  # two scrapes in a row showed requests waiting and no more running
    last_at: float = 0.0  # the scrape last looked at (its `updated_at`)
    queued_at: int = -1  # running at that scrape if requests were waiting then, else -1
    full_at: float = 0.0  # the last scrape that showed the full batch's queue


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
            if m.updated_at == entry.last_at:
                continue  # the same scrape as last time
            entry.last_at = m.updated_at
            if m.running > entry.slots:
                entry.slots = m.running
            # Requests that just arrived wait until the engine's next step: one scrape with a
            # queue says nothing. A queue on two scrapes in a row while the running count did
            # not grow is a full batch.
            if m.waiting > 0 and not _maybe_deferred(s):
                if entry.full or (entry.queued_at >= 0 and m.running <= entry.queued_at):
                    entry.full, entry.full_at = True, m.updated_at
                entry.queued_at = m.running
            else:
                entry.queued_at = -1
                if entry.full and m.updated_at - entry.full_at > FULL_FOR_S:
                    entry.full = False  # no queue for a while: the batch may be larger

    def can_start(self, state: EndpointState, queue: float, adapter: str | None = None) -> bool:
        """Whether `state`'s server would start one more request now. Once it has shown a
        full batch: while the EPP's in-flight count there is below `_cap`. Before: while
        fewer than `queue` (the band's queue allowance; at most the most seen running) of the
        EPP's requests there would wait beyond the most it has been seen running, and fewer
        than `queue` wait as scraped (other senders)."""
        entry = self._seen.get(state.key)
        held = holding(state)
        if entry is not None and entry.full:
            return held < _cap(entry.slots)
        slots = 0 if entry is None else entry.slots
        # Beyond the most seen running: half as many again, at least the band's allowance
        # or as many again, whichever is fewer: a large batch fills geometrically (+6 per
        # scrape took 5 s to fill 2 x 256 slots: 0.88 of the goodput without flow control),
        # and a server seen running 2 gets 2 more, not the whole allowance of 7 (that put 7
        # requests into its own queue, out of the fair order).
        if held - slots >= (queue if slots == 0 else max(min(queue, slots), slots / 2)):
            return False
        m = state.metrics
        if adapter in m.active_adapters and adapter not in m.waiting_adapters:
            return True  # the queue is other adapters' deferred requests (load.py)
        return queued(state) < queue

    def can_start_blind(self, state: EndpointState, queue: float | None = None) -> bool:
        """Without fresh gauges, by the EPP's own in-flight count at `state`'s server. `queue`
        None (slot dispatch): whether it has a free slot by its learned full batch (False
        while none is learned). With `queue` (an uncontended band: the saturation limit's
        allowance of waiting requests): whether fewer than the batch (learned, or the most
        seen running) plus `queue` are in flight there."""
        entry = self._seen.get(state.key)
        if queue is not None:
            return holding(state) < (0 if entry is None else entry.slots) + queue
        return entry is not None and entry.full and holding(state) < _cap(entry.slots)

    def deferring(self, state: EndpointState) -> bool:
        """Whether `state`'s queue may hold requests deferred for an adapter (`_maybe_deferred`):
        then neither its queue nor the EPP's in-flight total there says how many batch slots
        are free (`holding` does, by the count per target model; `headroom.py`)."""
        return _maybe_deferred(state)

    def slots(self, state: EndpointState) -> int | None:
        """The learned slots of a server that has shown a full batch (None: not yet)."""
        entry = self._seen.get(state.key)
        return entry.slots if entry is not None and entry.full else None

    def free(self, state: EndpointState) -> tuple[float, float]:
        """Free batch slots and free places in the short server queue (`_cap`) of `state`'s
        server (unknown: infinite)."""
        entry = self._seen.get(state.key)
        if entry is None or not entry.full:
            return float("inf"), float("inf")
        inflight = holding(state)
        return max(0, entry.slots - inflight), max(
            0, _cap(entry.slots) - max(inflight, entry.slots)
        )


def _cap(slots: int) -> int:
    """In flight at most: the batch plus a short queue at the server, one request per 8 slots
    and at least one, so a freed slot starts its next request in the engine's next step
    instead of after the EPP's round trip (each request lost a step: 3% of the tokens with
    30-token answers on 2 x 64 slots), and the server keeps showing the queue that keeps its
    full batch believed (module docstring). It was picked in fair order all the same."""
    return slots + max(1, slots // 8)


def _maybe_deferred(state: EndpointState) -> bool:
    """The scraped queue may hold requests deferred for an adapter: some adapter waits there
    that has no GPU slot (vLLM defers such requests for the adapter, not for want of batch
    slots, `datastore/load.py`). vLLM reports which adapters wait, not how many requests each,
    so a queue that has any such adapter says nothing about the batch: learned from it, a
    multi-LoRA server running 94 of 256 looked full, the EPP held its work and placed it on
    servers without the adapter (issue 35's regression: multi-LoRA at 1.1x, seed 2, p90 TTFT
    1.29 s against 0.09 s)."""
    m = state.metrics
    return bool(m.waiting_adapters - m.active_adapters)


def deferred(state: EndpointState) -> int:
    """The EPP's in-flight requests at `state`'s server for adapters that wait there without
    a GPU slot (`waiting_lora_adapters - running_lora_adapters`): every one of them waits for
    an adapter slot, none holds a batch slot (none of that adapter runs). 0 where the router
    does not count per model (`EndpointState.inflight_models` empty)."""
    m = state.metrics
    without = m.waiting_adapters - m.active_adapters
    if not without or not state.inflight_models:
        return 0
    models = state.inflight_models
    return sum(models.get(a, 0) for a in without)


def holding(state: EndpointState) -> int:
    """The EPP's in-flight requests at `state`'s server that hold (or wait for) a batch slot:
    all of them less the adapter-deferred ones (`deferred`)."""
    return state.inflight_requests - deferred(state)


def queued(state: EndpointState) -> int:
    """The scraped queue less the EPP's adapter-deferred requests there (`deferred`): what
    waits for a batch slot, as far as the EPP's own count tells (other senders' deferred
    requests still count)."""
    return max(0, state.metrics.waiting - deferred(state))
