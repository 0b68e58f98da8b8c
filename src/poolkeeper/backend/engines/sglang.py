"""SGLang (`python -m sglang.launch_server`).

signal      family
waiting     sglang:num_queue_reqs
running     sglang:num_running_reqs
KV 0..1     sglang:token_usage
LoRA        -
block size  sglang:cache_config_info{page_size}
GPU blocks  sglang:cache_config_info{num_pages}
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

_CACHE = MetricSpec("sglang:cache_config_info")

ENGINE: Final = EngineType(
    name="sglang",
    title="SGLang",
    mapping=EngineMapping(
        name="sglang",
        waiting=specs("sglang:num_queue_reqs"),
        running=specs("sglang:num_running_reqs"),
        kv_usage=specs("sglang:token_usage"),
        block_size=IntField(_CACHE, "page_size"),
        num_gpu_blocks=IntField(_CACHE, "num_pages"),
        served_model_label="model_name",
    ),
)
