"""Virtual-time fleet: many engine models driven by a discrete-event clock, no sockets.

Hundreds of servers and hours of traffic run in seconds, deterministically for a given seed
(engines draw from their own seeded RNGs; the event order is total). The benchmarks put the
project's real scheduler in the `route` callback.

API (times in virtual seconds; the run starts wherever the first arrival's time is):

    fleet = VirtualFleet([EngineConfig(...), ...], seed=1, scrape_interval=0.05,
                         fuse_decode_steps=64)
    result = fleet.run(arrivals, route, on_finish=None, record_token_times=False)

- `fuse_decode_steps`: up to this many consecutive pure-decode steps of an engine with an empty
  queue are one heap event (split again if a request arrives or is cancelled meanwhile); results
  are the same as step by step (tested), only faster. 1 = step by step. While fused steps run,
  a scrape's kv_cache_usage already counts the blocks those steps will fill (<= 4 blocks per
  request at 64 steps of 16-token blocks).

- `servers`: EngineConfig or ServerSpec per server (ServerSpec gives the name). Server i is
  `fleet.endpoints[i]`, an `Endpoint(name, address="10.0.<i//250>.<i%250+1>", port=8000)`.
- `arrivals`: iterable of `Arrival(time, request_id, model, prompt="", max_tokens=None,
  prompt_tokens=None, payload=None)`, in non-decreasing time. `model` is the target model (base
  model or adapter). `prompt_tokens` overrides the poolkeeper.tokens count of `prompt` (the prompt
  still names the prefix-cache blocks). `payload` is passed through untouched (e.g. the
  LLMRequest the bench built), available as `RequestResult.payload`.
- `route(arrival, states, now) -> int | None`: pick a server index, or None to reject. `states`
  is a list of `datastore.endpoint.EndpointState`, one per server, as a scraper would show them:
  `metrics` is the engine's state at the last scrape tick (every `scrape_interval` seconds,
  `updated_at` = the tick time; 0 = scrape at every decision), while `inflight_requests` /
  `inflight_tokens` (prompt tokens) count routed-but-unfinished requests right now and
  `unseen_requests` / `unseen_tokens` those routed since the last scrape; with
  `answers_seen` (a router that learns each first byte as it happens), `unseen_answered`
  counts the unseen requests whose first token is out. Treat the list as read-only and valid
  only during the call.
- `on_finish(result)`: optional, called when a request completes (e.g. router bookkeeping).
- `follow(result, now) -> Iterable[Arrival]`: optional, called when a request completes or is
  rejected (at once or after being held); the arrivals it returns (at `now` or later) join
  the run: a closed population of clients, each sending its next request after an answer.
- `on_first_token(result)`: optional, called when a request's first token is out (`first_token`
  set): what a router sees as the first response byte, for latency-learning policies.
- `release(states, now, send)`: needed when `route` may return `HOLD` (the router keeps the
  arrival, e.g. in a flow-control queue). The fleet calls it only while something is held:
  after every engine event that finished requests (with `release_on_first_token`, also after
  one that gave a request its first token: the EPP's pump wakes on each first byte while
  `holdNewPrefixes` is on) and at every scrape tick. The router calls
  `send(request_id, server)` to submit a held request now (states update before it returns)
  or `send(request_id, None, reason)` to reject it. Held requests' TTFT counts from arrival.
- Returns `FleetResult(requests=[RequestResult...] in arrival order, servers=[ServerResult...],
  end_time)` (their fields: `sim/virtual_results.py`).
`FleetResult.summary()` gives a dict of common aggregates (counts, TTFT/e2e percentiles, ITL).

The arrivals and results live in `sim/virtual_results.py`, what the router sees (the scraped
states and in-flight counts) in `sim/virtual_views.py`, a request's submission and token
delivery in `sim/virtual_requests.py`; this module runs the clock.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import replace
from typing import Final

from poolkeeper.datastore.endpoint import Endpoint, EndpointState
from poolkeeper.sim.config import ServerSpec
from poolkeeper.sim.engine import EngineModel
from poolkeeper.sim.params import EngineConfig
from poolkeeper.sim.virtual_requests import deliver, submit
from poolkeeper.sim.virtual_results import Arrival, FleetResult, RequestResult, ServerResult
from poolkeeper.sim.virtual_views import ScrapedViews

Router = Callable[[Arrival, Sequence[EndpointState], float], int | None]

# `route` may return HOLD: the router keeps the arrival until `release` (module docstring).
HOLD: Final = -1
Send = Callable[[str, int | None, str | None], None]
Releaser = Callable[[Sequence[EndpointState], float, Send], None]
_HELD = "held"
_POLL = -1  # heap entry of a router poll (servers are >= 0)
_STUCK_S = 3600.0  # a router that releases nothing for this long has a bug: stop the run


class VirtualFleet:
    """A fleet of engine models on one virtual clock. One `run` per fleet object."""

    def __init__(
        self,
        servers: Sequence[EngineConfig | ServerSpec],
        *,
        seed: int | None = None,
        scrape_interval: float = 0.05,
        fuse_decode_steps: int = 64,
        timestamp_refresh: float = 0.25,
        answers_seen: bool = False,
    ) -> None:
        if not servers:
            raise ValueError("a fleet needs at least one server")
        if scrape_interval < 0:
            raise ValueError("scrape_interval must be >= 0")
        self.engines: list[EngineModel] = []
        self.endpoints: list[Endpoint] = []
        for i, server in enumerate(servers):
            name, config = (
                (server.name, server.engine)
                if isinstance(server, ServerSpec)
                else (f"sim-{i}", server)
            )
            if seed is not None:
                config = replace(config, seed=seed)  # engine RNGs also hash the server name
            self.engines.append(EngineModel(config, name=name, max_fused_steps=fuse_decode_steps))
            self.endpoints.append(
                Endpoint(name=name, address=f"10.0.{i // 250}.{i % 250 + 1}", port=8000)
            )
        # `answers_seen`: the router learns first tokens as they happen (the EPP with Envoy's
        # first-byte report): its unseen requests that answered no longer count as queued.
        self._scraped = ScrapedViews(
            self.engines,
            self.endpoints,
            scrape_interval=scrape_interval,
            timestamp_refresh=timestamp_refresh,
            answers_seen=answers_seen,
        )
        self._routed = [0] * len(self.engines)
        self._ran = False

    # Read-only views of the one home of the scrape settings, `ScrapedViews`.
    @property
    def scrape_interval(self) -> float:
        return self._scraped.scrape_interval

    @property
    def timestamp_refresh(self) -> float:
        return self._scraped.timestamp_refresh

    @property
    def answers_seen(self) -> bool:
        return self._scraped.answers_seen

    # -- the run --------------------------------------------------------------------------

    def run(
        self,
        arrivals: Iterable[Arrival],
        route: Router,
        *,
        on_finish: Callable[[RequestResult], None] | None = None,
        on_first_token: Callable[[RequestResult], None] | None = None,
        record_token_times: bool = False,
        release: Releaser | None = None,
        follow: Callable[[RequestResult, float], Iterable[Arrival]] | None = None,
        release_on_first_token: bool = False,
    ) -> FleetResult:
        if self._ran:
            raise RuntimeError("a VirtualFleet runs once; build a new one")
        self._ran = True
        engines = self.engines
        heap: list[tuple[float, int, int]] = []
        due: list[float | None] = [None] * len(engines)
        seq = 0
        results: list[RequestResult] = []
        it = iter(arrivals)
        pending = next(it, None)
        last_arrival = -math.inf
        now = 0.0
        # Arrivals the router holds (route returned HOLD), by request id, in arrival order.
        held: dict[str, tuple[Arrival, RequestResult]] = {}
        poll_due = math.inf  # time of the pending poll event (only while something is held)
        poll_every = self.scrape_interval if self.scrape_interval > 0 else 0.05
        last_send = -math.inf
        # Arrivals `follow` added (closed-loop clients), merged with `arrivals` by time.
        extra: list[tuple[float, int, Arrival]] = []

        def followed(result: RequestResult) -> None:
            nonlocal seq
            if follow is None:
                return
            for a in follow(result, now):
                if a.time < now:
                    raise ValueError(f"follow returned {a.request_id} at {a.time} < now {now}")
                seq += 1
                heapq.heappush(extra, (a.time, seq, a))

        def finish_then_follow(result: RequestResult) -> None:
            if on_finish is not None:
                on_finish(result)
            followed(result)

        done_cb = finish_then_follow if follow is not None else on_finish

        def reschedule(i: int) -> None:
            nonlocal seq
            t = engines[i].next_event_time()
            if t is not None and t != due[i]:
                due[i] = t
                seq += 1
                heapq.heappush(heap, (t, seq, i))

        def send(request_id: str, server: int | None, error: str | None = None) -> None:
            nonlocal last_send
            last_send = now
            arrival, result = held.pop(request_id)
            if server is None:
                result.status, result.error = "rejected", error
                followed(result)
                return
            self._submit(arrival, result, server, now, record_token_times)
            if result.server >= 0:
                reschedule(result.server)
            else:
                followed(result)

        def arm() -> None:
            # Poll the router at the next scrape tick while it holds something: fresh metrics
            # and TTL expiry come with time, not only with completions.
            nonlocal seq, poll_due
            if held and poll_due == math.inf:
                if now - last_send > _STUCK_S:
                    raise RuntimeError(f"router held {len(held)} requests for {_STUCK_S} s")
                tick = math.floor(now / poll_every) + 1
                while tick * poll_every <= now:  # float rounding must never poll at `now` again
                    tick += 1
                poll_due = tick * poll_every
                seq += 1
                heapq.heappush(heap, (poll_due, seq, _POLL))

        def poll() -> None:
            if release is not None and held:
                release(self._scraped.views(now), now, send)
            arm()

        while pending is not None or heap or extra:
            first = pending
            if extra and (first is None or extra[0][0] < first.time):
                first = extra[0][2]
            if first is not None and (not heap or first.time < heap[0][0]):
                if first is pending:
                    arrival = pending
                    pending = next(it, None)
                else:
                    arrival = heapq.heappop(extra)[2]
                if arrival.time < last_arrival:
                    raise ValueError(
                        f"arrivals must be in time order: {arrival.request_id} at "
                        f"{arrival.time} after {last_arrival}"
                    )
                now = last_arrival = arrival.time
                result = self._arrive(arrival, route, now, record_token_times)
                results.append(result)
                if result.status == _HELD:
                    if release is None:
                        raise ValueError("route held an arrival but run() got no release")
                    held[arrival.request_id] = (arrival, result)
                    last_send = max(last_send, now)
                    arm()
                elif result.server >= 0:
                    reschedule(result.server)
                else:
                    followed(result)
                continue
            t, _, i = heapq.heappop(heap)
            now = t
            if i == _POLL:
                if t == poll_due:
                    poll_due = math.inf
                    poll()
                continue
            if due[i] != t:
                continue  # superseded entry
            due[i] = None
            self._scraped.before_change(i, t)
            finished = False
            for outcome in engines[i].advance(t):
                finished = finished or bool(outcome.finished)
                firsts = deliver(self._scraped, i, outcome, done_cb, on_first_token)
                finished = finished or (release_on_first_token and firsts)
            reschedule(i)
            if finished and held:
                poll()
        servers = [ServerResult(e.name, self._routed[i], e.counters) for i, e in enumerate(engines)]
        return FleetResult(results, servers, now)

    def _arrive(self, arrival: Arrival, route: Router, now: float, record: bool) -> RequestResult:
        result = RequestResult(arrival.request_id, arrival.model, arrival.time)
        result.payload = arrival.payload
        choice = route(arrival, self._scraped.views(now), now)
        if choice is None:
            result.status = "rejected"
            return result
        if choice == HOLD:
            result.status = _HELD
            return result
        self._submit(arrival, result, choice, now, record)
        return result

    def _submit(
        self, arrival: Arrival, result: RequestResult, choice: int, now: float, record: bool
    ) -> None:
        if submit(self.engines, self._scraped, arrival, result, choice, now, record):
            self._routed[choice] += 1
