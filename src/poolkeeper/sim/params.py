"""Engine parameters of one simulated model server, with defaults calibrated to a public setup.

Calibration target: Llama-3.1-8B-Instruct in bf16 on vLLM (V1 engine), one H100 80GB SXM.
docs/simulator.md explains every number and where it comes from; in short:

- KV cache: Llama-3.1-8B stores 2 (K,V) x 32 layers x 8 KV heads x 128 dims x 2 bytes = 128 KiB
  per token. With gpu_memory_utilization 0.9, ~72 GB minus 16 GB of weights and a few GB of
  activations leaves ~55 GB, about 440k tokens: 28,000 blocks of 16 tokens.
- Step time (one forward pass of the continuous batch):
      overhead + prefill_token_s * prefill tokens + decode_token_s * decode tokens
               + kv_read_token_s * context tokens attended
  overhead ~6 ms is reading 16 GB of weights at ~3 TB/s plus launch costs; it dominates decode
  at small batch (single-stream inter-token latency ~6-7 ms). 45 us per prefill token gives
  ~20k prompt tokens/s; reading 128 KiB of KV per context token at ~3 TB/s costs ~44 ns.
- Scheduling flags keep vLLM's meaning and (where sensible) its defaults: max_num_seqs 256,
  max_num_batched_tokens 8192 (chunked prefill), block_size 16, max_loras 1.

`time_scale` multiplies every modelled duration: 0.1 makes the server ten times faster, 2.0 twice
as slow. It does not change what is modelled, only the clock.
"""

from __future__ import annotations

from dataclasses import dataclass

DEFAULT_MODEL = "meta-llama/Llama-3.1-8B-Instruct"


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """Everything the pure engine model needs. Durations are in seconds of modelled time."""

    model: str = DEFAULT_MODEL
    lora_adapters: tuple[str, ...] = ()  # adapters registered at start (loadable on demand)
    max_loras: int = 1  # adapters resident on the GPU at once (vLLM --max-loras)
    max_num_seqs: int = 256  # running slots (vLLM --max-num-seqs)
    max_num_batched_tokens: int = 8192  # tokens per step; longer prefills are chunked
    num_gpu_blocks: int = 28_000
    block_size: int = 16
    max_model_len: int = 131_072  # Llama-3.1 context; also capped by the KV cache size
    enable_prefix_caching: bool = True
    # Step-time model (seconds):
    step_overhead_s: float = 0.006
    prefill_token_s: float = 45e-6
    decode_token_s: float = 20e-6
    kv_read_token_s: float = 44e-9
    lora_step_overhead: float = 0.10  # relative slowdown of a step that runs any adapter
    lora_load_s: float = 0.030  # swapping one adapter into a GPU slot (from host memory)
    step_jitter: float = 0.0  # relative std-dev of a Gaussian factor on each step (0 = none)
    # Output length when a request sets no max_tokens: exponential with this mean.
    default_output_tokens: int = 128
    time_scale: float = 1.0
    seed: int = 0
    # Streaming: tokens per SSE event after the first (vLLM/SGLang --stream-interval).
    stream_interval: int = 1

    def __post_init__(self) -> None:
        checks: list[tuple[bool, str]] = [
            (self.max_loras >= 0, "max_loras must be >= 0"),
            (self.max_num_seqs >= 1, "max_num_seqs must be >= 1"),
            (self.max_num_batched_tokens >= 1, "max_num_batched_tokens must be >= 1"),
            (self.num_gpu_blocks >= 1, "num_gpu_blocks must be >= 1"),
            (self.block_size >= 1, "block_size must be >= 1"),
            (self.max_model_len >= 1, "max_model_len must be >= 1"),
            (self.time_scale > 0, "time_scale must be > 0"),
            (self.default_output_tokens >= 1, "default_output_tokens must be >= 1"),
            (self.step_jitter >= 0, "step_jitter must be >= 0"),
            (self.stream_interval >= 1, "stream_interval must be >= 1"),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)

    @property
    def kv_capacity_tokens(self) -> int:
        return self.num_gpu_blocks * self.block_size

    @property
    def effective_max_model_len(self) -> int:
        """Longest sequence (prompt + output) the server accepts: it must fit the KV cache."""
        return min(self.max_model_len, self.kv_capacity_tokens)
