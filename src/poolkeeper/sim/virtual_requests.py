"""One request on one server of the virtual fleet: submitted to its engine, its tokens delivered.

`submit` creates the engine's request for an arrival (or records why the engine refused it) and
tells the scraped views; `deliver` hands an engine step's tokens to their `RequestResult`s
(first token, inter-token gaps, token times, what a finished request reports) and tells the
views and the router's callbacks. `VirtualFleet.run` (`sim/virtual.py`) calls both.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from poolkeeper.sim.engine import (
    EngineModel,
    InvalidRequestError,
    StepOutcome,
    UnknownModelError,
)
from poolkeeper.sim.virtual_results import Arrival, RequestResult
from poolkeeper.sim.virtual_views import ScrapedViews


def submit(
    engines: Sequence[EngineModel],
    scraped: ScrapedViews,
    arrival: Arrival,
    result: RequestResult,
    choice: int,
    now: float,
    record: bool,
) -> bool:
    """Submit the arrival to server `choice`'s engine at `now`; whether the engine took it
    (else `result` says the error)."""
    result.status = "ok"
    if not 0 <= choice < len(engines):
        raise IndexError(f"route returned {choice} for a fleet of {len(engines)}")
    engine = engines[choice]
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
        return False
    result.server = choice
    result.prompt_tokens = request.prompt_tokens
    if record:
        result.token_times = []
    request.sink = result
    scraped.before_change(choice, now)
    engine.submit(request, now)
    scraped.routed(choice, request)
    return True


def deliver(
    scraped: ScrapedViews,
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
            scraped.first_token(i, result.request_id)
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
        scraped.finished(i, request)
        if on_finish is not None:
            on_finish(result)
    if outcome.finished:
        scraped.rebuild(i)
    return firsts
