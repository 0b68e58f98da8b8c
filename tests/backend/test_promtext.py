"""The filter reader against prometheus_client's parser (the oracle), plus its own error rules."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from hypothesis import given, settings, strategies as st
from prometheus_client.parser import text_string_to_metric_families

from poolkeeper.backend.promtext import FamilyFilter, PromParseError, Sample, parse_families

FIXTURES = Path(__file__).parent / "fixtures"
PAYLOADS = sorted(FIXTURES.glob("*.prom"))

Flat = list[tuple[str, dict[str, str], float, float | None]]


def _oracle(text: str) -> dict[str, Flat]:
    """Samples by family name as prometheus_client reads them."""
    lines = {line.split("{")[0].split()[0] for line in text.splitlines() if line.strip()}
    out: dict[str, Flat] = {}
    for family in text_string_to_metric_families(text):
        flat = out.setdefault(family.name, [])
        for s in family.samples:
            name = s.name
            # prometheus_client renames a counter's `x` samples to `x_total` (OpenMetrics style);
            # the page itself says `x`, which is what the filter reader reports.
            if family.type == "counter" and name not in lines and name[:-6] in lines:
                name = name[:-6]
            timestamp = None if s.timestamp is None else float(s.timestamp)
            flat.append((name, dict(s.labels), float(s.value), timestamp))
    return out


def _ours(found: dict[str, list[Sample]]) -> dict[str, Flat]:
    return {
        family: [(s.name, dict(s.labels), s.value, s.timestamp) for s in samples]
        for family, samples in found.items()
    }


def _same(a: Flat, b: Flat) -> bool:
    if len(a) != len(b):
        return False
    for (na, la, va, ta), (nb, lb, vb, tb) in zip(a, b, strict=True):
        values_equal = va == vb or (math.isnan(va) and math.isnan(vb))
        if na != nb or la != lb or not values_equal or ta != tb:
            return False
    return True


@pytest.mark.parametrize("path", PAYLOADS, ids=lambda p: p.stem)
def test_every_family_matches_the_oracle(path: Path) -> None:
    text = path.read_text()
    expected = _oracle(text)
    found = _ours(parse_families(text.encode(), frozenset(expected)))
    assert set(found) == set(expected)
    for family, samples in expected.items():
        assert _same(found[family], samples), family


def test_only_wanted_families_are_returned() -> None:
    text = (FIXTURES / "vllm_v1.prom").read_text()
    wanted = frozenset({"vllm:num_requests_waiting", "vllm:lora_requests_info", "absent_family"})
    found = parse_families(text, wanted)
    assert set(found) == {"vllm:num_requests_waiting", "vllm:lora_requests_info"}
    assert [s.value for s in found["vllm:num_requests_waiting"]] == [3.0]
    assert len(found["vllm:lora_requests_info"]) == 3
    # `vllm:num_requests_waiting_by_reason` shares the prefix but is another family.
    assert all(s.name == "vllm:num_requests_waiting" for s in found["vllm:num_requests_waiting"])


def test_histogram_suffixes_group_under_the_family() -> None:
    text = (FIXTURES / "vllm_v1.prom").read_text()
    found = parse_families(text, frozenset({"vllm:time_to_first_token_seconds"}))
    names = {s.name for s in found["vllm:time_to_first_token_seconds"]}
    assert names == {
        "vllm:time_to_first_token_seconds_bucket",
        "vllm:time_to_first_token_seconds_count",
        "vllm:time_to_first_token_seconds_sum",
    }


def test_an_exactly_wanted_suffixed_name_is_its_own_family() -> None:
    text = "a 1\na_count 2\n"
    found = parse_families(text, frozenset({"a", "a_count"}))
    assert [s.value for s in found["a"]] == [1.0]
    assert [s.value for s in found["a_count"]] == [2.0]


def test_escapes_special_values_timestamps_and_layout() -> None:
    text = (
        "# HELP g a gauge\n"
        '  g{path="C:\\\\dir",quote="say \\"hi\\"",nl="a\\nb",odd="\\t"} NaN\n'
        "g{} +Inf 1700000000123\r\n"
        'g{ a = "x" , } -Inf\n'
        "g\t-1.5e-3"
    )
    found = parse_families(text, frozenset({"g"}))["g"]
    assert dict(found[0].labels) == {
        "path": "C:\\dir",
        "quote": 'say "hi"',
        "nl": "a\nb",
        "odd": "\\t",  # unknown escapes stay as written, like prometheus_client
    }
    assert math.isnan(found[0].value)
    assert found[1].value == math.inf
    assert found[1].timestamp == pytest.approx(1700000000.123)
    assert dict(found[2].labels) == {"a": "x"}
    assert found[2].value == -math.inf
    assert found[3].value == -0.0015


@pytest.mark.parametrize(
    ("line", "reason"),
    [
        ("g", "missing value"),
        ('g{a="1"}', "missing value"),
        ("g abc", "invalid value"),
        ("g 1_000", "invalid value"),
        ('g{a="1" 3', "expected ','"),
        ("g{a=1} 3", "bad label syntax"),
        ('g{a="1",a="2"} 3', "duplicate label"),
        ("g 1 2 3", "unexpected text"),
        ("g 1 soon", "invalid timestamp"),
        ('g{a="unterminated} 1', "bad label syntax"),
    ],
)
def test_malformed_wanted_lines_raise_with_line_number(line: str, reason: str) -> None:
    text = f"# TYPE g gauge\nother 1\n{line}\n"
    with pytest.raises(PromParseError) as info:
        parse_families(text, frozenset({"g"}))
    assert info.value.line_no == 3
    assert reason in str(info.value)
    assert str(info.value).startswith("line 3:")


def test_garbage_in_unwanted_families_is_not_looked_at() -> None:
    text = "<html>not metrics</html>\nbroken{{{ line\ng 2\n"
    assert [s.value for s in parse_families(text, frozenset({"g"}))["g"]] == [2.0]
    assert parse_families("<html><body>502 Bad Gateway</body></html>", frozenset({"g"})) == {}


def test_invalid_utf8_is_replaced_not_fatal() -> None:
    found = parse_families(b'g{a="\xff"} 1\n', frozenset({"g"}))
    assert found["g"][0].labels["a"] == "\ufffd"


def test_filter_is_reusable_and_empty_wanted_reads_nothing() -> None:
    reader = FamilyFilter(frozenset({"g"}))
    assert reader.parse("g 1\n")["g"][0].value == 1.0
    assert reader.parse("g 2\n")["g"][0].value == 2.0
    assert FamilyFilter(frozenset()).parse("g 1\n") == {}


# --- generated payloads -------------------------------------------------------------------

_NAME = st.from_regex(r"[a-zA-Z_:][a-zA-Z0-9_:]{0,20}", fullmatch=True)
# Names starting with "__" are reserved (prometheus_client rejects them; we do not check).
_LABEL = st.from_regex(r"[a-zA-Z_][a-zA-Z0-9_]{0,10}", fullmatch=True).filter(
    lambda n: not n.startswith("__")
)
_LABEL_VALUE = st.text(
    alphabet=st.characters(blacklist_categories=("Cs", "Cc"), blacklist_characters="\u2028\u2029")
    | st.sampled_from(['"', "\\", "\n", ",", "}", "{", "=", " "]),
    max_size=12,
)
_VALUE = st.one_of(
    st.floats(allow_nan=True, allow_infinity=True),
    st.integers(min_value=-(10**12), max_value=10**12),
)
_TIMESTAMP = st.none() | st.integers(min_value=0, max_value=2**52)


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _format_value(value: float | int) -> str:
    if isinstance(value, int):
        return str(value)
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    return repr(value)


@st.composite
def _payloads(draw: st.DrawFn) -> str:
    names = draw(st.lists(_NAME, min_size=1, max_size=5, unique=True))
    # Names that are another name plus a histogram/counter suffix are ambiguous by design.
    suffixes = ("_bucket", "_sum", "_count", "_total")
    names = [n for n in names if not any(n == m + s for m in names for s in suffixes)]
    lines: list[str] = []
    for name in names:
        lines.append(f"# HELP {name} generated")
        lines.append(f"# TYPE {name} gauge")
        label_names = draw(st.lists(_LABEL, max_size=3, unique=True))
        for _ in range(draw(st.integers(min_value=1, max_value=3))):
            labels = {label: draw(_LABEL_VALUE) for label in label_names}
            rendered = ",".join(f'{k}="{_escape(v)}"' for k, v in labels.items())
            braces = bool(labels) or draw(st.booleans())
            label_part = f"{{{rendered}}}" if braces else ""
            timestamp = draw(_TIMESTAMP)
            suffix = "" if timestamp is None else f" {timestamp}"
            lines.append(f"{name}{label_part} {_format_value(draw(_VALUE))}{suffix}")
    return "\n".join(lines) + "\n"


@settings(max_examples=150, deadline=None)
@given(_payloads(), st.data())
def test_generated_payloads_match_the_oracle(text: str, data: st.DataObject) -> None:
    expected = _oracle(text)
    wanted = frozenset(data.draw(st.sets(st.sampled_from(sorted(expected)))))
    found = _ours(parse_families(text, wanted))
    assert set(found) == wanted
    for family in wanted:
        assert _same(found[family], expected[family]), family


@pytest.mark.parametrize(
    ("line", "reason"),
    [
        ('m{a="1",b=2} 1', "bad label syntax"),  # the error is at b, not a duplicate of a
        ('m{a="1",X a="2"} 1', "bad label syntax"),  # X is no blank
        ('m{a="1", a="2"} 1', "duplicate label 'a'"),
        ('m{a="1", ', "bad label syntax"),  # cut off after a blank
        ('m{a="1",', "bad label syntax"),  # cut off after a comma
        ('m{a="1"', "expected ',' or '}' after a label"),  # cut off after a label
        ("m", "missing value"),
        ("m 1 2 3", "unexpected text after the timestamp"),
        ("m 1 NaN", "invalid timestamp 'NaN'"),
    ],
)
def test_malformed_lines_say_what_is_wrong(line: str, reason: str) -> None:
    with pytest.raises(PromParseError) as err:
        parse_families(f"# HELP m x\n{line}\n", frozenset({"m"}))
    assert err.value.reason == reason
    assert err.value.line_no == 2
    assert str(err.value) == f"line 2: {reason}: {line.strip()!r}"


def test_parse_error_shortens_long_lines_to_120_characters() -> None:
    assert str(PromParseError(1, "r", "x" * 120)) == f"line 1: r: {'x' * 120!r}"
    assert str(PromParseError(1, "r", "y" * 121)) == f"line 1: r: {'y' * 117 + '...'!r}"


def test_family_filter_keeps_its_wanted_names() -> None:
    wanted = frozenset({"a", "b"})
    assert FamilyFilter(wanted).wanted == wanted
