"""vLLM: the default engine (`vllm serve`).

signal      family
waiting     vllm:num_requests_waiting
running     vllm:num_requests_running
KV 0..1     vllm:kv_cache_usage_perc, else vllm:gpu_cache_usage_perc (before V1)
LoRA        vllm:lora_requests_info (see the LoRA rule in mapping.py)
block size  vllm:cache_config_info{block_size}
GPU blocks  vllm:cache_config_info{num_gpu_blocks}
base model  model_name label of waiting/running
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

__all__ = ["ENGINE"]

_CACHE = MetricSpec("vllm:cache_config_info")

ENGINE: Final = EngineType(
    name="vllm",
    title="vLLM",
    mapping=EngineMapping(
        name="vllm",
        waiting=specs("vllm:num_requests_waiting"),
        running=specs("vllm:num_requests_running"),
        kv_usage=specs("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"),
        lora_info=MetricSpec("vllm:lora_requests_info"),
        block_size=IntField(_CACHE, "block_size"),
        num_gpu_blocks=IntField(_CACHE, "num_gpu_blocks"),
        served_model_label="model_name",
    ),
)
