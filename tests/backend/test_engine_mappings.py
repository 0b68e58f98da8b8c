"""Engine mappings: realistic pages of each engine into EndpointMetrics, and the edge rules."""

from __future__ import annotations

from pathlib import Path

import pytest

from poolkeeper.backend.engines import (
    BUILTIN_MAPPINGS,
    MetricSpec,
    MissingMetrics,
    known_engines,
    mapping_for,
)
from poolkeeper.backend.promtext import PromParseError
from poolkeeper.datastore.endpoint import EndpointMetrics

FIXTURES = Path(__file__).parent / "fixtures"
FRESH = EndpointMetrics()


def _read(engine: str, fixture: str, previous: EndpointMetrics = FRESH) -> EndpointMetrics:
    return mapping_for(engine).read((FIXTURES / fixture).read_bytes(), previous, 12.5)


def test_vllm_v1_page() -> None:
    m = _read("vllm", "vllm_v1.prom")
    assert (m.waiting, m.running, m.kv_cache_usage) == (3, 7, 0.4217)
    # Newest non-empty lora series (value 1.7382173412e9) wins over the newer-by-line empty one.
    assert m.active_adapters == {"sql-lora", "tweet-lora"}
    assert m.waiting_adapters == {"chat-lora"}
    assert m.max_adapters == 4
    assert (m.block_size, m.num_gpu_blocks) == (16, 81767)
    assert m.updated_at == 12.5
    assert m.error is None


def test_vllm_v0_page_falls_back_to_gpu_cache_usage() -> None:
    m = _read("vllm", "vllm_v0.prom")
    assert (m.waiting, m.running, m.kv_cache_usage) == (11, 4, 0.875)
    assert m.active_adapters == {"lora1", "lora2"}
    assert m.waiting_adapters == {"lora3"}
    assert m.max_adapters == 2
    assert (m.block_size, m.num_gpu_blocks) == (16, 2081)


def test_vllm_prefers_the_v1_kv_name_when_both_are_present() -> None:
    page = (
        "vllm:num_requests_waiting 0\nvllm:num_requests_running 0\n"
        "vllm:gpu_cache_usage_perc 0.9\nvllm:kv_cache_usage_perc 0.2\n"
    )
    assert mapping_for("vllm").read(page, FRESH, 1.0).kv_cache_usage == 0.2


def test_vllm_data_parallel_sums_queues_and_takes_max_kv() -> None:
    m = _read("vllm", "vllm_dp.prom")
    assert (m.waiting, m.running) == (4, 11)
    assert m.kv_cache_usage == 0.625
    assert (m.block_size, m.num_gpu_blocks) == (32, 40000)
    assert m.active_adapters == frozenset()
    assert m.max_adapters == 0


def test_sglang_page() -> None:
    m = _read("sglang", "sglang.prom")
    assert (m.waiting, m.running, m.kv_cache_usage) == (2, 9, 0.31)
    assert (m.block_size, m.num_gpu_blocks) == (1, 363584)


def test_trtllm_serve_page() -> None:
    m = _read("trtllm-serve", "trtllm_serve.prom")
    assert (m.waiting, m.running, m.kv_cache_usage) == (1, 12, 0.7)
    assert (m.block_size, m.num_gpu_blocks) == (64, 8192)


def test_triton_page_uses_label_filters() -> None:
    m = _read("triton-trtllm", "triton_trtllm.prom")
    # waiting/scheduled, not context/active/max of the same family
    assert (m.waiting, m.running, m.kv_cache_usage) == (2, 6, 0.45)
    assert (m.block_size, m.num_gpu_blocks) == (64, 4096)


def test_llamacpp_page() -> None:
    """A page captured from a real `llama-server --metrics` (tests/realengine) with its 4 slots
    busy and 2 requests deferred: no KV family, and that is not a partial page."""
    m = _read("llamacpp", "llamacpp.prom")
    assert (m.waiting, m.running, m.kv_cache_usage) == (2, 4, 0.0)
    assert m.error is None
    assert m.reachable
    assert (m.block_size, m.num_gpu_blocks, m.served_model) == (None, None, None)
    assert m.active_adapters == frozenset()


def test_llamacpp_mapping_rejects_another_engine_page() -> None:
    with pytest.raises(MissingMetrics, match="no usable llamacpp metrics"):
        _read("llamacpp", "vllm_v1.prom")


def test_wrong_engine_for_the_page_is_rejected() -> None:
    with pytest.raises(MissingMetrics, match="no usable sglang metrics"):
        _read("sglang", "vllm_v1.prom")


def test_html_page_is_rejected() -> None:
    with pytest.raises(MissingMetrics, match="engine type"):
        mapping_for("vllm").read(b"<html><body>Login</body></html>", FRESH, 1.0)


