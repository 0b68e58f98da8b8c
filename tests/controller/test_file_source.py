"""FileResourceSource: load files into the datastore, hot reload, keep the last good state."""

from __future__ import annotations

import asyncio
import logging
import os
from contextlib import suppress
from datetime import UTC, datetime
from pathlib import Path

import pytest

from poolkeeper.backend.config import ScrapingConfig
from poolkeeper.backend.scraper_manager import ScraperManager
from poolkeeper.controller.files import FileResourceSource
from poolkeeper.controller.resource_files import fingerprint
from poolkeeper.datastore import Datastore
from poolkeeper.sim.cluster import SimCluster
from poolkeeper.sim.config import build_fleet

POOL = """\
apiVersion: inference.networking.x-k8s.io/v1alpha2
kind: InferencePool
metadata: {name: llama}
spec:
  selector: {app: llama}
  targetPortNumber: 8000
  extensionRef: {name: epp}
"""

MODELS = """\
apiVersion: inference.networking.x-k8s.io/v1alpha2
kind: InferenceModel
metadata: {name: chat, creationTimestamp: "2025-01-01T00:00:00Z"}
spec: {modelName: llama-chat, criticality: Critical, poolRef: {name: llama}}
---
apiVersion: inference.networking.x-k8s.io/v1alpha2
kind: InferenceModel
metadata: {name: chat-copy, creationTimestamp: "2025-06-01T00:00:00Z"}
spec: {modelName: llama-chat, poolRef: {name: llama}}
"""

GATEWAY = """\
apiVersion: poolkeeper.dev/v1alpha1
kind: GatewayConfig
metadata: {name: default}
spec:
  endpoints:
    - {name: sim-0, address: 127.0.0.1, port: 8001, labels: {app: llama}}
    - {name: sim-1, address: 127.0.0.2, labels: {app: llama}, engine: sglang}
    - name: sim-2
      address: 127.0.0.3
      labels: {app: llama, inference.networking.k8s.io/engine-type: triton-trtllm}
"""

NOW = datetime(2026, 1, 1, tzinfo=UTC)


def write(path: Path, text: str) -> None:
    path.write_text(text)
    # Make the change visible even on filesystems with coarse timestamps.
    stat = path.stat()
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000_000))


@pytest.fixture
def files(tmp_path: Path) -> Path:
    write(tmp_path / "pool.yaml", POOL)
    write(tmp_path / "models.yaml", MODELS)
    write(tmp_path / "gateway.yaml", GATEWAY)
    return tmp_path


def make_source(path: Path, store: Datastore) -> FileResourceSource:
    return FileResourceSource([path], store, interval=0.05, now=lambda: NOW)


def test_initial_load_fills_the_datastore(files: Path) -> None:
    store = Datastore()
    source = make_source(files, store)
    outcome = source.reload()
    assert outcome.applied
    assert (outcome.pools, outcome.models, outcome.endpoints) == (1, 2, 3)
    snap = store.snapshot()
    assert snap.pool_keys() == ("default/llama",)
    assert snap.models("default/llama")["llama-chat"].metadata.name == "chat"
    endpoints = {e.name: e for e in snap.endpoints("default/llama")}
    assert endpoints["sim-0"].hostport == "127.0.0.1:8001"
    assert endpoints["sim-1"].hostport == "127.0.0.2:8000"  # the pool's target port
    assert (endpoints["sim-0"].engine, endpoints["sim-1"].engine) == ("vllm", "sglang")
    assert endpoints["sim-2"].engine == "triton-trtllm"  # from the engine-type label
    assert source.gateway_config is not None


def test_statuses_are_computed_and_logged(files: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="poolkeeper.controller.files")
    source = make_source(files, Datastore())
    source.reload()
    statuses = source.statuses()
    accepted = statuses["default/chat"].condition("Accepted")
    rejected = statuses["default/chat-copy"].condition("Accepted")
    assert accepted is not None
    assert rejected is not None
    assert (accepted.status, accepted.reason) == ("True", "Accepted")
    assert (rejected.status, rejected.reason) == ("False", "ModelNameInUse")
    assert "InferenceModel default/chat-copy: Accepted=False (ModelNameInUse)" in caplog.text


def test_change_is_picked_up_by_poll(files: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="poolkeeper.controller.files")
    store = Datastore()
    source = make_source(files, store)
    source.reload()
    assert source.poll() is None  # nothing changed
    write(
        files / "models.yaml",
        MODELS.replace("name: chat-copy", "name: other").replace(
            "modelName: llama-chat, poolRef", "modelName: llama-other, poolRef"
        ),
    )
    outcome = source.poll()
    assert outcome is not None
    assert outcome.applied
    assert set(store.snapshot().models("default/llama")) == {"llama-chat", "llama-other"}
    assert set(source.statuses()) == {"default/chat", "default/other"}
    assert "InferenceModel default/chat-copy: removed" in caplog.text


