"""Output (decode) blocks are stored as they fill, chained to the prompt's, and the events of one
step are grouped at its end: vLLM's KV events (docs/notes/2026-12-07-kv-events-decode.md)."""

from __future__ import annotations

from dataclasses import replace

from poolkeeper.kvevents import engine_block_hashes
from poolkeeper.scheduling.exact_prefix import ExactPrefixIndex
from poolkeeper.sim.engine import EngineModel, SimRequest
from poolkeeper.sim.kvcache import output_block_hash
from poolkeeper.sim.params import EngineConfig
from poolkeeper.sim.textgen import stream_seed, text_between

BASE = EngineConfig()
MODEL = BASE.model


class Recorder:
    """A KV sink and step-end hook: (kind, hashes, parent) per store, removal and step end."""

    def __init__(self) -> None:
        self.log: list[tuple[str, list[int], int | None]] = []

    def stored(self, hashes: list[int], parent: int | None) -> None:
        self.log.append(("stored", list(hashes), parent))

    def removed(self, hashes: list[int]) -> None:
        self.log.append(("removed", list(hashes), None))

    def step_ended(self, end: float) -> None:
        self.log.append(("end", [], None))

    def stored_hashes(self) -> list[int]:
        return [h for kind, hashes, _ in self.log if kind == "stored" for h in hashes]

    def batches(self) -> list[list[str]]:
        """The kinds of events between consecutive step ends (what one batch holds)."""
        out: list[list[str]] = [[]]
        for kind, _, _ in self.log:
            if kind == "end":
                out.append([])
            else:
                out[-1].append(kind)
        return out


def engine_with(recorder: Recorder, **changes: object) -> EngineModel:
    engine = EngineModel(replace(BASE, **changes))  # type: ignore[arg-type]
    engine.kv.sink = recorder
    engine.kv_step_end = recorder.step_ended
    return engine


def run(engine: EngineModel) -> None:
    while (t := engine.next_event_time()) is not None:
        engine.advance(t)


def full_text(request: SimRequest, prompt: str, tokens: int) -> str:
    return prompt + text_between(stream_seed(BASE.seed, request.request_id), 0, tokens)


def test_output_blocks_are_stored_chained_to_the_prompt_with_the_texts_hashes() -> None:
    recorder = Recorder()
    engine = engine_with(recorder)
    prompt = "x" * 70  # 18 tokens (the last 2 characters short): 1 full prompt block
    request = engine.create_request("r1", MODEL, prompt, arrival=0.0, max_tokens=60)
    engine.submit(request, 0.0)
    run(engine)
    # 18 + 60 tokens, the last one never computed: 77 tokens of KV, 306 characters of text
    # (70 + 59 x 4): 4 full blocks of 64 characters, the same as hashing the whole text.
    expected = engine_block_hashes(MODEL, full_text(request, prompt, 59), 16)
    assert len(expected) == 4
    assert recorder.stored_hashes() == expected
    parents = [parent for kind, _, parent in recorder.log if kind == "stored"]
    assert parents == [None, *expected[:-1]]
    assert request.block_hashes == expected  # kept on the request (a preemption's recompute)


def test_a_block_is_stored_in_the_step_that_computes_its_last_token() -> None:
    recorder = Recorder()
    engine = engine_with(recorder)
    prompt = "y" * 64  # exactly one block: the output starts block 2 at its first character
    request = engine.create_request("r2", MODEL, prompt, arrival=0.0, max_tokens=40)
    engine.submit(request, 0.0)
    ends: list[tuple[float, int]] = []  # (step end, tokens computed after it)
    while (t := engine.next_event_time()) is not None:
        engine.advance(t)
        ends.append((t, request.num_computed))
    batches = recorder.batches()
    assert batches[-1] == []  # nothing after the last step's end
    stored_in = [i for i, b in enumerate(batches[:-1]) if "stored" in b]
    # Step 0 prefills (stores the prompt block); blocks 2 and 3 fill in the steps that
    # compute tokens 32 and 48 (55 of the 56 tokens are ever computed).
    assert stored_in[0] == 0
    assert [ends[i][1] for i in stored_in[1:]] == [32, 48]
    assert sum(batches[i].count("stored") for i in stored_in) == 3


def test_a_second_turn_that_repeats_the_answer_matches_its_blocks_in_the_exact_index() -> None:
    recorder = Recorder()
    engine = engine_with(recorder)
    prompt = "z" * 128
    request = engine.create_request("r3", MODEL, prompt, arrival=0.0, max_tokens=70)
    engine.submit(request, 0.0)
    run(engine)
    index = ExactPrefixIndex()
    for kind, hashes, parent in recorder.log:
        if kind == "stored":
            index.stored("e", hashes, 0.0, head=parent is None)
    answered = full_text(request, prompt, 69)  # 128 + 276 characters: 6 full blocks
    follow_up = answered + " and then?"
    assert index.match(engine_block_hashes(MODEL, follow_up, 16)) == {"e": 6}
    assert index.match(engine_block_hashes(MODEL, prompt, 16)) == {"e": 2}


