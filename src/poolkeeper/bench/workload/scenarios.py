"""Benchmark scenarios: a workload plus the fleet it runs on.

Every server is the simulator's default engine (`sim.params.EngineConfig`: Llama-3.1-8B on one
H100, vLLM V1 defaults), with only what the scenario needs changed:

- all scenarios: the served base model is named `base-model` (the workloads' model name);
- `multi-lora`: every server can load all of the workload's adapters, with 4 GPU slots
  (`max_loras=4`; vLLM's default is 1, deployments serving tens of adapters raise it a little);
- `heterogeneous`: servers cycle through three speeds, `time_scale` 0.5, 1.0 and 2.0
  (twice as fast, as modelled, twice as slow), standing in for mixed GPU generations.

Nothing else about the engine model is changed here: the benchmarks never tune the simulator.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from poolkeeper.bench.workload.workload_spec import (
    BASE_MODEL,
    WorkloadKind,
    WorkloadSpec,
    default_spec,
)
from poolkeeper.sim.params import EngineConfig

HETEROGENEOUS_SPEEDS: tuple[float, ...] = (0.5, 1.0, 2.0)
LORA_SLOTS = 4


@dataclass(frozen=True, slots=True)
class Scenario:
    """A workload spec and one engine config per server."""

    name: str
    spec: WorkloadSpec
    servers: tuple[EngineConfig, ...]

    def describe(self) -> dict[str, object]:
        distinct: dict[str, int] = {}
        for config in self.servers:
            key = f"time_scale={config.time_scale:g}, max_loras={config.max_loras}"
            distinct[key] = distinct.get(key, 0) + 1
        return {"servers": len(self.servers), "server_kinds": distinct}


def adapter_names(spec: WorkloadSpec) -> tuple[str, ...]:
    return tuple(f"adapter-{k:03d}" for k in range(spec.num_adapters))


def server_configs(spec: WorkloadSpec, servers: int) -> tuple[EngineConfig, ...]:
    base = EngineConfig(model=BASE_MODEL)
    if spec.kind is WorkloadKind.MULTI_LORA:
        base = replace(base, lora_adapters=adapter_names(spec), max_loras=LORA_SLOTS)
    if spec.kind is WorkloadKind.HETEROGENEOUS:
        return tuple(
            replace(base, time_scale=HETEROGENEOUS_SPEEDS[i % len(HETEROGENEOUS_SPEEDS)])
            for i in range(servers)
        )
    return tuple(base for _ in range(servers))


def build_scenario(kind: WorkloadKind | str, servers: int) -> Scenario:
    kind = WorkloadKind(kind)
    spec = default_spec(kind, servers)
    return Scenario(str(kind), spec, server_configs(spec, servers))
