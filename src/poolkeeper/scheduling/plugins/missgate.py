"""The saturation filter's cost-of-a-miss gate (`missGate`): leave a prefix holder only when
waiting there costs more than a miss elsewhere.

The learned full-batch filter (`learnMaxNumSeqs`, filters.py) drops an endpoint whose full batch
has a queue. Where that endpoint holds the request's long shared prefix, the request then
prefills the prefix again somewhere else. On 8-slot engines that is cheap against the holder's
queue (a 2,000-token miss 0.09 s, a place in the queue 1/8 of a 1-s answer, five places 0.65 s),
but on 256-slot engines in overload a place costs 1/256 of an answer and every miss takes
prefill time from a server that has none to spare (virtual time: p90 1.07 -> 2.09 s, goodput
-19 to -26 %; docs/notes/2026-12-06-live-routing-sixth-round.md). So the gate prices both, in
seconds, from what this router measured:

    wait(e)  = (queue at e, + 1 on a full batch) x hold(e) / batch(e)
    miss(e)  = prefill(e) x (1 + queue at e + batch(e) x prefill(e) / hold(e)) + wait(e)
    prefill(e) = prompt tokens e does not hold x prefill seconds per token
    keep a holder h the filter would drop  iff  wait(h) <= min over kept e of miss(e)

A miss's prefill stalls e's batch: the request's own first token waits for it, so does every
request queued at e, and the stall takes batch x prefill / hold requests' worth of service from
e, which in a busy pool as many requests more wait for. On 8 slots held 1 s a 2,000-token miss
(0.1 s) takes 0.8 of a request's service and costs about 0.2 s, less than two places in the
holder's queue (0.13 s each): the request moves. On 256 slots held 5 s the same miss takes five
requests' service and costs 0.6 s or more, the price of 30 places (0.02 s each): the holder
keeps its work unless its queue is very long (virtual time, 1.1x, seed 2: p90 1.04 s, goodput
318.3 req/s against the default's 1.07 s / 318.7; the prefill alone as the price, 0.89 s /
298.3, 350 requests expired in flow control's queue).

- `hold(e)`: the seconds a request holds its batch slot at e (first response byte to end),
  a moving average per endpoint (the pool's mean until e has one). An end carries no time
  (`request_ended`), so ends are stamped at the next decision, halfway since the previous one,
  and dropped when the two decisions are more than `MAX_END_GAP_S` apart.
- `batch(e)`: the filter's `maxNumSeqs`, or the batch it learned (`fullbatch.py`, the most seen
  running). A queue counts at an endpoint with free slots too: in overload a 256-slot engine
  one slot short of full held 35-154 waiting (its per-step prefill budget), and counting that
  as no wait sent holders' requests there (the first version of this gate: seed 2 goodput
  298.3 against the default's 318.7 req/s).
- prefill seconds per token: sent-to-first-byte over the uncached prompt tokens of requests
  that missed at least `MIN_MISS_TOKENS` on an endpoint with a free slot and no queue (so the
  time is their own prefill step), a moving average over the pool. It includes the router's
  and the step's own time, so a miss is priced a little high, which errs towards the holder.

Until both are measured a holder is never dropped (the gate errs towards the prefix). One per
gated filter instance; bounded like `PrefillBacklog` (oldest pending request dropped first).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from poolkeeper.datastore.endpoint import EndpointState
from poolkeeper.datastore.load import effective_kv, effective_waiting
from poolkeeper.scheduling.interfaces import CycleState, ProfileResult, TypedName
from poolkeeper.scheduling.plugins.filters import SaturationFilter, SaturationFilterParams
from poolkeeper.scheduling.plugins.prefix_affinity import PrefixHolders
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

    __slots__ = ("_ended", "_hold", "_last", "_pending", "prefill_s_per_token")

    def __init__(self) -> None:
        self._pending: dict[str, _Sent] = {}
        self._ended: list[tuple[str, float]] = []  # (endpoint, first byte) since the last tick
        self._hold: dict[str, float] = {}  # endpoint -> average slot hold, seconds
        self._last: float | None = None  # the previous decision's time
        self.prefill_s_per_token: float | None = None

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
            old = self.prefill_s_per_token
            self.prefill_s_per_token = sample if old is None else old + ALPHA * (sample - old)

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
                    old = hold.get(endpoint)
                    sample = end - first
                    hold[endpoint] = sample if old is None else old + ALPHA * (sample - old)
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

    def forget_endpoints(self, keep: set[str]) -> None:
        for gone in [k for k in self._hold if k not in keep]:
            del self._hold[gone]


class GatedSaturationFilter(SaturationFilter):
    """`saturation-filter` with `missGate`: a dropped prefix holder whose queue costs less than
    a miss elsewhere stays (module docstring). Also a PostCycle and first-token observer."""

    __slots__ = ("costs", "holders", "kept_holders", "moved_holders")

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
        self.kept_holders = 0  # decisions where the gate kept a holder (diagnostics, tests)
        self.moved_holders = 0  # ... and where it let every dropped holder go

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
        kept: list[EndpointState],
    ) -> Sequence[EndpointState]:
        kept_ids, now = {id(s) for s in kept}, cycle.now
        dropped = [s for s in candidates if id(s) not in kept_ids and self._queued_out(s, now)]
        held = self.holders.of(cycle, request, dropped) if dropped else set()
        if not held:
            return kept
        spt = self.costs.prefill_s_per_token
        uncached = self._uncached(cycle, request)
        alternatives = [self._wait(s) for s in kept]
        if spt is None or any(w is None for w in alternatives):
            rescued = set(held)  # a miss cannot be priced yet: keep the prefix
        else:
            best = min(
                self._miss(s, uncached(s.key) * spt) + (w or 0.0)
                for s, w in zip(kept, alternatives, strict=True)
            )
            rescued = {
                s.key
                for s in dropped
                if s.key in held and ((w := self._wait(s)) is None or w <= best)
            }
        if not rescued:
            self.moved_holders += 1
            return kept
        self.kept_holders += 1
        return [s for s in candidates if id(s) in kept_ids or s.key in rescued]

    def _queued_out(self, state: EndpointState, now: float) -> bool:
        """Dropped for its queue on a full batch (fresh metrics, KV below its limit)."""
        if state.age(now) > self.staleness_s:
            return False
        kv = effective_kv(state, self.params.count_unseen)
        return kv < self.limit * self.params.kv_cache_util_threshold and self._full(state)

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

    def _uncached(self, cycle: CycleState, request: LLMRequest) -> _Uncached:
        prefix = self.holders.prefix
        chars = len(request.prompt)
        per_char = request.prompt_tokens / chars if chars else 0.0
        return _Uncached(request.prompt_tokens, prefix.matched(cycle, request), per_char)

    def post_cycle(self, cycle: CycleState, request: LLMRequest, result: ProfileResult) -> None:
        # Runs before the prefix scorer's (listed first), so the match is the decision's.
        if not result.targets:
            return
        picked = result.targets[0]
        clear = not self._full(picked) and effective_waiting(picked, self.params.count_unseen) <= 0
        uncached = self._uncached(cycle, request)(picked.key)
        self.costs.sent(request.request_id, picked.key, cycle.now, uncached, clear)

    def observe_first_token(self, request_id: str, endpoint: str | None, now: float) -> None:
        self.costs.first_token(request_id, now)

    def request_ended(self, request_id: str) -> None:
        self.costs.ended(request_id)

    def forget_endpoints(self, keep: set[str]) -> None:
        self.costs.forget_endpoints(keep)


@dataclass(frozen=True, slots=True)
class _Uncached:
    """Prompt tokens an endpoint does not hold, from one decision's prefix match."""

    tokens: int
    matched: dict[str, int]  # ip:port -> prompt characters it probably caches
    per_char: float

    def __call__(self, key: str) -> int:
        return max(0, self.tokens - int(self.matched.get(key, 0) * self.per_char))
