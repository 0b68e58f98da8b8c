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
  end_time)`. RequestResult fields: request_id, model, arrival, server (-1 if not served),
  server_name, status ("ok" | "rejected" | "error"), error, prompt_tokens, cached_tokens,
  completion_tokens, first_token, finish, finish_reason, preemptions, adapter_loaded, itl_max,
  token_times (if recorded), payload; properties ttft, e2e, itl_mean. ServerResult: name,
  routed, counters (sim.stats.EngineCounters: prefix_queries/hits, preemptions, lora_loads,
  generation_tokens, busy_time, steps, histograms...).
`FleetResult.summary()` gives a dict of common aggregates (counts, TTFT/e2e percentiles, ITL).
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field, replace
from types import MappingProxyType
from typing import Final

from poolkeeper.datastore.endpoint import Endpoint, EndpointMetrics, EndpointState
from poolkeeper.sim.config import ServerSpec
from poolkeeper.sim.engine import (
    EngineModel,
    InvalidRequestError,
    StepOutcome,
    UnknownModelError,
)
from poolkeeper.sim.params import EngineConfig
from poolkeeper.sim.stats import EngineCounters


@dataclass(frozen=True, slots=True)
class Arrival:
    """One request entering the fleet at virtual time `time`."""

    time: float
    request_id: str
    model: str
    prompt: str = ""
    max_tokens: int | None = None
    prompt_tokens: int | None = None
    payload: object = field(default=None, compare=False)


@dataclass(slots=True)
class RequestResult:
    request_id: str
    model: str
    arrival: float
    server: int = -1
    server_name: str = ""
    status: str = "ok"  # ok | rejected | error
    error: str | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    first_token: float | None = None
    finish: float | None = None
    finish_reason: str | None = None
    preemptions: int = 0
    adapter_loaded: bool = False
    itl_max: float = 0.0
    token_times: list[float] | None = None
    payload: object = None

    @property
    def ttft(self) -> float | None:
        return None if self.first_token is None else self.first_token - self.arrival

    @property
    def e2e(self) -> float | None:
        return None if self.finish is None else self.finish - self.arrival

    @property
    def itl_mean(self) -> float | None:
        """Mean inter-token latency (time per output token after the first)."""
        if self.finish is None or self.first_token is None or self.completion_tokens < 2:
            return None
        return (self.finish - self.first_token) / (self.completion_tokens - 1)


@dataclass(slots=True)
class ServerResult:
    name: str
    routed: int
    counters: EngineCounters


def _percentile(values: list[float], q: float) -> float:
    if not values:
        return math.nan
    ordered = sorted(values)
    rank = q / 100 * (len(ordered) - 1)
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


@dataclass(slots=True)
class FleetResult:
    requests: list[RequestResult]
    servers: list[ServerResult]
    end_time: float

    def summary(self) -> dict[str, float]:
        done = [r for r in self.requests if r.finish is not None]
        ttft = [r.ttft for r in done if r.ttft is not None]
        e2e = [r.e2e for r in done if r.e2e is not None]
        itl = [r.itl_mean for r in done if r.itl_mean is not None]
        start = min((r.arrival for r in self.requests), default=0.0)
        span = max(self.end_time - start, 1e-9)
        out: dict[str, float] = {
            "requests": float(len(self.requests)),
            "completed": float(len(done)),
            "rejected": float(sum(r.status == "rejected" for r in self.requests)),
            "errors": float(sum(r.status == "error" for r in self.requests)),
            "output_tokens_per_s": sum(r.completion_tokens for r in done) / span,
            "prefix_hit_rate": sum(r.cached_tokens for r in done)
            / max(1, sum(r.prompt_tokens for r in done)),
            "preemptions": float(sum(r.preemptions for r in done)),
            "adapter_loads": float(sum(r.adapter_loaded for r in done)),
            "itl_mean": sum(itl) / len(itl) if itl else math.nan,
        }
        for name, values in (("ttft", ttft), ("e2e", e2e)):
            out[f"{name}_mean"] = sum(values) / len(values) if values else math.nan
            for q in (50, 90, 99):
                out[f"{name}_p{q}"] = _percentile(values, q)
        return out


Router = Callable[[Arrival, Sequence[EndpointState], float], int | None]

# `route` may return HOLD: the router keeps the arrival (flow control) and later hands it to
# the `send` callback that `release` receives: `send(request_id, server)` submits it now (the
# states passed to `release` are updated in place before `send` returns, so the router's next
# capacity check sees it), `send(request_id, None, error)` rejects it.
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
        self.scrape_interval = scrape_interval
        self.timestamp_refresh = timestamp_refresh
        # The router learns first tokens as they happen (the EPP with Envoy's first-byte
        # report): its unseen requests that answered no longer count as queued.
        self.answers_seen = answers_seen
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
        n = len(self.engines)
        self._metrics = [EndpointMetrics() for _ in range(n)]
        self._states = [
            EndpointState(endpoint=e, metrics=m)
            for e, m in zip(self.endpoints, self._metrics, strict=True)
        ]
        self._snap_tick = [-1] * n
        self._dirty = [True] * n
        self._inflight = [0] * n
        self._inflight_tokens = [0] * n
        self._inflight_models: list[dict[str, int]] = [{} for _ in range(n)]
        self._unseen = [0] * n
        self._unseen_tokens = [0] * n
        self._answered = [0] * n  # of the unseen, those whose first token is out
        self._scrapes = [0] * n  # scrapes per server: which scrape a request was unseen by
        self._unseen_by: dict[str, int] = {}  # request id -> its server's scrape count at routing
        self._routed = [0] * n
        self._refreshed_tick = -1
        self._ran = False

    # -- scraping -------------------------------------------------------------------------

    def _tick(self, now: float) -> int:
        return int(now / self.scrape_interval) if self.scrape_interval > 0 else -1

    def _scrape(self, i: int, at: float) -> None:
        if self._dirty[i]:
            s = self.engines[i].stats()
            self._metrics[i] = EndpointMetrics(
                waiting=s.waiting,
                running=s.running,
                kv_cache_usage=s.kv_cache_usage,
                active_adapters=frozenset(s.running_adapters),
                waiting_adapters=frozenset(s.waiting_adapters),
                max_adapters=s.max_loras,
                block_size=s.block_size,
                num_gpu_blocks=s.num_gpu_blocks,
                updated_at=at,
                # What a scraper reads from the `model_name` label of the simulator's page.
                served_model=self.engines[i].config.model,
            )
            self._dirty[i] = False
        else:  # unchanged since the last scrape: only the time moves (positional: cheap)
            m = self._metrics[i]
            self._metrics[i] = EndpointMetrics(
                m.waiting, m.running, m.kv_cache_usage, m.active_adapters, m.waiting_adapters,
                m.max_adapters, m.block_size, m.num_gpu_blocks, at,
                served_model=m.served_model,
            )  # fmt: skip
        self._unseen[i] = 0
        self._unseen_tokens[i] = 0
        self._answered[i] = 0
        self._scrapes[i] += 1
        self._rebuild(i)

    def _rebuild(self, i: int) -> None:
        self._states[i] = EndpointState(
            endpoint=self.endpoints[i],
            metrics=self._metrics[i],
            inflight_requests=self._inflight[i],
            inflight_tokens=self._inflight_tokens[i],
            unseen_requests=self._unseen[i],
            unseen_tokens=self._unseen_tokens[i],
            unseen_answered=self._answered[i],
            inflight_models=MappingProxyType(dict(self._inflight_models[i])),
        )

    def _before_change(self, i: int, now: float) -> None:
        """Snapshot a server as of the latest tick before its state changes at `now`."""
        if self.scrape_interval > 0:
            tick = self._tick(now)
            if self._snap_tick[i] < tick:
                self._scrape(i, tick * self.scrape_interval)
                self._snap_tick[i] = tick
        self._dirty[i] = True

    def _views(self, now: float) -> list[EndpointState]:
        if self.scrape_interval <= 0:
            for i in range(len(self.engines)):
                self._dirty[i] = True
                self._scrape(i, now)
            return self._states
        tick = self._tick(now)
        if tick > self._refreshed_tick:
            at = tick * self.scrape_interval
            refresh, metrics, dirty = self.timestamp_refresh, self._metrics, self._dirty
            for i in range(len(self.engines)):
                if self._snap_tick[i] < tick:
                    if not dirty[i] and at - metrics[i].updated_at < refresh:
                        continue  # nothing changed and the timestamp is recent enough
                    self._scrape(i, at)
                    self._snap_tick[i] = tick
            self._refreshed_tick = tick
        return self._states

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
                release(self._views(now), now, send)
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
            self._before_change(i, t)
            finished = False
            for outcome in engines[i].advance(t):
                finished = finished or bool(outcome.finished)
                firsts = self._deliver(i, outcome, done_cb, on_first_token)
                finished = finished or (release_on_first_token and firsts)
            reschedule(i)
            if finished and held:
                poll()
        servers = [ServerResult(e.name, self._routed[i], e.counters) for i, e in enumerate(engines)]
        return FleetResult(results, servers, now)

    def _arrive(self, arrival: Arrival, route: Router, now: float, record: bool) -> RequestResult:
        result = RequestResult(arrival.request_id, arrival.model, arrival.time)
        result.payload = arrival.payload
        choice = route(arrival, self._views(now), now)
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
        result.status = "ok"
        if not 0 <= choice < len(self.engines):
            raise IndexError(f"route returned {choice} for a fleet of {len(self.engines)}")
        engine = self.engines[choice]
        result.server_name = engine.name
        try:
            request = engine.create_request(
                arrival.request_id,
                arrival.model,
                arrival.prompt,
                arrival=arrival.time,
                max_tokens=arrival.max_tokens,
                prompt_tokens=arrival.prompt_tokens,
            )
        except (UnknownModelError, InvalidRequestError) as exc:
            result.status, result.error = "error", str(exc)
            return
        result.server = choice
        result.prompt_tokens = request.prompt_tokens
        if record:
            result.token_times = []
        request.sink = result
        self._before_change(choice, now)
        engine.submit(request, now)
        self._routed[choice] += 1
        self._inflight[choice] += 1
        self._inflight_tokens[choice] += request.prompt_tokens
        models = self._inflight_models[choice]
        models[request.model] = models.get(request.model, 0) + 1
        self._unseen[choice] += 1
        self._unseen_tokens[choice] += request.prompt_tokens
        if self.answers_seen:
            self._unseen_by[request.request_id] = self._scrapes[choice]
        self._rebuild(choice)

    def _deliver(
        self,
        i: int,
        outcome: StepOutcome,
        on_finish: Callable[[RequestResult], None] | None,
        on_first_token: Callable[[RequestResult], None] | None = None,
    ) -> bool:
        """Hand the step's tokens to their results; whether any request's first token was
        among them."""
        first_time, t = outcome.first_time, outcome.time
        firsts = False
        longest = outcome.longest_step
        ends: list[float] | None = None
        for request in outcome.tokens:
            result: RequestResult = request.sink  # type: ignore[assignment]
            if result.first_token is None:
                result.first_token = first_time
                firsts = True
                # Still unseen by a scrape (routed since the last one): it answered.
                if self._unseen_by.pop(result.request_id, -1) == self._scrapes[i]:
                    self._answered[i] += 1
                    self._rebuild(i)
                if on_first_token is not None:
                    on_first_token(result)
            else:
                gap = first_time - result.finish if result.finish is not None else 0.0
                result.itl_max = max(result.itl_max, gap, longest)
            result.finish = t  # last token time until the request completes
            if result.token_times is not None:
                if ends is None:
                    ends = outcome.step_ends()
                result.token_times.extend(ends)
        for request in outcome.finished:
            result = request.sink  # type: ignore[assignment]
            result.completion_tokens = request.output_tokens
            result.cached_tokens = request.cached_tokens
            result.preemptions = request.preemptions
            result.adapter_loaded = request.adapter_loaded
            result.finish_reason = request.finish_reason
            self._inflight[i] -= 1
            self._inflight_tokens[i] -= request.prompt_tokens
            models = self._inflight_models[i]
            if models[request.model] <= 1:
                del models[request.model]
            else:
                models[request.model] -= 1
            if on_finish is not None:
                on_finish(result)
        if outcome.finished:
            self._rebuild(i)
        return firsts
