"""Pieces of `bench live` that need no peer: configs, loopback guard, the SSE load generator."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from aiohttp import web

from poolkeeper.api.criticality import Criticality
from poolkeeper.bench.live.live import prefill_count, ratios
from poolkeeper.bench.live.live_processes import process
from poolkeeper.bench.live.live_targets import envoy_rr_bootstrap, poolkeeper_config
from poolkeeper.bench.live.loadgen import check_loopback, run_open_loop
from poolkeeper.bench.results.metrics import RequestOutcome
from poolkeeper.bench.workload.workload_spec import Arrival
from poolkeeper.cli import main as cli
from poolkeeper.errors import ConfigError
from poolkeeper.netutil import free_ports


def test_loopback_only() -> None:
    check_loopback("http://127.0.0.1:8000")
    check_loopback("http://localhost:1")
    with pytest.raises(ConfigError, match=r"only target 127\.0\.0\.1"):
        check_loopback("http://10.0.0.1:8000")


def test_free_consecutive_ports() -> None:
    ports = free_ports(5, consecutive=True)
    assert ports == list(range(ports[0], ports[0] + 5))


def test_poolkeeper_config_validates(tmp_path: Path) -> None:
    ports = dict(zip(("http", "extproc", "metrics", "health", "admin"), free_ports(5), strict=True))
    models = [
        ("chat-critical", "Critical", "base-model"),
        ("adapter-000", "Standard", "adapter-000"),
    ]
    scheduling = {
        "plugins": [
            {"type": "prefix-affinity-filter"},
            {"type": "prefix-cache-scorer"},
            {"type": "max-score-picker"},
        ]
    }
    cfg = poolkeeper_config(tmp_path, [18001, 18002], ports, models, scheduling)
    assert yaml.safe_load((cfg / "gateway.yaml").read_text())["spec"]["scheduling"] == scheduling
    proc = subprocess.run(
        [sys.executable, "-m", "poolkeeper", "validate", str(cfg)],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_envoy_rr_bootstrap_lists_every_server(tmp_path: Path) -> None:
    path = tmp_path / "rr.yaml"
    envoy_rr_bootstrap(path, 18100, 18101, [18001, 18002, 18003])
    doc = yaml.safe_load(path.read_text())
    cluster = doc["static_resources"]["clusters"][0]
    assert cluster["lb_policy"] == "ROUND_ROBIN"
    eps = cluster["load_assignment"]["endpoints"][0]["lb_endpoints"]
    assert [e["endpoint"]["address"]["socket_address"]["port_value"] for e in eps] == [
        18001, 18002, 18003,
    ]  # fmt: skip


def test_ratios_pair_by_round() -> None:
    def run(target: str, rnd: int, p90: float) -> dict[str, object]:
        return {"target": target, "round": rnd, "pair_peer": "x",
                "summary": {"ttft_s": {"p90": p90, "p99": 2 * p90}}}  # fmt: skip

    out = ratios([run("poolkeeper", 0, 1.0), run("x", 0, 2.0), run("x", 1, 4.0),
                  run("poolkeeper", 1, 1.0)], ["x"])  # fmt: skip
    assert out["x"]["pair_ratios"] == [0.5, 0.25]
    assert out["x"]["pooled_ratio"] == pytest.approx(1.0 / 3.0)
    assert out["x"]["pair_ratios_p99"] == [0.5, 0.25]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--warmup", "30", "--duration", "30"], "--warmup must be in"),
        (["--max-num-seqs", "0"], "--max-num-seqs must be >= 1"),
        (["--stream-interval", "0"], "--stream-interval must be >= 1"),
        (["--scheduling", "[1]"], "expected a JSON object"),
        (["--flow-control", '{"enabled": 3}'], "--flow-control: spec.flowControl.enabled"),
        (["--scheduling", "{x"], "not JSON"),
        (["--scheduling", '{"plugins": [{"type": "nope"}]}'], "spec.scheduling"),
    ],
)
def test_live_options_are_checked_before_anything_starts(
    args: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli.main(["bench", "live", *args]) == 2
    assert message in capsys.readouterr().err


async def test_load_generator_measures_first_text_chunk() -> None:
    async def chat(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        if body["model"] == "shed-me":
            return web.json_response({"error": {"message": "shed"}}, status=429)
        resp = web.StreamResponse(headers={"x-sim-server": "sim-7"})
        await resp.prepare(request)
        role = {"choices": [{"delta": {"role": "assistant"}}]}
        await resp.write(f"data: {json.dumps(role)}\n\n".encode())
        await asyncio.sleep(0.2)  # the first token comes well after the role chunk
        for _ in range(body["max_tokens"]):
            await resp.write(
                f"data: {json.dumps({'choices': [{'delta': {'content': 'x'}}]})}\n\n".encode()
            )
        await resp.write(b"data: [DONE]\n\n")
        return resp

    app = web.Application()
    app.router.add_post("/v1/chat/completions", chat)
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_ports(1)[0]
    site = web.TCPSite(runner, "127.0.0.1", port)
    await site.start()
    try:
        arrivals = [
            Arrival("a", 0.0, "m", "m", Criticality.STANDARD, "", "hello", 3),
            Arrival("b", 0.05, "shed-me", "m", Criticality.SHEDDABLE, "", "hi", 3),
        ]
        results = await run_open_loop(f"http://127.0.0.1:{port}", arrivals, time_limit=5)
    finally:
        await runner.cleanup()
    by_id = {r.outcome.request_id: r for r in results}
    a = by_id["a"].outcome
    assert by_id["a"].chunks == 3
    assert a.server == "sim-7"
    assert a.ttft is not None
    assert a.ttft >= 0.19
    assert a.completed
    assert by_id["b"].outcome.shed
    assert by_id["b"].status == 429


def test_a_peer_whose_interpreter_moved_is_a_clear_error(tmp_path: Path) -> None:
    """A venv moved after install: the script is there, the python its `#!` names is not, and
    exec reports the script as missing. A ConfigError naming it, not a traceback."""
    script = tmp_path / "vllm-router"
    script.write_text("#!/nonexistent/venv/bin/python\nprint('hi')\n")
    script.chmod(0o755)
    with (
        pytest.raises(ConfigError, match=r"cannot start .*vllm-router: .*install-peers\.sh"),
        process([str(script)], tmp_path / "peer.log"),
    ):
        pass


def test_prefill_count_is_distinct_group_server_pairs() -> None:
    def outcome(group: str, server: str | None) -> RequestOutcome:
        return RequestOutcome("r", Criticality.STANDARD, 0.0, 10, 1, server=server, group=group)

    routed = [outcome("g0", "sim-0"), outcome("g0", "sim-0"), outcome("g1", "sim-0"),
              outcome("g0", "sim-1"), outcome("g1", None), outcome("", "sim-2")]  # fmt: skip
    # g0 on sim-0 and sim-1 (one re-prefill), g1 on sim-0; unrouted and group-less ignored.
    assert prefill_count(routed) == 3
    assert prefill_count([]) == 0
