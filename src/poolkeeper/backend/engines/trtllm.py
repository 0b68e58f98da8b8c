"""TensorRT-LLM, served two ways: `trtllm-serve` and the Triton TensorRT-LLM backend.

    signal      trtllm-serve                      triton-trtllm
    waiting     trtllm_num_requests_waiting       nv_trt_llm_request_metrics{request_type=waiting}
    running     trtllm_num_requests_running       ... {request_type=scheduled}
    KV 0..1     trtllm_kv_cache_utilization       nv_trt_llm_kv_cache_block_metrics{
                                                      kv_cache_block_type=fraction}
    block size  trtllm_kv_cache_tokens_per_block  ... {kv_cache_block_type=tokens_per}
    GPU blocks  trtllm_kv_cache_max_blocks        ... {kv_cache_block_type=max}

Neither reports LoRA adapters or the served model (both read as none / unknown).
"""

from __future__ import annotations

from typing import Final

from poolkeeper.backend.engines.mapping import (
    EngineMapping,
    EngineType,
    IntField,
    MetricSpec,
    specs,
)

__all__ = ["SERVE", "TRITON"]

_TRITON_KV = "nv_trt_llm_kv_cache_block_metrics"

SERVE: Final = EngineType(
    name="trtllm-serve",
    title="TensorRT-LLM (trtllm-serve)",
    aliases=("trtllm",),
    mapping=EngineMapping(
        name="trtllm-serve",
        waiting=specs("trtllm_num_requests_waiting"),
        running=specs("trtllm_num_requests_running"),
        kv_usage=specs("trtllm_kv_cache_utilization"),
        block_size=IntField(MetricSpec("trtllm_kv_cache_tokens_per_block")),
        num_gpu_blocks=IntField(MetricSpec("trtllm_kv_cache_max_blocks")),
    ),
)

TRITON: Final = EngineType(
    name="triton-trtllm",
    title="Triton TensorRT-LLM backend",
    aliases=("triton", "triton-tensorrt-llm"),
    mapping=EngineMapping(
        name="triton-trtllm",
        waiting=specs("nv_trt_llm_request_metrics{request_type=waiting}"),
        running=specs("nv_trt_llm_request_metrics{request_type=scheduled}"),
        kv_usage=specs(f"{_TRITON_KV}{{kv_cache_block_type=fraction}}"),
        block_size=IntField(MetricSpec.parse(f"{_TRITON_KV}{{kv_cache_block_type=tokens_per}}")),
        num_gpu_blocks=IntField(MetricSpec.parse(f"{_TRITON_KV}{{kv_cache_block_type=max}}")),
    ),
)
