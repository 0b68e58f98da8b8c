"""Body-based routing with the real Envoy and the official openai client (upstream
`test/integration/bbr/hermetic_test.go` and `config/manifests/bbr-example/httproute_bbr.yaml`):
BBR copies the body's model into `x-gateway-model-name`, Envoy routes on it to the pool's own
EPP and model servers, a client's copy of the header steers nothing."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import grpc
import openai
import pytest

from poolkeeper.cli import main as cli
from poolkeeper.envoy.bbr import BbrParams, PoolRoute, build_bbr_bootstrap, epp_cluster, render
from poolkeeper.envoy.bootstrap import BootstrapParams
from poolkeeper.envoy.params import EXT_PROC_SERVICE
from poolkeeper.envoy.process import find_envoy
from poolkeeper.extproc.bbr import BbrServicer
from poolkeeper.extproc.server import ExtProcServicer, build_server
from poolkeeper.netutil import free_port
from poolkeeper.telemetry.health import SERVING, check_health
from tests.envoy.envoy_harness import Backend, RoundRobinRouter, supervised_envoy

pytestmark = pytest.mark.integration
POOL = "default/vllm-llama3-8b-instruct"


@dataclass
class Rig:
    url: str
    backends: dict[str, Backend]
    routers: dict[str, RoundRobinRouter]
    bbr: BbrServicer


@asynccontextmanager
async def rig(tmp_path: Path) -> AsyncIterator[Rig]:
    """Two pools, each with its own EPP (fake router) and one model server; BBR in front."""
    backends = {"llama": Backend("llama-server"), "phi": Backend("phi-server")}
    servers: list[grpc.aio.Server] = []
    routers: dict[str, RoundRobinRouter] = {}
    pools: list[PoolRoute] = []
    try:
        for name, backend in backends.items():
            await backend.start()
            routers[name] = RoundRobinRouter([backend])
            server, port = build_server(ExtProcServicer(routers[name]), "127.0.0.1:0")
            await server.start()
            servers.append(server)
            pools.append(
                PoolRoute(f"default/{name}-pool", (name,), f"127.0.0.1:{port}", (backend.hostport,))
            )
        bbr = BbrServicer()
        bbr_server, bbr_port = build_server(bbr, "127.0.0.1:0")
        await bbr_server.start()
        servers.append(bbr_server)
        base = BootstrapParams(listen_port=free_port(), admin_port=free_port())
        config = tmp_path / "envoy-bbr.json"
        config.write_text(
            render(build_bbr_bootstrap(BbrParams(base, f"127.0.0.1:{bbr_port}", tuple(pools))))
        )
        async with supervised_envoy(config, base.admin_port):
            yield Rig(f"http://127.0.0.1:{base.listen_port}", backends, routers, bbr)
    finally:
        for server in servers:
            await server.stop(None)
        for backend in backends.values():
            await backend.stop()


def _client(url: str, **kw: Any) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(
        base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=30, **kw
    )


async def test_models_go_to_their_own_pool(tmp_path: Path) -> None:
    async with rig(tmp_path) as r:
        client = _client(r.url)
        try:
            for model in ("llama", "phi", "llama"):
                raw = await client.chat.completions.with_raw_response.create(
                    model=model, messages=[{"role": "user", "content": "hi"}]
                )
                assert json.loads(raw.http_response.content)["served_by"] == f"{model}-server"
        finally:
            await client.close()
        assert [s["body"]["model"] for s in r.backends["llama"].seen] == ["llama", "llama"]
        assert [s["body"]["model"] for s in r.backends["phi"].seen] == ["phi"]
        # Each pool's EPP saw only its own model's requests.
        assert (r.routers["llama"].turn, r.routers["phi"].turn) == (2, 1)
        seen = r.backends["phi"].seen[0]["headers"]
        assert seen.get("x-gateway-model-name") == "phi"  # the header routes travel upstream


async def test_streaming_through_bbr(tmp_path: Path) -> None:
    async with rig(tmp_path) as r:
        client = _client(r.url)
        try:
            stream = await client.chat.completions.create(
                model="phi", messages=[{"role": "user", "content": "hi"}], stream=True
            )
            words = [c.choices[0].delta.content async for c in stream if c.choices]
        finally:
            await client.close()
        assert words == ["hello", "world"]
        assert len(r.backends["phi"].seen) == 1


async def test_client_model_header_steers_nothing(tmp_path: Path) -> None:
    async with rig(tmp_path) as r:
        client = _client(r.url, default_headers={"X-Gateway-Model-Name": "phi"})
        try:
            raw = await client.chat.completions.with_raw_response.create(
                model="llama", messages=[{"role": "user", "content": "hi"}]
            )
            assert json.loads(raw.http_response.content)["served_by"] == "llama-server"
            with pytest.raises(openai.NotFoundError) as info:  # no pool serves it
                await client.chat.completions.create(
                    model="mistral", messages=[{"role": "user", "content": "hi"}]
                )
            assert info.value.body is not None
        finally:
            await client.close()
        assert r.backends["phi"].seen == []
        assert (r.routers["llama"].turn, r.routers["phi"].turn) == (1, 0)


async def test_body_without_model_is_not_routed_by_a_client_header(tmp_path: Path) -> None:
    async with rig(tmp_path) as r, aiohttp.ClientSession() as session:
        # No model in the body: BBR removes the client's header, the first pool's EPP answers.
        async with session.post(
            f"{r.url}/v1/chat/completions",
            data=b'{"messages": []}',
            headers={"content-type": "application/json", "x-gateway-model-name": "phi"},
        ) as resp:
            await resp.read()
        assert r.backends["phi"].seen == []
        assert r.routers["llama"].turn == 1


def test_bbr_envoy_config_from_the_examples(tmp_path: Path) -> None:
    """`poolkeeper bbr-envoy-config`: one route per served model name (InferenceModel and
    InferenceModelRewrite alike), the pool's EPP overridable, and the real Envoy accepts it."""
    out = tmp_path / "bbr.json"
    examples = str(Path(__file__).parents[2] / "examples")
    assert (
        cli.main(
            ["bbr-envoy-config", "-f", examples, "--epp", POOL + "=10.1.2.3:9002", "-o", str(out)]
        )
        == 0
    )
    bootstrap = json.loads(out.read_text())
    hcm = bootstrap["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]
    config = hcm["typed_config"]
    assert [f["name"] for f in config["http_filters"]] == [
        "bbr",
        "epp",
        "envoy.filters.http.router",
    ]
    routes = config["route_config"]["virtual_hosts"][0]["routes"]
    matched = [
        r["match"]["headers"][0]["string_match"]["exact"]
        for r in routes
        if "string_match" in r["match"].get("headers", [{}])[0]
    ]
    assert matched == [
        "food-review",
        "meta-llama/Llama-3.1-8B-Instruct",
        "tweet-summary",
        "tweet-summary-latest",  # an InferenceModelRewrite exact match
    ]
    clusters = {c["name"]: c for c in bootstrap["static_resources"]["clusters"]}
    epp = clusters[epp_cluster(POOL)]["load_assignment"]["endpoints"][0]["lb_endpoints"][0]
    assert epp["endpoint"]["address"]["socket_address"] == {
        "address": "10.1.2.3",
        "port_value": 9002,
    }
    assert routes[-1]["direct_response"]["status"] == 404
    check = subprocess.run(
        [find_envoy(), "--mode", "validate", "-c", str(out)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert check.returncode == 0, check.stdout[-2000:] + check.stderr[-2000:]


def test_bbr_envoy_config_errors_are_precise(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    examples = str(Path(__file__).parents[2] / "examples")
    assert cli.main(["bbr-envoy-config", "-f", examples, "--epp", "default/nope=1.2.3.4:1"]) == 2
    assert "--epp names pools that are not loaded: default/nope" in capsys.readouterr().err
    assert cli.main(["bbr-envoy-config", "-f", examples, "--bbr", "no-port"]) == 2
    assert "--bbr: expected HOST:PORT, got 'no-port'" in capsys.readouterr().err


async def test_poolkeeper_bbr_command_serves_health_and_ext_proc() -> None:
    port = free_port()
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "poolkeeper",
        "bbr",
        "--port",
        str(port),
        stderr=asyncio.subprocess.PIPE,
    )
    try:
        assert proc.stderr is not None
        line = await asyncio.wait_for(proc.stderr.readline(), timeout=30)
        assert f"poolkeeper bbr ready on 127.0.0.1:{port}" in line.decode()
        assert await check_health(f"127.0.0.1:{port}", EXT_PROC_SERVICE) == SERVING
    finally:
        proc.terminate()
        await asyncio.wait_for(proc.wait(), timeout=30)
