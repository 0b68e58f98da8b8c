"""Prometheus text exposition (format 0.0.4) of one simulated server, with vLLM's names.

Written by hand rather than through prometheus_client's registry: the families are few, the
values come straight from EngineStats/EngineCounters, and vllm:lora_requests_info needs vLLM's
quirk of keeping one series per label combination ever seen, whose value is a timestamp.
"""

from __future__ import annotations

from collections import OrderedDict

from poolkeeper.sim.stats import EngineCounters, EngineStats, Histogram

_LORA_HISTORY = 16  # label combinations kept (vLLM keeps all; bounded here)


class LoraInfoSeries:
    """The series of vllm:lora_requests_info seen so far (label tuple -> last timestamp)."""

    __slots__ = ("_series",)

    def __init__(self) -> None:
        self._series: OrderedDict[tuple[str, str, str], float] = OrderedDict()

    def record(self, stats: EngineStats, timestamp: float) -> None:
        key = (
            str(stats.max_loras),
            ",".join(stats.running_adapters),
            ",".join(stats.waiting_adapters),
        )
        self._series[key] = timestamp
        self._series.move_to_end(key)
        while len(self._series) > _LORA_HISTORY:
            self._series.popitem(last=False)

    def lines(self) -> list[str]:
        out = []
        for (max_lora, running, waiting), value in self._series.items():
            out.append(
                "vllm:lora_requests_info{"
                f'max_lora="{max_lora}",running_lora_adapters="{running}",'
                f'waiting_lora_adapters="{waiting}"}} {value!r}'
            )
        return out


def _family(out: list[str], name: str, kind: str, help_text: str) -> None:
    out.append(f"# HELP {name} {help_text}")
    out.append(f"# TYPE {name} {kind}")


def _histogram(out: list[str], name: str, labels: str, hist: Histogram) -> None:
    for le, count in hist.cumulative():
        out.append(f'{name}_bucket{{le="{le}",{labels}}} {float(count)!r}')
    out.append(f"{name}_count{{{labels}}} {float(hist.count)!r}")
    out.append(f"{name}_sum{{{labels}}} {float(hist.sum)!r}")


def render_metrics(
    *,
    model: str,
    stats: EngineStats,
    counters: EngineCounters,
    lora_series: LoraInfoSeries,
    enable_prefix_caching: bool,
) -> str:
    """The whole /metrics body."""
    labels = f'model_name="{model}"'
    out: list[str] = []
    gauges = (
        ("vllm:num_requests_running", "Number of requests in model execution batches.",
         stats.running),
        ("vllm:num_requests_waiting", "Number of requests waiting to be processed.",
         stats.waiting),
        ("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.",
         stats.kv_cache_usage),
        ("vllm:gpu_cache_usage_perc", "GPU KV-cache usage (older name). 1 means 100 percent.",
         stats.kv_cache_usage),
    )  # fmt: skip
    for name, help_text, value in gauges:
        _family(out, name, "gauge", help_text)
        out.append(f"{name}{{{labels}}} {float(value)!r}")
    name = "vllm:num_requests_waiting_by_reason"
    _family(out, name, "gauge", "Waiting requests by reason (deferred = waiting for a LoRA slot).")
    deferred = stats.waiting_deferred
    out.append(f'{name}{{{labels},reason="capacity"}} {float(stats.waiting - deferred)!r}')
    out.append(f'{name}{{{labels},reason="deferred"}} {float(deferred)!r}')
    _family(out, "vllm:lora_requests_info", "gauge", "Running stats on lora requests.")
    out.extend(lora_series.lines())
    _family(out, "vllm:cache_config_info", "gauge", "Information of the LLMEngine CacheConfig.")
    out.append(
        f'vllm:cache_config_info{{block_size="{stats.block_size}",'
        f'enable_prefix_caching="{enable_prefix_caching}",'
        f'num_gpu_blocks="{stats.num_gpu_blocks}"}} 1.0'
    )
    totals = (
        ("vllm:prefix_cache_queries", "Prefix cache queries, in tokens.", counters.prefix_queries),
        ("vllm:prefix_cache_hits", "Prefix cache hits, in tokens.", counters.prefix_hits),
        ("vllm:prompt_tokens", "Number of prefill tokens processed.", counters.prompt_tokens),
        ("vllm:generation_tokens", "Number of generation tokens processed.",
         counters.generation_tokens),
        ("vllm:num_preemptions", "Cumulative number of preemptions.", counters.preemptions),
    )  # fmt: skip
    for name, help_text, value in totals:
        _family(out, f"{name}_total", "counter", help_text)
        out.append(f"{name}_total{{{labels}}} {float(value)!r}")
    name = "vllm:request_success_total"
    _family(out, name, "counter", "Count of successfully processed requests.")
    for reason in ("length", "stop"):
        value = float(counters.finished.get(reason, 0))
        out.append(f'{name}{{finished_reason="{reason}",{labels}}} {value!r}')
    histograms = (
        ("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.",
         counters.ttft),
        ("vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.",
         counters.itl),
        ("vllm:time_per_output_token_seconds", "Histogram of time per output token (older name).",
         counters.itl),
        ("vllm:e2e_request_latency_seconds", "Histogram of end to end request latency in seconds.",
         counters.e2e),
    )  # fmt: skip
    for name, help_text, hist in histograms:
        _family(out, name, "histogram", help_text)
        _histogram(out, name, labels, hist)
    return "\n".join(out) + "\n"
