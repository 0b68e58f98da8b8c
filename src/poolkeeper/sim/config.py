"""Simulator configuration: per-server settings, the --config YAML file, and fleet assembly.

File format (YAML). Either a list of servers, or a mapping with optional `defaults` (applied to
every server) and `servers` (one entry per server; `count: N` repeats an entry N times):

    defaults:
      model: meta-llama/Llama-3.1-8B-Instruct
      lora_adapters: [sql-lora, chat-lora]
    servers:
      - name: big
        num_gpu_blocks: 40000
      - count: 3
        max_num_seqs: 64
        faults: {error_rate: 0.05, error_status: 503}

Precedence, lowest first: built-in defaults, the file's `defaults`, command-line flags, each
server's own entry. Without `servers`, the fleet is `--count` identical servers.
Errors name the file and the field path (`fleet.yaml: servers[1].max_num_seqs: ...`).
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from poolkeeper.errors import ConfigError
from poolkeeper.sim.faults import FaultConfig
from poolkeeper.sim.params import EngineConfig


class FaultSettings(BaseModel):
    model_config = ConfigDict(extra="forbid")

    error_rate: float = Field(default=0.0, ge=0.0, le=1.0)
    error_status: int = Field(default=503, ge=400, le=599)
    latency_s: float = Field(default=0.0, ge=0.0)
    latency_spike_rate: float = Field(default=0.0, ge=0.0, le=1.0)
    latency_spike_s: float = Field(default=1.0, ge=0.0)
    stall_s: float = Field(default=0.0, ge=0.0)
    cut_after: int | None = Field(default=None, ge=0)
    metrics: Literal["ok", "garbage", "slow"] = "ok"
    metrics_delay_s: float = Field(default=2.0, ge=0.0)
    cut_rate: float = Field(default=0.0, ge=0.0, le=1.0)
    header_faults: bool = False

    def to_fault_config(self) -> FaultConfig:
        return FaultConfig(**self.model_dump())


class ServerSettings(BaseModel):
    """Settings of one server; every field is optional (unset = inherit)."""

    model_config = ConfigDict(extra="forbid")

    name: str | None = Field(default=None, min_length=1)
    count: int | None = Field(default=None, ge=1, le=10_000)
    model: str | None = Field(default=None, min_length=1)
    lora_adapters: list[str] | None = None
    max_loras: int | None = Field(default=None, ge=0)
    max_num_seqs: int | None = Field(default=None, ge=1)
    max_num_batched_tokens: int | None = Field(default=None, ge=1)
    num_gpu_blocks: int | None = Field(default=None, ge=1)
    block_size: int | None = Field(default=None, ge=1)
    max_model_len: int | None = Field(default=None, ge=1)
    enable_prefix_caching: bool | None = None
    step_overhead_s: float | None = Field(default=None, ge=0.0)
    prefill_token_s: float | None = Field(default=None, ge=0.0)
    decode_token_s: float | None = Field(default=None, ge=0.0)
    kv_read_token_s: float | None = Field(default=None, ge=0.0)
    lora_step_overhead: float | None = Field(default=None, ge=0.0)
    lora_load_s: float | None = Field(default=None, ge=0.0)
    step_jitter: float | None = Field(default=None, ge=0.0, le=1.0)
    default_output_tokens: int | None = Field(default=None, ge=1)
    time_scale: float | None = Field(default=None, gt=0.0)
    seed: int | None = None
    stream_interval: int | None = Field(default=None, ge=1)
    faults: FaultSettings | None = None

    def overrides(self) -> dict[str, Any]:
        return {
            k: v for k, v in self.model_dump(exclude={"name", "count", "faults"}).items()
            if v is not None
        }  # fmt: skip


class FleetFile(BaseModel):
    model_config = ConfigDict(extra="forbid")

    defaults: ServerSettings = Field(default_factory=lambda: ServerSettings())
    servers: list[ServerSettings] | None = None


@dataclass(frozen=True, slots=True)
class ServerSpec:
    """One server of the fleet, ready to build."""

    name: str
    engine: EngineConfig
    faults: FaultConfig


_ENGINE_FIELDS = {f.name for f in fields(EngineConfig)}


def _format_error(source: str, exc: ValidationError) -> str:
    problems = []
    for err in exc.errors():
        path = ""
        for part in err["loc"]:
            path += f"[{part}]" if isinstance(part, int) else (f".{part}" if path else str(part))
        problems.append(f"{source}: {path or '(top level)'}: {err['msg']}")
    return "\n".join(problems)


def parse_fleet_file(data: Any, source: str = "<config>") -> FleetFile:
    """Validate already-loaded YAML data; raises ConfigError with field paths."""
    if data is None:
        data = {}
    if isinstance(data, list):
        data = {"servers": data}
    try:
        return FleetFile.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(_format_error(source, exc)) from None


def load_fleet_file(path: str | Path) -> FleetFile:
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read: {exc.strerror or exc}") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: not valid YAML: {exc}") from None
    return parse_fleet_file(data, str(path))


def build_fleet(
    *,
    count: int | None = None,
    cli: ServerSettings | None = None,
    file: FleetFile | None = None,
    name_prefix: str = "sim",
) -> list[ServerSpec]:
    """Assemble the servers: built-in < file defaults < CLI < per-server entries."""
    file = file or FleetFile()
    cli = cli or ServerSettings()
    base: dict[str, Any] = {**file.defaults.overrides(), **cli.overrides()}
    base_faults = file.defaults.faults or FaultSettings()
    if cli.faults is not None:  # what the command line set, over the file's defaults
        base_faults = base_faults.model_copy(update=cli.faults.model_dump(exclude_unset=True))
    # --fault-headers holds for every server, whatever faults its own entry lists.
    header_faults = cli.faults is not None and cli.faults.header_faults
    entries: list[ServerSettings] = []
    if file.servers is not None:
        for entry in file.servers:
            entries.extend([entry] * (entry.count or 1))
        if count is not None and count != len(entries):
            raise ConfigError(
                f"--count {count} disagrees with the config file, which lists {len(entries)} "
                "servers (drop --count or make them agree)"
            )
    else:
        entries = [ServerSettings()] * (count if count is not None else 1)
    specs: list[ServerSpec] = []
    seen: set[str] = set()
    base_seed = int(base.get("seed", 0))
    for index, entry in enumerate(entries):
        values = {**base, **entry.overrides()}
        if entry.seed is None:
            values["seed"] = base_seed + index  # servers differ in their random draws
        if "lora_adapters" in values:
            values["lora_adapters"] = tuple(values["lora_adapters"])
        name = entry.name if entry.name and (entry.count or 1) == 1 else None
        name = name or f"{entry.name or name_prefix}-{index}"
        if name in seen:
            raise ConfigError(f"server name {name!r} is used twice")
        seen.add(name)
        unknown = set(values) - _ENGINE_FIELDS
        if unknown:  # pragma: no cover - the pydantic model and EngineConfig share fields
            raise ConfigError(f"unknown engine settings: {sorted(unknown)}")
        try:
            engine = EngineConfig(**values)
        except ValueError as exc:
            raise ConfigError(f"server {name}: {exc}") from None
        settings = entry.faults or base_faults
        if header_faults:
            settings = settings.model_copy(update={"header_faults": True})
        faults = settings.to_fault_config()
        specs.append(ServerSpec(name, engine, faults))
    return specs
