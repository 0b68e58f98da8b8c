"""The saturation filter's cost gate (`missGate`): a prefix holder dropped for the queue on
its full batch goes only where a request costs more there than at every endpoint kept; other
endpoints dropped for their queue stay (the load scorers weigh them).

The full-batch filter (`learnMaxNumSeqs`, saturation_filter.py) drops an endpoint whose full batch
has a queue. It is there for the prefix scorer's pull: on 8-slot engines a holder's queue
costs more than a miss (a 2,000-token miss 0.09 s, a place in the queue 1/8 of a 1-s answer,
five places 0.65 s). But dropping a holder on 256-slot engines in overload re-prefills the
prefix where no capacity is spare (virtual time: p90 1.07 -> 2.09 s, goodput -19 to -26 %;
docs/notes/2026-12-06-live-routing-sixth-round.md), and on fleets whose 256-slot batches all
run nearly full the knife edge of "confirmed full" dropped endpoints with shorter queues than
kept ones (docs/notes/2026-12-06-live-routing-seventh-round.md). So the gate prices the
request at every endpoint, in seconds, from what this router measured, and a holder goes only
where its price is above the dearest kept one's: the scorers may pick any kept endpoint, and
the filter never forces a pick it rates worse than one it removed (dropping what is dearer
than the cheapest, heterogeneous 1.1x seed 1: p90 0.120 s against 0.111 s; dropping
non-holders too, heavy-tail 1.1x seed 1: 0.239 s against 0.209 s):

    cost(e)  = wait(e) + miss(e)
    wait(e)  = (queue at e, + 1 on a full batch) x hold(e) / batch(e)
    miss(e)  = prefill(e) x (1 + queue at e + batch(e) x prefill(e) / hold(e))
    prefill(e) = prompt tokens e does not hold x prefill seconds per token at e

A miss's prefill stalls e's batch: the request's own first token waits for it, so does every
request queued at e, and the stall takes batch x prefill / hold requests' worth of service from
e, which in a busy pool as many requests more wait for. On 8 slots held 1 s a 2,000-token miss
(0.1 s) costs about 0.2 s, less than two places in a holder's queue (0.13 s each): the request
moves. On 256 slots held 5 s the same miss costs 0.6 s or more, the price of 30 places.

- `hold(e)`: the seconds a request holds its batch slot at e (first response byte to end),
  a moving average per endpoint (the pool's mean until e has one). An end carries no time
  (`request_ended`), so ends are stamped at the next decision, halfway since the previous one,
  and dropped when the two decisions are more than `MAX_END_GAP_S` apart.
- `batch(e)`: the filter's `maxNumSeqs`, or the batch it learned (`fullbatch.py`, the most seen
  running). A queue counts at an endpoint with free slots too: in overload a 256-slot engine
  one slot short of full held 35-154 waiting (its per-step prefill budget).
- prefill seconds per token at e: sent-to-first-byte over the uncached prompt tokens of
  requests that missed at least `MIN_MISS_TOKENS` on e with a free slot and no queue (so the
  time is their own prefill step), a moving average per endpoint (a mixed fleet's fast servers
  prefill faster), the pool's until e has a sample. It includes the router's and the step's
  own time, so a miss is priced a little high, which errs towards staying.

Until the costs are measured every holder stays. One per gated filter instance; bounded like
`PrefillBacklog` (oldest pending request dropped first). The gate learns first response bytes,
and with them the datastore counts unseen requests that answered as running: a profile that
should otherwise choose as one without the gate sets the queue scorer's `answeredRun: false`
(that alone moved heterogeneous 1.1x seed 1 from 0.111 to 0.134 s; presets.py).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from poolkeeper.datastore.endpoint import EndpointState
from poolkeeper.datastore.load import effective_waiting
from poolkeeper.scheduling.interfaces import CycleState, ProfileResult, TypedName
from poolkeeper.scheduling.plugins.prefix_affinity import PrefixHolders
from poolkeeper.scheduling.plugins.saturation_filter import SaturationFilter, SaturationFilterParams
from poolkeeper.scheduling.types import LLMRequest

MIN_MISS_TOKENS = 512  # a miss this long is a prefill-speed sample (its step is mostly prefill)
MAX_END_GAP_S = 0.25  # ends stamped between decisions further apart than this are not samples
ALPHA = 0.1  # weight of a new sample in the moving averages
MAX_PENDING = 65_536  # requests remembered at most (oldest dropped first)


@dataclass(slots=True)
class _Sent:
    endpoint: str
    at: float
    uncached: int  # prompt tokens the endpoint did not hold at the decision
    clear: bool  # the endpoint had a free batch slot and nothing waiting
    first: float | None = None  # first response byte


class MissCosts:
    """The gate's measurements (see the module docstring). Pure: times come from the caller."""

    __slots__ = ("_ended", "_hold", "_last", "_pending", "_prefill", "pool_prefill_s")

    def __init__(self) -> None:
        self._pending: dict[str, _Sent] = {}
        self._ended: list[tuple[str, float]] = []  # (endpoint, first byte) since the last tick
        self._hold: dict[str, float] = {}  # endpoint -> average slot hold, seconds
        self._last: float | None = None  # the previous decision's time
        self._prefill: dict[str, float] = {}  # endpoint -> prefill seconds per token
        self.pool_prefill_s: float | None = None  # ... over the pool (any endpoint's sample)

    def sent(self, request_id: str, endpoint: str, now: float, uncached: int, clear: bool) -> None:
        pending = self._pending
        pending.pop(request_id, None)
        if len(pending) >= MAX_PENDING:
            del pending[next(iter(pending))]
        pending[request_id] = _Sent(endpoint, now, uncached, clear)

    def first_token(self, request_id: str, now: float) -> None:
        entry = self._pending.get(request_id)
        if entry is None or entry.first is not None:
            return
        entry.first = now
        if entry.clear and entry.uncached >= MIN_MISS_TOKENS and now > entry.at:
            sample = (now - entry.at) / entry.uncached
            self.pool_prefill_s = _average(self.pool_prefill_s, sample)
            self._prefill[entry.endpoint] = _average(self._prefill.get(entry.endpoint), sample)

    def ended(self, request_id: str) -> None:
        entry = self._pending.pop(request_id, None)
        if entry is not None and entry.first is not None:
            self._ended.append((entry.endpoint, entry.first))

    def tick(self, now: float) -> None:
        """A decision at `now`: the ends reported since the previous one become samples."""
        last, ended = self._last, self._ended
        if ended and last is not None and 0.0 <= now - last <= MAX_END_GAP_S:
            end, hold = 0.5 * (last + now), self._hold
            for endpoint, first in ended:
                if end > first:
                    hold[endpoint] = _average(hold.get(endpoint), end - first)
        ended.clear()
        if last is None or now > last:
            self._last = now

    def hold_s(self, endpoint: str) -> float | None:
        """Average seconds a request holds a slot at `endpoint` (the pool's mean until it has
        its own; None before any)."""
        hold = self._hold
        own = hold.get(endpoint)
        if own is not None or not hold:
            return own
        return sum(hold.values()) / len(hold)

    def prefill_s(self, endpoint: str) -> float | None:
        """Prefill seconds per uncached prompt token at `endpoint` (the pool's until it has
        its own sample: a mixed fleet's fast servers prefill faster; None before any)."""
        own = self._prefill.get(endpoint)
        return self.pool_prefill_s if own is None else own

    def forget_endpoints(self, keep: set[str]) -> None:
        for table in (self._hold, self._prefill):
            for gone in [k for k in table if k not in keep]:
                del table[gone]


