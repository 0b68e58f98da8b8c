"""`ReturnTimes`: how long a flow's clients take to send their next request after an answer.

A slot freed by the answer of an under-served flow with nothing waiting is kept for that flow
a moment (`HOLD_S`): a closed-loop client sends its next request on its answer, and
without the hold the busier flow's waiting head takes every freed slot. How long that moment
must be is the clients' round trip (the answer's last bytes through Envoy to the client, its
next request back through Envoy to the EPP), which is not a constant: on this project's
loaded 2-core VM it was 3-8 ms at the median but 50 ms at the 90th percentile and up to
175 ms (issue 35's case live, load average 8-11). With a fixed 50 ms, one return in ten came
too late: the slot went to the busier flow, the light flow's request then waited for the
next batch to end (0.5-0.8 s at 2 slots a server) and its share fell to 0.91 (0.86 in
earlier runs at load 5-15) against 1.02 when the returns were fast.

So the hold follows the flow's measured returns: the delay from each of its answers (given
while it had nothing waiting) to its next arrival, the last `SAMPLES` of them. A flow whose
returns are those of a closed loop (the median within `HOLD_S`) keeps the slot until it
returns, at most `HOLD_MAX_S`; any other flow gets `HOLD_S` as before. The slot is idle only
until the flow's next arrival, so a closed loop's hold costs its round trip (milliseconds at
the median) and `HOLD_MAX_S` only when its client has stopped. A hold that follows the
slowest recent return instead (1.5 times it) still missed: the round trip is bursty (0.17 s
after a run of returns under 0.1 s). In virtual time a closed loop returns at once.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Set

HOLD_S = 0.05  # the shortest hold (and the hold of a flow not seen returning like a closed loop)
HOLD_MAX_S = 0.5  # the hold of a closed loop; a return slower than this is a miss
SAMPLES = 8  # returns remembered per flow
_MAX_FLOWS = 1024  # flows remembered at most (pruned to the flows given in `prune`)


class ReturnTimes:
    """Per flow: the answers awaiting a return and the recent return delays."""

    __slots__ = ("_answers", "_delays")

    def __init__(self) -> None:
        self._answers: dict[str, deque[float]] = {}  # answers not yet matched by an arrival
        self._delays: dict[str, deque[float]] = {}

    def answered(self, flow: str, now: float) -> None:
        """`flow` got an answer while it had nothing waiting: its next arrival is a return."""
        answers = self._answers.get(flow)
        if answers is None:
            answers = self._answers[flow] = deque(maxlen=SAMPLES)
        answers.append(now)

    def arrived(self, flow: str, now: float) -> None:
        """An arrival of `flow`: the return of its oldest unmatched answer, if any (answers
        older than `HOLD_MAX_S` are misses)."""
        answers = self._answers.get(flow)
        if not answers:
            return
        delays = self._delays.get(flow)
        if delays is None:
            delays = self._delays[flow] = deque(maxlen=SAMPLES)
        while answers and now - answers[0] > HOLD_MAX_S:
            answers.popleft()
            delays.append(HOLD_MAX_S)
        if answers:
            delays.append(now - answers.popleft())
        if not answers:
            del self._answers[flow]

    def hold(self, flow: str) -> float:
        """How long a slot freed for `flow` is kept (see the module docstring)."""
        delays = self._delays.get(flow)
        if delays is None or len(delays) < SAMPLES // 2:
            return HOLD_S
        return HOLD_MAX_S if sorted(delays)[len(delays) // 2] <= HOLD_S else HOLD_S

    def prune(self, live: Callable[[], Set[str]]) -> None:
        """Forget the flows not in `live()` once more than `_MAX_FLOWS` are remembered."""
        for table in (self._answers, self._delays):
            if len(table) > _MAX_FLOWS:
                keep = live()
                for flow in [f for f in table if f not in keep]:
                    del table[flow]
