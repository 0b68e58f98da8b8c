"""Physics of the engine model: queueing, KV preemption, prefix hits, LoRA swaps, batch cost."""

from __future__ import annotations

from dataclasses import replace

import pytest

from poolkeeper.sim.engine import (
    EngineModel,
    InvalidRequestError,
    RequestStatus,
    SimRequest,
    UnknownModelError,
)
from poolkeeper.sim.params import EngineConfig

BASE = EngineConfig()
MODEL = BASE.model


def run_all(engine: EngineModel, until: float = 1e9) -> list[SimRequest]:
    """Step the engine until idle; returns requests in finishing order."""
    done: list[SimRequest] = []
    while (t := engine.next_event_time()) is not None and t <= until:
        for outcome in engine.advance(t):
            done.extend(outcome.finished)
    return done


def submit(engine: EngineModel, rid: str, prompt: str, *, at: float = 0.0, out: int = 10,
           model: str = MODEL) -> SimRequest:  # fmt: skip
    request = engine.create_request(rid, model, prompt, arrival=at, max_tokens=out)
    engine.submit(request, at)
    return request


def unique_prompt(i: int, chars: int = 400) -> str:
    return (f"request number {i} asks something different. " * (chars // 20))[:chars]


def test_requests_beyond_max_num_seqs_wait_in_fifo_order() -> None:
    engine = EngineModel(replace(BASE, max_num_seqs=2))
    reqs = [submit(engine, f"r{i}", unique_prompt(i), out=5) for i in range(5)]
    first = engine.next_event_time()
    assert first is not None
    engine.advance(first)
    stats = engine.stats()
    assert (stats.running, stats.waiting) == (2, 3)
    finished = run_all(engine)
    assert [r.request_id for r in finished] == ["r0", "r1", "r2", "r3", "r4"]
    # The later requests queued: their time to first token includes the earlier ones' work.
    assert reqs[4].first_token_time is not None
    assert reqs[0].first_token_time is not None
    assert reqs[4].first_token_time > reqs[0].finish_time  # type: ignore[operator]


def test_kv_exhaustion_preempts_and_recomputes() -> None:
    # 12 blocks x 16 tokens; each request grows to 2 + 4 blocks, three of them cannot coexist.
    engine = EngineModel(replace(BASE, num_gpu_blocks=12, enable_prefix_caching=False))
    reqs = [submit(engine, f"r{i}", unique_prompt(i, 128), out=60) for i in range(3)]
    finished = run_all(engine)
    assert len(finished) == 3
    assert engine.counters.preemptions >= 1
    assert sum(r.preemptions for r in reqs) == engine.counters.preemptions
    # The most recently admitted request is the victim; the oldest never is.
    assert reqs[0].preemptions == 0
    assert reqs[2].preemptions >= 1
    assert all(r.output_tokens == 60 for r in reqs)
    assert engine.kv.referenced == 0


def test_prefix_cache_hit_skips_prefill_and_cuts_ttft() -> None:
    engine = EngineModel(BASE)
    shared = unique_prompt(0, 16_000)  # ~4000 tokens
    cold = submit(engine, "cold", shared, out=2)
    run_all(engine)
    warm = submit(engine, "warm", shared + " and a new question", at=10.0, out=2)
    other = submit(engine, "other", unique_prompt(1, 16_000), at=20.0, out=2)
    run_all(engine)
    assert cold.cached_tokens == 0
    assert warm.cached_tokens >= 3_900
    assert other.cached_tokens == 0
    ttft = {r.request_id: r.first_token_time - r.arrival for r in (cold, warm, other)}  # type: ignore[operator]
    assert ttft["warm"] < 0.25 * ttft["cold"]
    assert ttft["other"] == pytest.approx(ttft["cold"], rel=0.05)
    assert engine.counters.prefix_hits == warm.cached_tokens


def test_evicted_prefix_no_longer_hits() -> None:
    # The cache holds 40 blocks: a second, different long prompt evicts the first one.
    engine = EngineModel(replace(BASE, num_gpu_blocks=40))
    first = unique_prompt(0, 30 * 64)
    submit(engine, "a", first, out=1)
    run_all(engine)
    submit(engine, "b", unique_prompt(1, 30 * 64), at=1.0, out=1)
    run_all(engine)
    again = submit(engine, "c", first, at=2.0, out=1)
    run_all(engine)
    assert again.cached_tokens < 30 * 16 // 2


def test_adapter_requests_wait_for_a_lora_slot_and_pay_the_swap() -> None:
    config = replace(BASE, lora_adapters=("a", "b"), max_loras=1)
    engine = EngineModel(config)
    ra = submit(engine, "ra", unique_prompt(0), out=50, model="a")
    rb = submit(engine, "rb", unique_prompt(1), out=5, model="b")
    rbase = submit(engine, "base", unique_prompt(2), out=5)
    t = engine.next_event_time()
    assert t is not None
    engine.advance(t)
    stats = engine.stats()
    assert stats.running_adapters == ("a",)
    assert stats.waiting_adapters == ("b",)
    assert stats.waiting_deferred == 1
    assert rbase.status is RequestStatus.RUNNING  # skipped past the deferred request
    run_all(engine)
    assert ra.adapter_loaded
    assert rb.adapter_loaded
    assert engine.counters.lora_loads == 2
    assert rb.first_token_time is not None
    assert ra.finish_time is not None
    assert rb.first_token_time > ra.finish_time  # b waited for a's slot
    # A resident adapter needs no swap.
    again = submit(engine, "rb2", unique_prompt(3), at=100.0, out=5, model="b")
    run_all(engine)
    assert not again.adapter_loaded
    assert engine.counters.lora_loads == 2


def test_adapter_swap_costs_load_time() -> None:
    config = replace(BASE, lora_adapters=("a",), max_loras=1, lora_load_s=0.05)
    engine = EngineModel(config)
    base = submit(engine, "base", unique_prompt(0), out=1)
    run_all(engine)
    lora = submit(engine, "lora", unique_prompt(1), at=5.0, out=1, model="a")
    run_all(engine)
    base_ttft = base.first_token_time - base.arrival  # type: ignore[operator]
    lora_ttft = lora.first_token_time - lora.arrival  # type: ignore[operator]
    assert lora_ttft - base_ttft == pytest.approx(0.05, abs=0.01)


def test_decode_slows_as_the_batch_grows() -> None:
    def mean_itl(batch: int) -> float:
        engine = EngineModel(BASE)
        reqs = [submit(engine, f"r{i}", unique_prompt(i, 2000), out=50) for i in range(batch)]
        run_all(engine)
        gaps = [(r.finish_time or 0.0) - (r.first_token_time or 0.0) for r in reqs if r.finish_time]
        assert len(gaps) == batch
        return sum(gaps) / (49 * batch)

    small, large = mean_itl(1), mean_itl(128)
    assert small == pytest.approx(0.0065, abs=0.002)  # ~6-7 ms at batch 1
    assert large > 1.5 * small


def test_long_prompts_are_chunked_over_several_steps() -> None:
    engine = EngineModel(replace(BASE, max_num_batched_tokens=512))
    request = submit(engine, "long", unique_prompt(0, 4 * 2048), out=1)
    run_all(engine)
    assert engine.counters.steps == 4  # 2048 prompt tokens / 512 per step
    assert request.output_tokens == 1


def test_same_seed_same_run_and_time_scale_stretches_it() -> None:
    def scenario(config: EngineConfig) -> list[tuple[str, float | None, int]]:
        engine = EngineModel(config)
        for i in range(20):
            request = engine.create_request(
                f"r{i}", MODEL, unique_prompt(i % 3, 800), arrival=i * 0.01, max_tokens=None
            )
            engine.submit(request, request.arrival)
        return [(r.request_id, r.finish_time, r.output_tokens) for r in run_all(engine)]

    jittery = replace(BASE, step_jitter=0.1, seed=7)
    assert scenario(jittery) == scenario(jittery)
    assert scenario(jittery) != scenario(replace(jittery, seed=8))
    fast = scenario(replace(BASE, time_scale=0.1))
    slow = scenario(BASE)
    assert [o for _, _, o in fast] != []
    assert len(fast) == len(slow)
    # 10x faster: the work done after the last arrival shrinks about tenfold.
    assert (fast[-1][1] - 0.19) < 0.2 * (slow[-1][1] - 0.19)  # type: ignore[operator]


def test_cancel_frees_slots_and_blocks() -> None:
    engine = EngineModel(replace(BASE, max_num_seqs=1))
    a = submit(engine, "a", unique_prompt(0), out=100)
    b = submit(engine, "b", unique_prompt(1), out=3)
    t = engine.next_event_time()
    assert t is not None
    engine.advance(t)
    assert engine.kv.referenced > 0
    assert engine.cancel("a", t) is a
    assert a.status is RequestStatus.ABORTED
    run_all(engine)
    assert b.status is RequestStatus.FINISHED
    assert engine.kv.referenced == 0
    assert engine.counters.finished["abort"] == 1
    assert engine.cancel("a", t) is None


def test_requests_that_cannot_be_served_are_refused() -> None:
    engine = EngineModel(replace(BASE, num_gpu_blocks=10, lora_adapters=("a",), max_loras=0))
    with pytest.raises(UnknownModelError, match="does not exist"):
        engine.create_request("x", "nope", "hi", arrival=0.0)
    with pytest.raises(InvalidRequestError, match="maximum context length is 160"):
        engine.create_request("x", MODEL, "x" * 600, arrival=0.0, max_tokens=20)
    with pytest.raises(InvalidRequestError, match="LoRA is disabled"):
        engine.create_request("x", "a", "hi", arrival=0.0)
    with pytest.raises(InvalidRequestError, match="at least one token"):
        engine.create_request("x", MODEL, "", arrival=0.0)


def test_without_max_tokens_output_is_drawn_and_stops() -> None:
    engine = EngineModel(replace(BASE, default_output_tokens=40))
    lengths = []
    for i in range(50):
        request = engine.create_request(f"r{i}", MODEL, "hello", arrival=0.0)
        assert request.finish_reason == "stop"
        lengths.append(request.max_tokens)
    assert min(lengths) >= 1
    assert 20 < sum(lengths) / len(lengths) < 60
    assert len(set(lengths)) > 10


def test_a_request_arriving_mid_step_waits_for_the_next_step() -> None:
    engine = EngineModel(BASE)
    submit(engine, "a", unique_prompt(0), out=5)
    end = engine.next_event_time()
    assert end is not None
    late = submit(engine, "late", unique_prompt(1), at=end / 2, out=1)
    run_all(engine)
    assert late.first_token_time is not None
    assert late.first_token_time > end
