"""The upstream EPP's command line (cli/epp_flags.py): pflag's rules, upstream's defaults and
validation, and the older forms charts still render."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from poolkeeper.cli.epp_flag_table import DEPRECATED_METRIC_FLAGS, FLAGS
from poolkeeper.cli.epp_flags import parse_epp_args
from poolkeeper.cli.epp_options import FlagError, effective_refresh_interval, standalone_pool_name
from poolkeeper.config.endpointpicker.values import parse_duration, parse_label_selector, parse_size

DATA = Path(__file__).parent / "data"


@pytest.fixture(autouse=True)
def _env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("NAMESPACE", raising=False)
    monkeypatch.delenv("POD_NAME", raising=False)


def _container(name: str) -> dict[str, Any]:
    data = yaml.safe_load((DATA / name).read_text())
    assert isinstance(data, dict)
    return data


def test_defaults_are_upstreams() -> None:
    options = parse_epp_args(["--pool-name", "p"])
    expected = {
        "grpc-port": 9002,
        "grpc-health-port": 9003,
        "metrics-port": 9090,
        "pool-group": "inference.networking.k8s.io",
        "secure-serving": True,
        "metrics-endpoint-auth": True,
        "tracing": True,
        "enable-pprof": True,
        "ha-enable-leader-election": False,
        "drain-timeout": 30.0,
        "refresh-metrics-interval": 0.05,
        "refresh-prometheus-metrics-interval": 5.0,
        "metrics-staleness-threshold": 2.0,
        "v": 2,
    }
    for name, value in expected.items():
        assert options.values[name] == value, name
    assert options.given == {"pool-name"}
    assert options.pool_namespace == "default"


def test_namespace_falls_back_to_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NAMESPACE", "team-a")
    assert parse_epp_args(["--pool-name=p"]).pool_namespace == "team-a"
    assert parse_epp_args(["--pool-name=p", "--pool-namespace=x"]).pool_namespace == "x"


def test_the_gateway_charts_rendered_arguments_parse(monkeypatch: pytest.MonkeyPatch) -> None:
    container = _container("chart-epp-container-gateway.yaml")
    for env in container["env"]:
        monkeypatch.setenv(env["name"], env["value"])
    options = parse_epp_args(container["args"])
    assert options.text("pool-name") == "qwen"
    assert options.pool_namespace == "llm"
    assert options.text("zap-encoder") == "json"
    assert options.text("config-file") == "/config/default-plugins.yaml"
    assert options.flag("ha-enable-leader-election") is True
    assert options.number("grpc-health-port") == 9003
    assert options.flag("secure-serving") is False
    assert options.flag("tracing") is False
    assert options.flag("metrics-endpoint-auth") is False
    assert options.number("v") == 3
    assert options.warnings == ()
    assert options.ignored_args == ()


def test_the_standalone_charts_rendered_arguments_parse(monkeypatch: pytest.MonkeyPatch) -> None:
    container = _container("chart-epp-container-standalone.yaml")
    for env in container["env"]:
        monkeypatch.setenv(env["name"], env["value"])
    options = parse_epp_args(container["args"])
    assert options.standalone
    assert options.ints("endpoint-target-ports") == (8000, 8001, 8000)
    assert standalone_pool_name("tiny-epp-7c9d8b6f4d-abcde") == "tiny-epp"


def test_the_old_gie_chart_form_parses_with_warnings() -> None:
    options = parse_epp_args(_container("gie-v1-epplib-args.yaml")["args"])
    # `--secure-serving "false"`: what the chart meant, not pflag's silent true.
    assert options.flag("secure-serving") is False
    assert options.text("pool-group") == "inference.networking.x-k8s.io"
    assert options.text("config-file") == "/config/default-plugins.yaml"
    text = "\n".join(options.warnings)
    assert "--model-server-metrics-path was removed upstream" in text
    assert "--model-server-metrics-https-insecure-skip-verify was removed" in text
    assert '--secure-serving "false"' in text


def test_camel_case_gie_v0_flags() -> None:
    options = parse_epp_args(["-poolName", "p", "-grpcPort=9100", "--metricsPort", "9191"])
    assert options.text("pool-name") == "p"
    assert options.number("grpc-port") == 9100
    assert options.number("metrics-port") == 9191
    assert any("GIE v0.x spelling of --pool-name" in w for w in options.warnings)


def test_literal_quotes_are_removed() -> None:
    options = parse_epp_args(['--pool-name="p"', "--config-file", "'/c/x.yaml'"])
    assert options.text("pool-name") == "p"
    assert options.text("config-file") == "/c/x.yaml"


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--pool-name=p", "--kubeconfig=/x"], "unknown flag: --kubeconfig"),
        (["--pool-name=p", "--nope"], "unknown flag: --nope"),
        ([], "either pool-name or endpoint-selector must be set"),
        (["--pool-name=p", "--endpoint-selector=a=b"], "either pool-name or endpoint-selector"),
        (["--pool-name"], "flag needs an argument: --pool-name"),
        (["--pool-name=p", "--grpc-port=70000"], 'for "--grpc-port" flag: value out of range'),
        (["--pool-name=p", "--tracing=maybe"], 'invalid argument "maybe" for "--tracing"'),
        (["--pool-name=p", "--drain-timeout=5"], "time: invalid duration"),
        (
            ["--pool-name=p", "--config-file=a", "--config-text=b"],
            'both the "config-file" and "config-text" flags cannot be set at the same time',
        ),
        (
            ["--pool-name=p", "--metrics-client-ca-file=/ca"],
            '"metrics-client-ca-file" requires "metrics-cert-dir"',
        ),
        (
            ["--pool-name=p", "--metrics-cert-dir=/d", "--metrics-endpoint-auth=false"],
            "enables metrics TLS without authentication",
        ),
        (["--pool-name=p", "--pool-group=example.com"], 'invalid pool-group "example.com"'),
        (["--pool-name=p", "--zap-encoder=xml"], "must be one of json, console"),
        (["--pool-name=p", "--tls-min-version=TLS1.2"], "must be one of VersionTLS10"),
        (["--pool-name=p", "--grpc-max-recv-msg-size=lots"], "invalid grpc-max-recv-msg-size"),
        (
            ["--pool-name=p", "--refresh-prometheus-metrics-interval=0s"],
            "refresh-prometheus-metrics-interval must be positive",
        ),
    ],
)
def test_refused_command_lines(argv: list[str], message: str) -> None:
    with pytest.raises(FlagError) as info:
        parse_epp_args(argv)
    assert message in str(info.value)


@pytest.mark.parametrize("name", DEPRECATED_METRIC_FLAGS)
def test_deprecated_metric_flags_are_rejected_with_upstreams_message(name: str) -> None:
    with pytest.raises(FlagError) as info:
        parse_epp_args(["--pool-name=p", f'--{name}="sglang:num_queue_reqs"'])
    assert str(info.value) == (
        f'flag "{name}" is deprecated and cannot be used; configure metrics via engineConfigs '
        "in EndpointPickerConfig instead"
    )


def test_standalone_mode_validation(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(FlagError, match="length from 1 to 8"):
        parse_epp_args(["--endpoint-selector=app=x"])
    with pytest.raises(FlagError, match="length from 1 to 8"):
        parse_epp_args(["--endpoint-selector=app=x", "--endpoint-target-ports=1,2,3,4,5,6,7,8,9"])
    with pytest.raises(FlagError, match="POD_NAME"):
        parse_epp_args(["--endpoint-selector=app=x", "--endpoint-target-ports=8000"])
    monkeypatch.setenv("POD_NAME", "d-1a-2b")
    with pytest.raises(FlagError, match=re.escape('invalid endpoint-selector "app in (x"')):
        parse_epp_args(["--endpoint-selector=app in (x", "--endpoint-target-ports=8000"])
    # Repeated ports are removed; repeating the flag appends (pflag's IntSlice).
    options = parse_epp_args(
        [
            "--endpoint-selector=app=x",
            "--endpoint-target-ports=8000",
            "--endpoint-target-ports=8001",
        ]
    )
    assert options.ints("endpoint-target-ports") == (8000, 8001)


def test_pflag_details() -> None:
    # A boolean does not take an ordinary next argument; it stays a positional argument.
    options = parse_epp_args(["--pool-name=p", "--tracing", "extra", "-v", "4", "--", "--nope"])
    assert options.flag("tracing") is True
    assert options.ignored_args == ("extra", "--nope")
    assert options.number("v") == 4
    assert parse_epp_args(["--pool-name=p", "-v5"]).number("v") == 5
    # The last value wins.
    assert parse_epp_args(["--pool-name=a", "--pool-name=b"]).text("pool-name") == "b"


def test_refresh_interval_is_clamped_like_upstream() -> None:
    options = parse_epp_args(["--pool-name=p", "--refresh-metrics-interval=10ms"])
    value, warning = effective_refresh_interval(options)
    assert value == 0.05
    assert warning is not None
    assert "clamped" in warning


def test_every_flag_has_a_unique_name() -> None:
    names = [flag.name for flag in FLAGS]
    assert len(names) == len(set(names))


@pytest.mark.parametrize(
    ("text", "seconds"), [("50ms", 0.05), ("1m30s", 90.0), ("0", 0.0), ("1.5h", 5400.0)]
)
def test_go_durations(text: str, seconds: float) -> None:
    assert parse_duration(text) == pytest.approx(seconds)


def test_sizes_and_selectors() -> None:
    assert parse_size("10MiB") == 10 * 2**20
    assert parse_size("25MB") == 25 * 10**6
    assert parse_label_selector("app=vllm,env in (prod,staging),tier!=fe,key,!old") == [
        ("app", "=", ("vllm",)),
        ("env", "in", ("prod", "staging")),
        ("tier", "!=", ("fe",)),
        ("key", "exists", ()),
        ("old", "!", ()),
    ]
