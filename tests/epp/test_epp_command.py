"""`poolkeeper epp` / `poolkeeper-epp` (cli/epp.py): the chart's arguments become Kubernetes
mode with upstream's defaults; what cannot be honoured is said, what is wrong stops the start."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from poolkeeper.cli import epp as epp_cli, epp_setup
from poolkeeper.cli.epp_flags import parse_epp_args
from poolkeeper.cli.main import main as poolkeeper_main
from poolkeeper.config.gateway import UnknownModelPolicy
from poolkeeper.errors import ConfigError
from poolkeeper.extproc.tls_certs import self_signed_pair
from poolkeeper.server.options import ServeOptions
from tests.support.kubeconfig import write_kubeconfig

DATA = Path(__file__).parent / "data"


@pytest.fixture(autouse=True)
def _env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("NAMESPACE", raising=False)
    monkeypatch.delenv("POD_NAME", raising=False)


def _chart_args(tmp_path: Path) -> list[str]:
    container = yaml.safe_load((DATA / "chart-epp-container-gateway.yaml").read_text())
    config = tmp_path / "default-plugins.yaml"
    config.write_text((DATA / "configs" / "chart-default-plugins.yaml").read_text())
    return [a.replace("/config/default-plugins.yaml", str(config)) for a in container["args"]]


def test_chart_arguments_give_upstreams_defaults(tmp_path: Path) -> None:
    config, _ = epp_setup.epp_gateway_config(parse_epp_args(_chart_args(tmp_path)))
    spec = config.spec
    assert (spec.listeners.ext_proc, spec.listeners.health, spec.listeners.metrics) == (
        9002,
        9003,
        9090,
    )
    assert spec.listeners.address == "0.0.0.0"
    assert spec.request_handling.fallback_endpoints == 0
    assert spec.request_handling.unknown_model_policy is UnknownModelPolicy.PASSTHROUGH
    assert len(spec.request_handling.trusted_headers) == 6
    assert spec.scraping.default_engine == "sglang"


def test_no_config_means_upstreams_default_config() -> None:
    config, _ = epp_setup.epp_gateway_config(parse_epp_args(["--pool-name=p"]))
    names = {p.instance_name for p in config.spec.scheduling.plugins}
    assert names == {"queue-scorer", "kv-cache-utilization-scorer", "prefix-cache-scorer",
                     "max-score-picker"}  # fmt: skip


def test_config_text_and_unreadable_file() -> None:
    text = (
        "apiVersion: llm-d.ai/v1alpha1\nkind: EndpointPickerConfig\n"
        "plugins: [{type: random-picker}]"
    )
    config, _ = epp_setup.epp_gateway_config(
        parse_epp_args(["--pool-name=p", f"--config-text={text}"])
    )
    assert [p.type for p in config.spec.scheduling.plugins] == ["random-picker"]
    with pytest.raises(ConfigError, match=r"cannot read /nonexistent/x\.yaml"):
        epp_setup.epp_gateway_config(
            parse_epp_args(["--pool-name=p", "--config-file=/nonexistent/x.yaml"])
        )


def test_ext_proc_tls_follows_upstream_flags() -> None:
    on = epp_setup.epp_tls(parse_epp_args(["--pool-name=p"]))
    assert on.secure_serving is True  # upstream's default: TLS on ext_proc
    assert on.cert_path is None  # self-signed
    off = epp_setup.epp_tls(parse_epp_args(["--pool-name=p", "--secure-serving=false"]))
    assert off.secure_serving is False
    files = epp_setup.epp_tls(
        parse_epp_args(["--pool-name=p", "--cert-path=/certs", "--enable-cert-reload"])
    )
    assert (str(files.cert_path), files.enable_cert_reload) == ("/certs", True)


def test_client_ca_file_asks_for_mutual_tls(tmp_path: Path) -> None:
    ca = tmp_path / "ca.crt"
    ca.write_bytes(self_signed_pair()[0])
    mtls = epp_setup.epp_tls(parse_epp_args(["--pool-name=p", f"--client-ca-file={ca}"]))
    assert mtls.client_ca_file == ca
    assert epp_setup.epp_tls(parse_epp_args(["--pool-name=p"])).client_ca_file is None
    with pytest.raises(ConfigError, match="--client-ca-file needs --secure-serving"):
        epp_setup.epp_tls(
            parse_epp_args(["--pool-name=p", "--secure-serving=false", f"--client-ca-file={ca}"])
        )
    bad = tmp_path / "bad.crt"
    bad.write_text("not a certificate")
    with pytest.raises(ConfigError, match=r"--client-ca-file .*bad\.crt: holds no PEM CA"):
        epp_setup.epp_tls(parse_epp_args(["--pool-name=p", f"--client-ca-file={bad}"]))


def test_unhonoured_flags_are_named() -> None:
    defaults = epp_cli.unhonoured(parse_epp_args(["--pool-name=p"]))
    assert not any(n.startswith("--secure-serving:") for n in defaults)  # TLS is served
    assert not any(n.startswith("--metrics-endpoint-auth:") for n in defaults)  # honoured
    quiet = epp_cli.unhonoured(
        parse_epp_args(
            ["--pool-name=p", "--secure-serving=false", "--metrics-endpoint-auth=false",
             "--tracing=false", "--enable-pprof=false"]
        )
    )  # fmt: skip
    assert quiet == []
    asked = epp_cli.unhonoured(parse_epp_args(["--pool-name=p", "--emit-endpoint-scores"]))
    assert any(n.startswith("--emit-endpoint-scores:") for n in asked)
    # honoured now: leader election (leader-aware readiness) and /metrics authentication
    honoured = parse_epp_args(["--pool-name=p", "--ha-enable-leader-election"])
    assert not any("leader" in n for n in epp_cli.unhonoured(honoured))


def test_bad_flags_exit_2_through_both_entry_points(capsys: pytest.CaptureFixture[str]) -> None:
    assert epp_cli.main(["--pool-name=p", "--bogus"]) == 2
    assert "unknown flag: --bogus" in capsys.readouterr().err
    assert poolkeeper_main(["epp", "--pool-name=p", "--total-queued-requests-metric=x"]) == 2
    assert "is deprecated and cannot be used" in capsys.readouterr().err


def test_the_chart_arguments_reach_the_runtime(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    kubeconfig = write_kubeconfig(tmp_path / "kubeconfig", "http://127.0.0.1:1")
    monkeypatch.setenv("KUBECONFIG", str(kubeconfig))
    seen: list[Any] = []

    def fake_run(options: ServeOptions, loop: str, *, json_logs: bool) -> int:
        seen.append((options, json_logs))
        return 0

    assert (
        epp_cli._run(parse_epp_args([*_chart_args(tmp_path), "--drain-timeout=7s"]), fake_run) == 0
    )
    ((options, json_logs),) = seen
    assert options.run_envoy is False
    assert options.tls.secure_serving is False  # this rendering passes --secure-serving=false
    # upstream's --drain-timeout: ext_proc keeps serving this long after SIGTERM, then drains
    assert options.drain_timeout_s == 7.0
    assert options.ready_once_synced is True  # ready once synced, as upstream
    assert json_logs is True  # zap's default encoder
