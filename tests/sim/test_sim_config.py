"""Fleet configuration: precedence, heterogeneous fleets, precise errors."""

from __future__ import annotations

from pathlib import Path

import pytest

from poolkeeper.errors import ConfigError
from poolkeeper.sim.config import ServerSettings, build_fleet, load_fleet_file, parse_fleet_file


def test_count_identical_servers_get_distinct_names_and_seeds() -> None:
    specs = build_fleet(count=3, cli=ServerSettings(max_num_seqs=8, seed=10))
    assert [s.name for s in specs] == ["sim-0", "sim-1", "sim-2"]
    assert [s.engine.seed for s in specs] == [10, 11, 12]
    assert all(s.engine.max_num_seqs == 8 for s in specs)


def test_file_defaults_cli_and_entries_in_precedence_order(tmp_path: Path) -> None:
    path = tmp_path / "fleet.yaml"
    path.write_text(
        "defaults: {max_num_seqs: 4, num_gpu_blocks: 100, lora_adapters: [x]}\n"
        "servers:\n"
        "  - name: big\n"
        "    num_gpu_blocks: 5000\n"
        "  - count: 2\n"
        "    max_loras: 3\n"
        "    faults: {error_rate: 0.5}\n"
    )
    specs = build_fleet(cli=ServerSettings(max_num_seqs=16), file=load_fleet_file(path))
    assert [s.name for s in specs] == ["big", "sim-1", "sim-2"]
    assert [s.engine.max_num_seqs for s in specs] == [16, 16, 16]  # CLI beats file defaults
    assert [s.engine.num_gpu_blocks for s in specs] == [5000, 100, 100]
    assert [s.engine.max_loras for s in specs] == [1, 3, 3]
    assert specs[1].engine.lora_adapters == ("x",)
    assert specs[1].faults.error_rate == 0.5
    assert specs[0].faults.error_rate == 0.0


def test_a_plain_list_is_a_list_of_servers() -> None:
    specs = build_fleet(file=parse_fleet_file([{"name": "a"}, {"name": "b", "time_scale": 0.1}]))
    assert [(s.name, s.engine.time_scale) for s in specs] == [("a", 1.0), ("b", 0.1)]


def test_errors_name_the_file_and_field(tmp_path: Path) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text("servers:\n  - name: a\n  - max_num_seq: 3\n")
    with pytest.raises(ConfigError, match=r"bad\.yaml: servers\[1\]\.max_num_seq: Extra inputs"):
        load_fleet_file(path)
    path.write_text("servers:\n  - max_num_seqs: 0\n")
    with pytest.raises(ConfigError, match=r"servers\[0\]\.max_num_seqs: Input should be greater"):
        load_fleet_file(path)
    path.write_text("servers: [unclosed\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_fleet_file(path)
    with pytest.raises(ConfigError, match="cannot read"):
        load_fleet_file(tmp_path / "missing.yaml")


def test_count_must_agree_with_listed_servers_and_names_be_unique() -> None:
    file = parse_fleet_file({"servers": [{"name": "a"}, {"name": "b"}]})
    with pytest.raises(ConfigError, match="--count 3 disagrees"):
        build_fleet(count=3, file=file)
    with pytest.raises(ConfigError, match="used twice"):
        build_fleet(file=parse_fleet_file([{"name": "a"}, {"name": "a"}]))
