"""SIGTERM on the leader, through the real shutdown path: two `poolkeeper serve --kubernetes`
processes against the fake API server; the leader is sent SIGTERM and the follower must hold
the Lease because the leader released it, not because it expired (default timings: 15 s lease,
2 s renew and retry: an expiry takes 13 s or more, a release is taken at the follower's next
retry, within about 2 s; the bound below leaves room for a loaded machine). Meanwhile the
leader, draining, answers readiness NOT_SERVING and keeps ext_proc up for its
`--drain-timeout`, then exits 0.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
from pathlib import Path
from typing import Any

import grpc
import pytest

from poolkeeper.netutil import free_ports
from poolkeeper.telemetry.health import NOT_SERVING, SERVING, check_health
from tests.kube.conftest import NS, model_obj, pod_obj, pool_obj
from tests.kube.fakeapi import FakeApiServer
from tests.support.kubeconfig import write_kubeconfig

pytestmark = pytest.mark.integration

LEASE = ("coordination.k8s.io/v1", "leases", NS, "poolkeeper-epp")


def _holder(fake: FakeApiServer) -> str | None:
    try:
        lease: dict[str, Any] = fake.get(*LEASE)
    except KeyError:
        return None
    return (lease.get("spec") or {}).get("holderIdentity")


async def _serve(
    tmp_path: Path, fake: FakeApiServer, identity: str
) -> tuple[asyncio.subprocess.Process, int, int]:
    ext_proc, metrics, health = free_ports(3)
    gw = tmp_path / f"{identity}.yaml"
    gw.write_text(
        "apiVersion: poolkeeper.dev/v1alpha1\nkind: GatewayConfig\nmetadata: {name: gw}\n"
        f"spec: {{listeners: {{address: 127.0.0.1, extProc: {ext_proc}, metrics: {metrics}, "
        f"health: {health}}}}}\n"
    )
    kubeconfig = write_kubeconfig(tmp_path / "kubeconfig", fake.url, token="t", namespace=NS)
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "poolkeeper", "serve", "--kubernetes",
        "--kubeconfig", str(kubeconfig), "-f", str(gw), "--identity", identity,
        "--drain-timeout", "3", "--drain-grace", "1", "--event-loop", "asyncio",
        stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )  # fmt: skip
    return process, ext_proc, health


async def _poll(check: Any, what: str, *, limit: int = 1200) -> None:
    for _ in range(limit):
        if await check() if asyncio.iscoroutinefunction(check) else check():
            return
        await asyncio.sleep(0.025)
    raise AssertionError(f"timed out waiting for {what}")


async def test_sigterm_on_the_leader_hands_the_lease_over_before_the_lease_expires(
    fake: FakeApiServer, tmp_path: Path
) -> None:
    fake.put(pool_obj(), "inferencepools")
    fake.put(model_obj("m", "m"), "inferencemodels")
    fake.put(pod_obj("p0", "10.0.0.1"), "pods")
    leader, _, leader_health = await _serve(tmp_path, fake, "epp-a")
    follower: asyncio.subprocess.Process | None = None
    try:
        await _poll(lambda: _holder(fake) == "epp-a", "epp-a to take the Lease")
        follower, _, follower_health = await _serve(tmp_path, fake, "epp-b")

        async def follower_ready() -> bool:
            try:
                answer = await check_health(f"127.0.0.1:{follower_health}", "readiness")
            except grpc.aio.AioRpcError:  # not listening yet
                return False
            return bool(answer == SERVING)

        await _poll(follower_ready, "the follower to be ready")
        assert _holder(fake) == "epp-a"
        leader.send_signal(signal.SIGTERM)
        loop = asyncio.get_running_loop()
        sent = loop.time()
        await _poll(lambda: _holder(fake) == "epp-b", "epp-b to hold the Lease", limit=480)
        handover = loop.time() - sent
        # Not a timing check: anything under the 13 s an expiry needs shows the release path.
        assert handover < 10.0, f"handover took {handover:.1f}s (an expiry, not a release?)"
        # Still draining (--drain-timeout 3): health answers, NOT_SERVING.
        if leader.returncode is None:
            status = await check_health(f"127.0.0.1:{leader_health}", "readiness")
            assert status == NOT_SERVING or leader.returncode is not None
        assert await asyncio.wait_for(leader.wait(), 30) == 0
        assert leader.stderr is not None
        log = (await leader.stderr.read()).decode()
        assert "epp-a released the Lease poolkeeper-epp" in log
        # JSON logs stay JSON: the "ready" line is a log record, not a plain print.
        (ready,) = [line for line in log.splitlines() if "endpoint picker ready" in line]
        assert json.loads(ready)["level"] == "info"
    finally:
        for process in (leader, follower):
            if process is not None and process.returncode is None:
                process.kill()
                await process.wait()