def test_bad_edit_keeps_the_last_good_state(files: Path, caplog: pytest.LogCaptureFixture) -> None:
    store = Datastore()
    source = make_source(files, store)
    source.reload()
    good = store.snapshot()
    write(files / "pool.yaml", POOL.replace("targetPortNumber: 8000", "targetPortNumber: [x"))
    outcome = source.poll()
    assert outcome is not None
    assert not outcome.applied
    assert store.snapshot() is good
    errors = source.last_errors
    assert len(errors) == 1
    # file:line:col of the YAML error (the unclosed `[` runs into line 7)
    assert errors[0].startswith(f"{files / 'pool.yaml'}:7:15: invalid YAML")
    assert "keeping the last good state" in caplog.text
    # An invalid object (not just bad syntax) is reported with its field path.
    write(files / "pool.yaml", POOL.replace("targetPortNumber: 8000", "targetPortNumber: 99999"))
    outcome = source.poll()
    assert outcome is not None
    assert not outcome.applied
    assert "InferencePool/default/llama: spec.targetPortNumber" in source.last_errors[0]
    assert store.snapshot() is good
    # Fixing the file applies again and clears the errors.
    write(files / "pool.yaml", POOL.replace("8000", "8080"))
    outcome = source.poll()
    assert outcome is not None
    assert outcome.applied
    assert not source.last_errors
    endpoints = {e.name: e.port for e in store.snapshot().endpoints("default/llama")}
    assert endpoints["sim-1"] == 8080


def test_unknown_engine_label_is_a_precise_error(files: Path) -> None:
    write(files / "gateway.yaml", GATEWAY.replace("engine-type: triton-trtllm", "engine-type: tgi"))
    source = make_source(files, Datastore())
    outcome = source.reload()
    assert not outcome.applied
    assert len(outcome.errors) == 1
    error = outcome.errors[0]
    assert "GatewayConfig/default/default" in error
    assert "spec.endpoints[2].labels[inference.networking.k8s.io/engine-type]" in error
    assert "unknown engine type 'tgi'" in error


def test_two_gateway_configs_are_refused(files: Path) -> None:
    write(files / "second.yaml", GATEWAY.replace("name: default", "name: second", 1))
    outcome = make_source(files, Datastore()).reload()
    assert not outcome.applied
    assert any("more than one GatewayConfig" in e for e in outcome.errors)


def test_files_without_gateway_config_have_no_standalone_endpoints(files: Path) -> None:
    (files / "gateway.yaml").unlink()
    store = Datastore()
    assert make_source(files, store).reload().applied
    assert store.snapshot().endpoints("default/llama") == ()


def test_fingerprint_sees_added_removed_and_changed_files(files: Path) -> None:
    before = fingerprint([files])
    write(files / "extra.yml", POOL.replace("name: llama", "name: extra"))
    added = fingerprint([files])
    assert added != before
    (files / "extra.yml").unlink()
    assert fingerprint([files]) == before
    (files / ".hidden.yaml").write_text("ignored: true")
    (files / "notes.txt").write_text("ignored")
    assert fingerprint([files]) == before
    assert fingerprint([files / "missing.yaml"]) == ((str(files / "missing.yaml"), -1, -1, -1),)


async def test_run_reloads_without_restart(files: Path) -> None:
    store = Datastore()
    source = make_source(files, store)
    task = asyncio.create_task(source.run())
    try:
        for _ in range(100):
            if store.snapshot().pool_keys():
                break
            await asyncio.sleep(0.02)
        assert store.snapshot().pool_keys() == ("default/llama",)
        write(files / "pool2.yaml", POOL.replace("name: llama", "name: second"))
        for _ in range(200):
            if len(store.snapshot().pool_keys()) == 2:
                break
            await asyncio.sleep(0.02)
        assert store.snapshot().pool_keys() == ("default/llama", "default/second")
        assert source.loads == 2
    finally:
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task


@pytest.mark.integration
async def test_file_edits_start_and_stop_scrapers_of_real_simulators(files: Path) -> None:
    specs = build_fleet(count=1)
    cluster = SimCluster(specs)
    (listening,) = await cluster.start()
    key = f"127.0.0.1:{listening.port}"
    endpoint_line = (
        f"    - {{name: real, address: 127.0.0.1, port: {listening.port}, "
        "labels: {app: llama}}\n"
    )
    one_endpoint = GATEWAY.split("    - {name: sim-0")[0] + endpoint_line
    write(files / "gateway.yaml", one_endpoint)
    store = Datastore()
    source = make_source(files, store)
    task = asyncio.create_task(source.run())
    try:
        async with ScraperManager(ScrapingConfig(interval_ms=20), store.update_metrics) as manager:
            manager.follow(store)
            for _ in range(200):
                if store.snapshot().metrics_for(key).updated_at > 0:
                    break
                await asyncio.sleep(0.02)
            assert store.snapshot().metrics_for(key).error is None
            assert set(manager.scrapers) == {key}
            # Edit the file: the endpoint goes away, so does its loop and its metrics.
            write(files / "gateway.yaml", GATEWAY.split("  endpoints:")[0] + "  endpoints: []\n")
            for _ in range(200):
                if not manager.scrapers:
                    break
                await asyncio.sleep(0.02)
            assert manager.scrapers == {}
            assert store.snapshot().metrics == {}
    finally:
        task.cancel()
        with suppress(asyncio.CancelledError):
            await task
        await cluster.stop()
