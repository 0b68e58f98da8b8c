"""Property and fuzz tests (hypothesis) of the parsers clients and servers feed: the request
body parser, the SSE re-framer, the Prometheus reader, the YAML loader, ext_proc message
sequences and Envoy's access-log entries (the response observer). Each must answer every
input with a result or its own precise error, never a crash.

Examples per property: POOLKEEPER_FUZZ_EXAMPLES (default 150 in CI; `make soak` raises it).
"""

from __future__ import annotations

import json
import math
import os
from typing import Any

from envoy.data.accesslog.v3 import accesslog_pb2
from google.protobuf import struct_pb2
from hypothesis import HealthCheck, given, settings, strategies as st

from poolkeeper import observation as wire
from poolkeeper.api.load import load_text
from poolkeeper.api.load_syntax import MAX_EXPANDED_NODES
from poolkeeper.backend.promtext import PromParseError, parse_families
from poolkeeper.errors import BadRequest
from poolkeeper.extproc.contracts import BodyBudget
from poolkeeper.extproc.outcome import outcome_of
from poolkeeper.extproc.state import Exchange
from poolkeeper.extproc.usage import SseUsageFilter
from poolkeeper.requestcontrol.body import parse_body
from tests.extproc.extproc_fakes import FakeRouter, body_msg, headers_msg, post_headers

EXAMPLES = int(os.environ.get("POOLKEEPER_FUZZ_EXAMPLES", "150"))
FUZZ = settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow])

_json = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20),
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4)
    ),
    max_leaves=20,
)


@FUZZ
@given(
    _json,
    st.one_of(st.text(max_size=30), _json),
    st.sampled_from(["/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/x"]),
)
def test_body_parser_structured(extra: Any, model: Any, path: str) -> None:
    payload = {"model": model, "messages": extra, "prompt": extra, "stream": extra}
    try:
        raw = json.dumps(payload).encode()
    except ValueError:
        return
    try:
        parsed = parse_body(path, raw)
    except BadRequest as exc:
        message = exc.message
    else:
        assert parsed.model == model
        return
    assert message


def _event(obj: Any) -> bytes:
    return b"data: " + json.dumps(obj).encode() + b"\n\n"


