"""The sync key file followed while running (`sync_keys.KeyFile`): real files on disk, the
runtime's clock handed in (no sleeps)."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest

from poolkeeper.scheduling.replicasync.config import ReplicaSyncConfig
from poolkeeper.server.sync_keys import KeyFile

K1, K2, K3 = b"1" * 32, b"2" * 32, b"3" * 32
EVERY = 1.0


def _section(path: Path, *, optional: bool = False) -> ReplicaSyncConfig:
    return ReplicaSyncConfig(
        enabled=True, key_file=str(path), key_optional=optional, peers=["127.0.0.1:1"]
    )


def _write(path: Path, *keys: bytes) -> None:
    """A new file renamed over the old (as the kubelet's swap): a new inode, so a poll sees
    the change even where the file system's times are coarser than the test's steps, and
    never reads it half written (`_rewrite`: in place)."""
    tmp = path.with_name(f"{path.name}.tmp")
    tmp.write_bytes(b"".join(key + b"\n" for key in keys))
    os.replace(tmp, path)


def _rewrite(path: Path, content: bytes) -> None:
    """The file rewritten in place (same inode): always another size than before here, as
    the times alone may not change within a coarse kernel tick."""
    before = path.stat().st_size
    path.write_bytes(content)
    assert path.stat().st_size != before


def _loaded(path: Path) -> KeyFile:
    keys = KeyFile(_section(path), every_s=EVERY, now=0.0)
    assert keys.load() == [K1]
    return keys


def test_a_key_file_rewritten_in_place_is_read_once_due(tmp_path: Path) -> None:
    path = tmp_path / "key"
    _write(path, K1)
    keys = _loaded(path)
    assert keys.poll(EVERY) is None  # unchanged: not read again
    _rewrite(path, K1 + b"\n" + K2 + b"\n")  # step 1 of a rotation: the new key verifies too
    assert keys.poll(EVERY + 0.5) is None  # checked at most once per `every_s`
    assert keys.poll(2 * EVERY) == [K1, K2]
    assert keys.keys == [K1, K2]
    assert keys.poll(3 * EVERY) is None  # read once per change
    _rewrite(path, b"# step 2\n" + K2 + b"\n" + K1 + b"\n")  # step 2: the new key signs
    assert keys.poll(4 * EVERY) == [K2, K1]
    assert keys.reloads == {"ok": 2, "invalid": 0}


def _kubelet_write(volume: Path, stamp: str, keys: list[bytes], name: str = "key") -> None:
    """What the kubelet's atomic writer does to a Secret volume: the payload (data key
    `name`) in a new `..<timestamp>` directory, `..data` swapped to it by a rename, the old
    one removed; the key's own name is a link through `..data`."""
    payload = volume / f"..{stamp}"
    payload.mkdir()
    _write(payload / name, *keys)
    old = os.readlink(volume / "..data") if (volume / "..data").is_symlink() else None
    (volume / "..data_tmp").symlink_to(payload.name)
    os.replace(volume / "..data_tmp", volume / "..data")
    if not (volume / name).is_symlink():
        (volume / name).symlink_to(f"..data/{name}")
    if old is not None:
        for entry in (volume / old).iterdir():
            entry.unlink()
        (volume / old).rmdir()


def test_a_secret_volume_updated_by_the_kubelet_is_followed(tmp_path: Path) -> None:
    volume = tmp_path / "secret"
    volume.mkdir()
    _kubelet_write(volume, "2026_12_07_15_00_00.1", [K1])
    keys = _loaded(volume / "key")
    _kubelet_write(volume, "2026_12_07_15_01_00.2", [K1, K2])
    assert keys.poll(EVERY) == [K1, K2]
    # The same size as before, a new inode: still seen.
    _kubelet_write(volume, "2026_12_07_15_02_00.3", [K2, K1])
    assert keys.poll(2 * EVERY) == [K2, K1]
    _kubelet_write(volume, "2026_12_07_15_03_00.4", [K2])
    assert keys.poll(3 * EVERY) == [K2]


@pytest.mark.parametrize(
    ("content", "expected"),
    [
        (b"short\n", "line 1 holds 5 bytes; each key needs at least 16"),
        (K1 + b"\n" + K1 + b"\n", "line 2 repeats the key of line 1"),
        (b"# nothing\n", "holds no key"),
        (b"".join(bytes([c]) * 32 + b"\n" for c in b"abcde"), "holds 5 keys, at most 4"),
    ],
)
def test_an_invalid_new_file_keeps_the_keys_in_use_and_says_so_once(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, content: bytes, expected: str
) -> None:
    path = tmp_path / "key"
    _write(path, K1)
    keys = _loaded(path)
    _rewrite(path, content)
    with caplog.at_level(logging.INFO, logger="poolkeeper.replicasync"):
        assert keys.poll(EVERY) is None
        assert keys.poll(2 * EVERY) is None  # the same bad file: not said again
    assert keys.keys == [K1]
    assert keys.reloads == {"ok": 0, "invalid": 1}
    (record,) = caplog.records
    assert record.levelno == logging.ERROR
    assert record.getMessage() == (
        f"spec.replicaSync.keyFile: {path} {expected}{_tail(expected)}; the 1 key(s) in use stay"
    )
    _write(path, K1, K2)  # fixed
    assert keys.poll(3 * EVERY) == [K1, K2]
    assert keys.reloads == {"ok": 1, "invalid": 1}


