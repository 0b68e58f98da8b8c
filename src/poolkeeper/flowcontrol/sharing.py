"""Who shares a band, and the places kept for a flow whose answer just freed one.

A flow is present in its band while it has requests waiting or running, and for `PRESENT_S`
after its last one ended (`band.py`: a closed loop's clients are on their way back).
`sharing` and `contended` tell the headroom check (`Headroom.room`) whether fair order has
anything to decide. When the answer of the flow fair sharing would serve next frees a place
while that flow has nothing waiting, the place is kept for it for `HOLD_S` (`keep_place`,
`kept`, `take_kept`): a client that sends its next request on an answer gets its share instead
of finding the place taken by a busier flow's waiting request each time.

Functions over the dispatcher's `Band`s, pure and synchronous: time is passed in.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TypeVar

from poolkeeper.api.criticality import Criticality
from poolkeeper.flowcontrol.band import MAX_RECENT, PRESENT_S, Band
from poolkeeper.flowcontrol.flowitem import BANDS, FlowItem

T = TypeVar("T")

# How long a place freed by the answer of an under-served flow with nothing waiting is kept for
# it: a closed-loop client's round trip (the answer through Envoy to the client, its next
# request back), 3-8 ms at the median on an idle machine but 80 ms at the median and up to
# 0.9 s on this project's 2-core VM at load 15-18. The place is one in a server's short queue,
# never an idle batch slot (`Headroom.room`), so a long hold costs the servers nothing.
HOLD_S = 0.5


def keep_place(queue: Band[T], flow: str, left: int, now: float) -> None:
    """After `flow`'s request ended in `queue` (`left` of its requests still running): note
    when its last one ended (`recent`), and keep the freed place for it if it is the flow fair
    sharing would serve next but has nothing waiting."""
    if flow in queue.flows:
        return
    if left <= 0:
        queue.recent[flow] = now
        if len(queue.recent) > MAX_RECENT:  # many small flows: keep only the recent ones
            queue.recent = {f: t for f, t in queue.recent.items() if now - t <= PRESENT_S}
    if not queue.count:
        return
    counter = queue.fairness.counter(flow)
    if all(counter <= queue.fairness.counter(f) for f in queue.flows):
        held, _until = queue.reserved.get(flow, (0, now))
        queue.reserved[flow] = (held + 1, now + HOLD_S)


def sharing(queue: Band[T], now: float | None) -> bool:
    """Two or more flows have requests in the band (waiting, or dispatched and not
    completed), counting with `now` a flow whose last request ended less than `PRESENT_S`
    ago: a closed loop's clients are then on their way back (see `PRESENT_S`)."""
    if len(queue.flows) >= 2:
        return True
    seen = len(queue.flows)
    for flow in queue.running:
        if flow not in queue.flows:
            seen += 1
            if seen >= 2:
                return True
    if now is None or not queue.recent:
        return False
    for flow, ended in list(queue.recent.items()):
        if now - ended > PRESENT_S:
            del queue.recent[flow]
        elif flow not in queue.running and flow not in queue.flows:  # not counted above
            seen += 1
            if seen >= 2:
                return True
    return False


def kept(bands: Mapping[Criticality, Band[T]], item: FlowItem[T], now: float) -> int:
    """Places kept for flows other than `item`'s, in `item`'s band and the bands above:
    `fits` must leave that many free when it answers for `item`."""
    total = 0
    for b in BANDS:
        if b.rank < item.band.rank:
            break
        queue = bands[b]
        for flow, (held, until) in list(queue.reserved.items()):
            if until < now:
                del queue.reserved[flow]
            elif flow != item.flow or b is not item.band:
                total += held
    return total


def take_kept(
    queue: Band[T], item: FlowItem[T], now: float, fits: Callable[[FlowItem[T]], bool]
) -> bool:
    """A newcomer of a flow a place is kept for takes it (if the place is still there)."""
    found = queue.reserved.get(item.flow)
    if found is None:
        return False
    held, until = found
    if until < now:
        del queue.reserved[item.flow]
        return False
    if not fits(item):
        return False
    if held > 1:
        queue.reserved[item.flow] = (held - 1, until)
    else:
        del queue.reserved[item.flow]
    return True


def release_kept(queue: Band[T], flow: str) -> None:
    """A request of `flow` left the queue: one place kept for the flow is used up."""
    found = queue.reserved.pop(flow, None)
    if found is not None and found[0] > 1:
        queue.reserved[flow] = (found[0] - 1, found[1])
