"""A stalled EPP is not a dead one: a FailClose gateway keeps serving across a pause.

Envoy health-checks the EPP (gRPC health, every second) and one failure marks it down; a
FailClose pool then answers 503 "the endpoint picker is unavailable" to every request until a
check passes again. A timeout counts as such a failure, so with a 1 s check timeout any stall
of the EPP's process longer than that (a CPU-starved host, a long GC pause) turned into a
burst of 503s for every client: found as flaky e2e tests on a loaded 2-core machine. A stall
of 2.5 s (SIGSTOP of the `serve` process, whose children Envoy and the simulator run on) must
now leave the gateway serving: requests sent at once after it get 200, and nothing on the
EPP's health was written off. `poolkeeper serve` runs as a subprocess so it can be stopped."""

from __future__ import annotations

import json
import os
import signal
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from tests.support.gateway_files import gateway_ports, one_pool
from tests.support.processes import (
    killing_orphans,
    listening_ports,
    poolkeeper,
    wait_for_text,
    wait_ready,
)

pytestmark = pytest.mark.integration

STALL_S = 2.5  # longer than the old 1 s check timeout, well inside the new one (5 s)


def _status(url: str) -> tuple[int, str]:
    body = json.dumps({"model": "m", "prompt": "hi", "max_tokens": 1}).encode()
    request = urllib.request.Request(url, data=body, headers={"content-type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=60) as reply:
            return reply.status, ""
    except urllib.error.HTTPError as error:
        return error.code, error.read().decode(errors="replace")[:200]


def test_a_stalled_epp_does_not_turn_into_503s(tmp_path: Path) -> None:
    sim = poolkeeper(["sim", "--port", "0", "--model", "m"], tmp_path / "sim.log")
    try:
        (sim_port,) = listening_ports(sim, 1)
        ports = gateway_ports()
        config = one_pool(tmp_path / "cfg", sim_port, ports=ports)  # FailClose
        args = ["serve", "-f", str(config), "--workdir", str(tmp_path / "env")]
        gateway = poolkeeper([*args, "--drain-grace", "0"], tmp_path / "serve.log")
        try:
            wait_for_text(gateway, "gateway ready on")
            wait_ready(ports["health"], gateway)
            with killing_orphans(gateway):
                url = f"http://127.0.0.1:{ports['http']}/v1/completions"
                assert [_status(url)[0] for _ in range(3)] == [200, 200, 200]
                os.kill(gateway.process.pid, signal.SIGSTOP)
                try:
                    time.sleep(STALL_S)  # Envoy's checks of the EPP go unanswered meanwhile
                finally:
                    os.kill(gateway.process.pid, signal.SIGCONT)
                after = [_status(url) for _ in range(3)]
                assert after == [(200, "")] * 3, (after, gateway.log_text()[-2000:])
        finally:
            gateway.stop()
    finally:
        sim.stop()