def _tail(expected: str) -> str:
    """What the start's message adds after the problem (`config.parse_keys`)."""
    if expected.startswith("line 1 holds 5"):
        return " (e.g. `head -c 32 /dev/urandom | base64`)"
    if expected == "holds no key":
        return " (only blank lines or # comments)"
    if expected.startswith("holds 5 keys"):
        return " (the first signs)"
    return ""


@pytest.mark.parametrize(
    ("running", "tail"),
    [
        (True, "the 1 key(s) in use stay"),
        # (a late start failed: the keys read are only tried, not in use)
        (False, "replica sync is not running (its start fails), tried again with the 1 key(s) "
         "read before"),
    ],
)  # fmt: skip
def test_a_removed_key_file_keeps_the_keys_in_use(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, running: bool, tail: str
) -> None:
    path = tmp_path / "key"
    _write(path, K1)
    keys = _loaded(path)
    path.unlink()
    with caplog.at_level(logging.ERROR, logger="poolkeeper.replicasync"):
        assert keys.poll(EVERY, running=running) is None
    assert caplog.messages == [
        f"spec.replicaSync.keyFile: cannot read {path}: No such file or directory; {tail}"
    ]
    assert keys.keys == [K1]
    _write(path, K1)  # back, the same key: read, nothing to swap
    assert keys.poll(2 * EVERY) is None
    assert keys.reloads == {"ok": 1, "invalid": 1}
    _write(path, K3)
    assert keys.poll(3 * EVERY) == [K3]


def test_an_optional_key_that_appears_later_is_returned_once_valid(tmp_path: Path) -> None:
    volume = tmp_path / "secret"
    volume.mkdir()  # an optional Secret volume, its Secret not created yet
    keys = KeyFile(_section(volume / "key", optional=True), every_s=EVERY, now=0.0)
    assert keys.keys is None
    assert keys.poll(EVERY) is None  # still missing: nothing counted
    assert keys.reloads == {"ok": 0, "invalid": 0}
    (volume / "key").write_bytes(b"short\n")
    assert keys.poll(2 * EVERY) is None
    assert keys.reloads == {"ok": 0, "invalid": 1}
    (volume / "key").unlink()  # the Secret is created: the kubelet fills the volume
    _kubelet_write(volume, "2026_12_07_15_00_00.1", [K1])
    assert keys.poll(3 * EVERY) == [K1]
    assert keys.keys == [K1]


def test_a_secret_with_another_data_key_is_reported_while_sync_waits(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    volume = tmp_path / "secret"
    volume.mkdir()  # an optional Secret volume, its Secret not created yet
    keys = KeyFile(_section(volume / "key", optional=True), every_s=EVERY, now=0.0)
    _kubelet_write(volume, "2026_12_07_15_00_00.1", [K1], name="sync-key")  # a wrong name
    with caplog.at_level(logging.INFO, logger="poolkeeper.replicasync"):
        assert keys.poll(EVERY) is None
        assert keys.poll(2 * EVERY) is None  # the same listing: said once
    assert caplog.messages == [
        f"spec.replicaSync.keyFile: {volume / 'key'} does not exist, but {volume} holds "
        "sync-key: keyFile must name the key's file (the Secret's data key); replica sync "
        "stays off until the key's file is there (a restart would refuse this directory)"
    ]
    assert caplog.records[0].levelno == logging.ERROR
    assert keys.reloads == {"ok": 0, "invalid": 1}
    (volume / "notes").write_text("x")  # the listing changed: said again
    assert keys.poll(3 * EVERY) is None
    assert keys.reloads == {"ok": 0, "invalid": 2}
    assert "holds notes, sync-key:" in caplog.messages[-1]
    _kubelet_write(volume, "2026_12_07_15_01_00.2", [K1])  # fixed: the key's own name
    assert keys.poll(4 * EVERY) == [K1]


def test_keys_named_by_an_endpoint_picker_config_are_named_so_on_reload(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "key"
    _write(path, K1)
    at = {"replicaSyncKeyField": "epc.yaml: sync.parameters.keyFile"}
    section = ReplicaSyncConfig.model_validate(
        {"enabled": True, "keyFile": str(path), "peers": ["127.0.0.1:1"]}, context=at
    )
    keys = KeyFile(section, every_s=EVERY, now=0.0)
    keys.load()
    path.write_bytes(b"short\n")
    with caplog.at_level(logging.ERROR, logger="poolkeeper.replicasync"):
        keys.poll(EVERY)
    assert caplog.messages[0].startswith(f"epc.yaml: sync.parameters.keyFile: {path} line 1")


def test_a_bad_interval_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="every_s must be > 0, got 0"):
        KeyFile(_section(tmp_path / "key"), every_s=0, now=0.0)