def test_missing_metric_keeps_previous_value_and_says_partial() -> None:
    previous = EndpointMetrics(waiting=9, running=8, kv_cache_usage=0.5, updated_at=1.0)
    page = "vllm:num_requests_waiting 2\nvllm:num_requests_running 3\n"
    m = mapping_for("vllm").read(page, previous, 2.0)
    assert (m.waiting, m.running, m.kv_cache_usage) == (2, 3, 0.5)
    assert m.updated_at == 2.0
    assert m.error is not None
    assert m.error.startswith("partial: KV usage missing")
    assert "vllm:kv_cache_usage_perc or vllm:gpu_cache_usage_perc" in m.error


def test_nan_gauge_keeps_previous_value() -> None:
    previous = EndpointMetrics(waiting=9, running=8, kv_cache_usage=0.5, updated_at=1.0)
    page = (
        "vllm:num_requests_waiting NaN\nvllm:num_requests_running 3\n"
        "vllm:kv_cache_usage_perc +Inf\n"
    )
    m = mapping_for("vllm").read(page, previous, 2.0)
    assert (m.waiting, m.running, m.kv_cache_usage) == (9, 3, 0.5)
    assert m.error is not None
    assert "vllm:num_requests_waiting is not a finite number" in m.error
    assert "vllm:kv_cache_usage_perc is not a finite number" in m.error


def test_all_core_gauges_unusable_rejects_the_page() -> None:
    page = (
        "vllm:num_requests_waiting NaN\nvllm:num_requests_running NaN\n"
        "vllm:kv_cache_usage_perc NaN\n"
    )
    with pytest.raises(MissingMetrics):
        mapping_for("vllm").read(page, FRESH, 1.0)


def test_out_of_range_values_are_clamped() -> None:
    page = (
        "vllm:num_requests_waiting -3\nvllm:num_requests_running 2.6\n"
        "vllm:kv_cache_usage_perc 1.7\n"
    )
    m = mapping_for("vllm").read(page, FRESH, 1.0)
    assert (m.waiting, m.running, m.kv_cache_usage) == (0, 3, 1.0)


def test_truncated_page_raises_parse_error_on_the_cut_line() -> None:
    text = (FIXTURES / "vllm_v1.prom").read_text()
    cut = text.index("vllm:kv_cache_usage_perc{") + len("vllm:kv_cache_usage_perc{engine=")
    with pytest.raises(PromParseError) as info:
        mapping_for("vllm").read(text[:cut], FRESH, 1.0)
    assert info.value.line_no == text[:cut].count("\n") + 1


def test_truncated_before_a_family_is_a_partial_update() -> None:
    text = (FIXTURES / "vllm_v1.prom").read_text()
    cut = text.index("# HELP vllm:kv_cache_usage_perc")
    m = mapping_for("vllm").read(text[:cut], FRESH, 1.0)
    assert (m.waiting, m.running) == (3, 7)
    assert m.error is not None
    assert "KV usage missing" in m.error


def test_lora_all_series_empty_means_no_adapters() -> None:
    page = (
        "vllm:num_requests_waiting 0\n"
        'vllm:lora_requests_info{max_lora="3",running_lora_adapters="",waiting_lora_adapters=""}'
        " 1.7e9\n"
    )
    m = mapping_for("vllm").read(page, FRESH, 1.0)
    assert m.active_adapters == frozenset()
    assert m.waiting_adapters == frozenset()
    assert m.max_adapters == 3


def test_lora_newest_series_by_value_not_by_line_order() -> None:
    page = (
        "vllm:num_requests_waiting 0\n"
        'vllm:lora_requests_info{max_lora="2",running_lora_adapters="new",waiting_lora_adapters=""}'
        " 200\n"
        'vllm:lora_requests_info{max_lora="2",running_lora_adapters="old",waiting_lora_adapters=""}'
        " 100\n"
        'vllm:lora_requests_info{max_lora="2",running_lora_adapters="",'
        'waiting_lora_adapters="w1, w2"} 150\n'
    )
    m = mapping_for("vllm").read(page, FRESH, 1.0)
    assert m.active_adapters == {"new"}
    assert m.waiting_adapters == frozenset()


def test_lora_waiting_only_series_counts_as_non_empty() -> None:
    page = (
        "vllm:num_requests_waiting 0\n"
        'vllm:lora_requests_info{max_lora="2",running_lora_adapters="a",waiting_lora_adapters=""}'
        " 100\n"
        'vllm:lora_requests_info{max_lora="2",running_lora_adapters="",waiting_lora_adapters="w1,,w2"}'
        " 150\n"
    )
    m = mapping_for("vllm").read(page, FRESH, 1.0)
    assert m.active_adapters == frozenset()
    assert m.waiting_adapters == {"w1", "w2"}