_events = st.lists(
    st.one_of(
        st.builds(
            lambda t: _event({"choices": [{"delta": {"content": t}}], "usage": None}),
            st.text(max_size=10),
        ),
        st.just(_event({"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 2}})),
        st.just(b": keep-alive\n\n"),
        st.binary(max_size=20),
    ),
    max_size=8,
).map(lambda events: b"".join(events) + b"data: [DONE]\n\n")


def _run(stream: bytes, cuts: list[int], strip: bool) -> tuple[bytes, Any]:
    sse = SseUsageFilter(strip_injected_usage=strip)
    out, last = b"", 0
    for cut in sorted({c % (len(stream) + 1) for c in cuts}):
        out += sse.feed(stream[last:cut])
        last = cut
    out += sse.feed(stream[last:]) + sse.finish()
    return out, sse.usage


@FUZZ
@given(_events, st.lists(st.integers(min_value=0), max_size=6), st.booleans())
def test_sse_reframer_is_split_invariant(stream: bytes, cuts: list[int], strip: bool) -> None:
    """However Envoy cuts the stream into chunks, the client gets the same bytes and the
    gateway reads the same usage; without stripping the bytes are exactly the server's."""
    whole, usage = _run(stream, [], strip)
    split, split_usage = _run(stream, cuts, strip)
    assert split == whole
    assert split_usage == usage
    if not strip:
        assert whole == stream


@FUZZ
@given(st.binary(max_size=400) | st.text(max_size=400))
def test_prometheus_reader_never_crashes(text: bytes | str) -> None:
    wanted = frozenset({"vllm:num_requests_waiting", "x", "vllm:gpu_cache_usage_perc"})
    try:
        families = parse_families(text, wanted)
    except PromParseError:
        return
    assert set(families) <= wanted


@FUZZ
@given(st.integers(min_value=1, max_value=12), st.integers(min_value=1, max_value=12))
def test_yaml_alias_expansion_is_bounded(width: int, depth: int) -> None:
    """A "billion laughs" document is refused (it used to hang the loader); small alias use
    still loads."""
    lines = ["    a0: &a0 [" + ",".join(["x"] * width) + "]"]
    for i in range(1, depth):
        lines.append(f"    a{i}: &a{i} [" + ",".join([f"*a{i - 1}"] * width) + "]")
    doc = (
        "apiVersion: inference.networking.x-k8s.io/v1alpha2\nkind: InferencePool\n"
        "metadata: {name: p}\nspec:\n  selector: {app: x}\n  targetPortNumber: 8000\n"
        "  extensionRef: {name: e}\n  extra:\n" + "\n".join(lines) + "\n"
    )
    result = load_text(doc)
    expanded = sum(width**i for i in range(1, depth + 1))
    refused = any("aliases" in str(e) for e in result.errors)
    if expanded > 2 * MAX_EXPANDED_NODES:
        assert refused
    if expanded < MAX_EXPANDED_NODES // 2:
        assert not refused


_CHAT = b'{"model": "base", "messages": []}'
_messages = st.lists(
    st.one_of(
        st.builds(lambda eos: headers_msg(post_headers(), eos=eos), st.booleans()),
        st.builds(
            lambda data, eos: body_msg(data, eos=eos),
            st.sampled_from([b"", _CHAT[:9], _CHAT[9:], _CHAT, b"{", b"x" * 5000]),
            st.booleans(),
        ),
        st.builds(
            lambda eos: headers_msg(
                {":status": "200", "content-type": "text/event-stream"}, eos=eos, response=True
            ),
            st.booleans(),
        ),
        st.builds(
            lambda data, eos: body_msg(data, eos=eos, response=True),
            st.sampled_from([b"data: {}\n\n", b"data: [DONE]\n\n", b"\x00\xff", b""]),
            st.booleans(),
        ),
    ),
    max_size=10,
)


@FUZZ
@given(_messages)
async def test_extproc_message_sequences_never_crash_or_leak(messages: list[Any]) -> None:
    """Any order of ext_proc messages (a misbehaving or buggy proxy): every message gets a
    list of replies, the body budget always comes back, a decision completes at most once."""
    router = FakeRouter()
    budget = BodyBudget(8000)
    exchange = Exchange(router, budget=budget)
    for message in messages:
        replies = await exchange.handle(message)
        assert isinstance(replies, list)
        assert budget.used <= budget.limit
    exchange.close()
    assert budget.used == 0
    assert len(router.completed) <= 1
    if exchange.decision is not None:
        assert len(router.completed) == 1


_WIRE_KEYS = [
    wire.EXCHANGE, "t0", wire.FIRST_BYTE_AT, wire.PROMPT_TOKENS,
    wire.COMPLETION_TOKENS, wire.CACHED_TOKENS, wire.EVENTS, wire.DONE_EVENTS, "other",
]  # fmt: skip


@FUZZ
@given(
    st.fixed_dictionaries(
        {wire.EXCHANGE: st.text(max_size=8)},
        optional={key: st.floats() | _json for key in _WIRE_KEYS[1:]},
    )
    | st.dictionaries(st.sampled_from(_WIRE_KEYS), _json | st.floats(), max_size=9),
    st.integers(min_value=0, max_value=999),
    st.lists(st.sampled_from(["downstream_remote_reset", "upstream_protocol_error"]), max_size=2),
)
def test_access_log_entries_never_crash_the_observer(
    fields: dict[str, Any], status: int, flags: list[str]
) -> None:
    """Whatever an access-log entry carries (the Lua filter's keys with any JSON value, NaN
    and infinities included), reading it gives an outcome with sane numbers, or nothing."""
    entry = accesslog_pb2.HTTPAccessLogEntry()
    entry.response.response_code.value = status
    meta = struct_pb2.Struct()
    meta.update(fields)
    entry.common_properties.metadata.filter_metadata[wire.NAMESPACE].CopyFrom(meta)
    for flag in flags:
        setattr(entry.common_properties.response_flags, flag, True)
    parsed = outcome_of(entry)
    if not isinstance(fields.get(wire.EXCHANGE), str):
        assert parsed is None
        return
    assert parsed is not None
    key, outcome = parsed
    assert key == fields[wire.EXCHANGE]
    for count in (outcome.prompt_tokens, outcome.completion_tokens, outcome.cached_tokens):
        assert count is None or (isinstance(count, int) and count >= 0)
    assert outcome.events >= 0
    assert outcome.done_events >= 0
    after = outcome.first_byte_after_s
    assert after is None or (after >= 0 and math.isfinite(after))


def test_billion_laughs_is_refused_at_once() -> None:
    """Found by the fuzzing above: this document hung the loader for minutes."""
    lines = ['    a0: &a0 ["x","x","x","x","x","x","x","x","x","x"]']
    lines += [f"    a{i}: &a{i} [" + ",".join([f"*a{i - 1}"] * 10) + "]" for i in range(1, 9)]
    doc = (
        "apiVersion: inference.networking.x-k8s.io/v1alpha2\nkind: InferencePool\n"
        "metadata: {name: p}\nspec:\n  selector: {app: x}\n  targetPortNumber: 8000\n"
        "  extensionRef: {name: e}\n  extra:\n" + "\n".join(lines) + "\n"
    )
    (error,) = load_text(doc).errors
    assert "aliases" in str(error)