def _average(old: float | None, sample: float) -> float:
    """The moving average after `sample` (the sample itself for the first)."""
    return sample if old is None else old + ALPHA * (sample - old)


class GatedSaturationFilter(SaturationFilter):
    """`saturation-filter` with `missGate`: of the endpoints dropped for their queue only the
    prefix holders dearer than every kept endpoint go (module docstring). Also a PostCycle and
    first-token observer."""

    __slots__ = ("costs", "holders", "moved", "rescued")

    def __init__(
        self,
        typed_name: TypedName,
        params: SaturationFilterParams,
        staleness_s: float,
        holders: PrefixHolders,
    ) -> None:
        super().__init__(typed_name, params, staleness_s)
        self.holders = holders
        self.costs = MissCosts()
        self.rescued = 0  # decisions where every queued endpoint stayed (diagnostics, tests)
        self.moved = 0  # ... and where a holder went

    def filter(
        self, cycle: CycleState, request: LLMRequest, candidates: Sequence[EndpointState]
    ) -> Sequence[EndpointState]:
        self.costs.tick(cycle.now)
        return super().filter(cycle, request, candidates)

    def _kept(
        self,
        cycle: CycleState,
        request: LLMRequest,
        candidates: Sequence[EndpointState],
        kept: Sequence[EndpointState],
        queued: list[EndpointState],
    ) -> Sequence[EndpointState]:
        if not queued:
            return kept
        held = self.holders.of(cycle, request, queued)
        gone: set[int] = set()  # id() of the holders that go
        cost = self._cost_of(cycle, request)
        alternatives = [cost(s) for s in kept] if held else []
        if held and all(c is not None for c in alternatives):
            # The scorers may pick any kept endpoint, so a holder goes only where it costs
            # more than every kept one: the filter never forces a pick it rates dearer.
            dearest = max(c for c in alternatives if c is not None)
            gone = {id(s) for s in queued if s.key in held and (cost(s) or 0.0) > dearest}
        if gone:
            self.moved += 1
        else:
            self.rescued += 1
        passing = {id(s) for s in kept} | {id(s) for s in queued if id(s) not in gone}
        return [s for s in candidates if id(s) in passing]

    def _cost_of(
        self, cycle: CycleState, request: LLMRequest
    ) -> Callable[[EndpointState], float | None]:
        """The request's expected first-token cost at an endpoint, in seconds: its wait for a
        slot plus its miss there (None before both are measured)."""
        cached = self.holders.prefix.cached_tokens(cycle, request)
        tokens, costs = request.prompt_tokens, self.costs

        def cost(state: EndpointState) -> float | None:
            wait, spt = self._wait(state), costs.prefill_s(state.key)
            if wait is None or spt is None:
                return None
            return wait + self._miss(state, (tokens - cached.get(state.key, 0)) * spt)

        return cost

    def _slots(self, state: EndpointState) -> int | None:
        """`maxNumSeqs`, else the batch learned at `state` (confirmed full or not)."""
        slots = self.params.max_num_seqs
        if slots is None and self.batches is not None:
            slots = self.batches.most(state.key)
        return slots

    def _wait(self, state: EndpointState) -> float | None:
        """Expected seconds until a request sent now gets a slot at `state` (0 with a free
        slot and nothing waiting; None where the hold time or batch is not known yet). Every
        request waiting counts a place, full batch or not: a 256-slot engine one slot short
        of full can hold a queue of a hundred behind its per-step prefill budget."""
        places = effective_waiting(state, self.params.count_unseen) + (
            1 if self._full(state) else 0
        )
        if places <= 0:
            return 0.0
        slots, hold = self._slots(state), self.costs.hold_s(state.key)
        if slots is None or hold is None:
            return None
        return places * hold / slots

    def _miss(self, state: EndpointState, prefill_s: float) -> float:
        """What a miss at `state` costs, in seconds of first-token wait: its prefill stalls
        `state`'s batch for `prefill_s`, which the request itself, every request queued there
        and, in a busy pool, the requests whose service the stall takes (slots x prefill_s /
        hold of them) all wait."""
        queued = max(0, effective_waiting(state, self.params.count_unseen))
        slots, hold = self._slots(state), self.costs.hold_s(state.key)
        taken = slots * prefill_s / hold if slots is not None and hold else 0.0
        return prefill_s * (1.0 + queued + taken)

    def post_cycle(self, cycle: CycleState, request: LLMRequest, result: ProfileResult) -> None:
        # Runs before the prefix scorer's (listed first), so the match is the decision's.
        if not result.targets:
            return
        picked = result.targets[0]
        clear = not self._full(picked) and effective_waiting(picked, self.params.count_unseen) <= 0
        cached = self.holders.prefix.cached_tokens(cycle, request).get(picked.key, 0)
        uncached = request.prompt_tokens - cached
        self.costs.sent(request.key, picked.key, cycle.now, uncached, clear)

    def observe_first_token(self, request_id: str, endpoint: str | None, now: float) -> None:
        self.costs.first_token(request_id, now)

    def request_ended(self, request_id: str) -> None:
        self.costs.ended(request_id)

    def forget_endpoints(self, keep: set[str]) -> None:
        self.costs.forget_endpoints(keep)