def test_lora_bad_max_lora_is_noted() -> None:
    page = (
        "vllm:num_requests_waiting 0\n"
        'vllm:lora_requests_info{max_lora="many",running_lora_adapters="a"} 100\n'
    )
    m = mapping_for("vllm").read(page, FRESH, 1.0)
    assert m.active_adapters == {"a"}
    assert m.max_adapters == 0
    assert m.error is not None
    assert "invalid max_lora 'many'" in m.error


def test_cache_config_none_reads_as_unknown_and_absent_keeps_previous() -> None:
    previous = EndpointMetrics(block_size=16, num_gpu_blocks=100)
    page = 'vllm:num_requests_waiting 0\nvllm:cache_config_info{block_size="None"} 1\n'
    m = mapping_for("vllm").read(page, previous, 1.0)
    assert (m.block_size, m.num_gpu_blocks) == (None, None)
    m = mapping_for("vllm").read("vllm:num_requests_waiting 0\n", previous, 1.0)
    assert (m.block_size, m.num_gpu_blocks) == (16, 100)


@pytest.mark.parametrize(
    ("engine", "fixture", "served"),
    [
        ("vllm", "vllm_v1.prom", "meta-llama/Llama-3.1-8B-Instruct"),
        ("vllm", "vllm_v0.prom", "meta-llama/Llama-2-7b-hf"),
        ("vllm", "vllm_dp.prom", "Qwen/Qwen3-30B-A3B"),  # both engines agree
        ("sglang", "sglang.prom", "meta-llama/Llama-3.1-8B-Instruct"),
        ("trtllm-serve", "trtllm_serve.prom", None),  # labelled, but not read for this engine
        ("triton", "triton_trtllm.prom", None),
    ],
)
def test_served_model_from_the_queue_gauges_model_name(
    engine: str, fixture: str, served: str | None
) -> None:
    assert _read(engine, fixture).served_model == served


@pytest.mark.parametrize(
    ("page", "served"),
    [
        # Waiting gauge first; the running gauge only when waiting is absent.
        ('vllm:num_requests_waiting{model_name="a"} 0\n'
         'vllm:num_requests_running{model_name="b"} 0\n', "a"),
        ('vllm:num_requests_running{model_name="b"} 0\nvllm:kv_cache_usage_perc 0\n', "b"),
        # Two models in one server, a missing label, an empty label: unknown.
        ('vllm:num_requests_waiting{model_name="a",engine="0"} 0\n'
         'vllm:num_requests_waiting{model_name="b",engine="1"} 0\n', None),
        ('vllm:num_requests_waiting{model_name="a",engine="0"} 0\n'
         'vllm:num_requests_waiting{engine="1"} 0\n', None),
        ('vllm:num_requests_waiting{model_name=""} 0\n', None),
        ("vllm:num_requests_waiting 0\n", None),
        # Neither queue gauge on the page (a partial update): the previous value stays.
        ("vllm:kv_cache_usage_perc 0.5\n", "prev"),
    ],
)  # fmt: skip
def test_served_model_rules(page: str, served: str | None) -> None:
    previous = EndpointMetrics(served_model="prev")
    assert mapping_for("vllm").read(page, previous, 1.0).served_model == served


def test_metric_spec_syntax() -> None:
    spec = MetricSpec.parse('nv_trt_llm_request_metrics{request_type=waiting, model="x"}')
    assert spec.family == "nv_trt_llm_request_metrics"
    assert dict(spec.labels) == {"request_type": "waiting", "model": "x"}
    assert str(spec) == "nv_trt_llm_request_metrics{request_type=waiting,model=x}"
    assert MetricSpec.parse("vllm:num_requests_waiting").labels == {}
    with pytest.raises(ValueError, match="invalid metric spec"):
        MetricSpec.parse("bad name{}")
    with pytest.raises(ValueError, match="invalid label filter"):
        MetricSpec.parse("m{novalue}")


def test_engine_lookup_and_aliases() -> None:
    assert set(BUILTIN_MAPPINGS) == {"vllm", "sglang", "trtllm-serve", "triton-trtllm", "llamacpp"}
    assert mapping_for("VLLM").name == "vllm"
    assert mapping_for("triton").name == "triton-trtllm"
    assert mapping_for("trtllm").name == "trtllm-serve"
    assert mapping_for("llama.cpp").name == "llamacpp"
    assert "triton-tensorrt-llm" in known_engines()
    with pytest.raises(ValueError, match="unknown engine type 'tgi'"):
        mapping_for("tgi")


def test_mapping_reads_only_its_families() -> None:
    assert mapping_for("vllm").wanted == {
        "vllm:num_requests_waiting",
        "vllm:num_requests_running",
        "vllm:kv_cache_usage_perc",
        "vllm:gpu_cache_usage_perc",
        "vllm:lora_requests_info",
        "vllm:cache_config_info",
    }
    assert mapping_for("triton-trtllm").wanted == {
        "nv_trt_llm_request_metrics",
        "nv_trt_llm_kv_cache_block_metrics",
    }