def test_a_preempted_request_hits_its_own_output_blocks_when_it_resumes() -> None:
    recorder = Recorder()
    # 9 blocks: two requests of 1 prompt block growing to 5 blocks each cannot coexist.
    engine = engine_with(recorder, num_gpu_blocks=9)
    a = engine.create_request("a", MODEL, "a" * 64, arrival=0.0, max_tokens=70)
    b = engine.create_request("b", MODEL, "b" * 64, arrival=0.0, max_tokens=70)
    engine.submit(a, 0.0)
    engine.submit(b, 0.0)
    run(engine)
    assert a.preemptions + b.preemptions >= 1
    victim = a if a.preemptions else b
    # The events replay to the cache's contents: a block is stored only when absent and
    # removed only when present (what keeps the EPP's exact index right).
    present: set[int] = set()
    for kind, hashes, _ in recorder.log:
        if kind == "stored":
            assert not present & set(hashes)
            present.update(hashes)
        elif kind == "removed":
            assert set(hashes) <= present
            present.difference_update(hashes)
    assert present == set(engine.kv._refcount)
    # Its recompute found blocks it had computed beyond its one prompt block (16 tokens).
    assert engine.counters.prefix_hits >= 32
    assert (
        victim.block_hashes[:4]
        == engine_block_hashes(MODEL, full_text(victim, victim_prompt(victim), 69), 16)[:4]
    )


def victim_prompt(request: SimRequest) -> str:
    return request.request_id * 64


def test_synthetic_token_counts_keep_the_output_private() -> None:
    recorder = Recorder()
    engine = engine_with(recorder)
    request = engine.create_request(
        "r4", MODEL, "w" * 64, arrival=0.0, max_tokens=40, prompt_tokens=100
    )
    assert request.hash_text is None  # the text does not say which tokens the blocks hold
    engine.submit(request, 0.0)
    run(engine)
    assert recorder.stored_hashes() == engine_block_hashes(MODEL, "w" * 64, 16)


def test_output_block_hash_is_the_chain_over_prompt_and_output_text() -> None:
    seed = stream_seed(0, "q")
    prompt = "p" * 21  # not a multiple of 4 characters: the output's pieces straddle blocks
    text = prompt + text_between(seed, 0, 100)
    chain = engine_block_hashes(MODEL, text, 16)
    parent = None
    for k, h in enumerate(chain):
        assert output_block_hash(MODEL, prompt, seed, k, parent, 16) == h
        parent = h


def test_fused_decode_steps_store_the_same_blocks_as_single_steps() -> None:
    logs = []
    for fused in (1, 16):
        recorder = Recorder()
        engine = engine_with(recorder)
        engine.max_fused_steps = fused
        request = engine.create_request("f", MODEL, "f" * 80, arrival=0.0, max_tokens=90)
        engine.submit(request, 0.0)
        run(engine)
        logs.append(recorder.stored_hashes())
    assert logs[0] == logs[1]
    assert len(logs[0]) == (80 + 89 * 4) // 64


def test_a_split_fused_step_still_stores_the_block_it_fills() -> None:
    """An arrival during the last of several fused decode steps splits them; the step left in
    progress fills the answer's last block, which must be stored (it was freed unnamed)."""
    config = replace(BASE, block_size=4)
    answers = {}
    for fused in (1, 8):
        engine = EngineModel(config, max_fused_steps=fused)
        recorder = Recorder()
        engine.kv.sink = recorder
        a = engine.create_request("a", MODEL, "x" * 16, arrival=0.0, max_tokens=5)
        engine.submit(a, 0.0)
        first = engine.next_event_time()
        assert first is not None
        engine.advance(first)  # the prefill: the first token
        step = engine._step
        assert step is not None
        end = engine.next_event_time()
        assert end is not None
        mid = step.end_of(step.fused - 2) + 1e-6 if step.fused > 1 else end - 1e-6
        engine.advance(mid)
        b = engine.create_request("b", MODEL, "y" * 8, arrival=mid, max_tokens=1)
        engine.submit(b, mid)  # during the last fused step: the fused run is split
        while (t := engine.next_event_time()) is not None:
            engine.advance(t)
        want = engine_block_hashes(MODEL, "x" * 16 + text_between(a.text_seed, 0, 4), 4)
        stored = set(recorder.stored_hashes())
        answers[fused] = [h in stored for h in want]
        assert a.block_hashes == want
    assert answers[1] == answers[8] == [True, True]  # the prompt's block and the answer's
