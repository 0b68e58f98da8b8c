"""Cross-replica sync's shared keys: the key file read at start, and followed while running.

The file holds one key a line (`config.parse_keys`: the first signs, every one verifies, at
most 4), so a key is rotated in three Secret updates without a window in which replicas reject
each other (docs/kubernetes.md, "Rotating the sync key"). Kubernetes updates a mounted Secret
in place: the kubelet writes the new content into a new hidden directory and swaps the
`..data` link to it atomically (within about a minute of the update). So the file is followed
(`KeyFile.poll`): at most every `every_s` of the runtime's clock it is `stat`ed through its
links (device, inode, size, modification and change times), and re-read only when that stamp
changed. A changed file that reads is in use from the next datagram on (`Codec.set_keys`); one
that does not (missing, unreadable, a bad line) leaves the keys in use as they are, with one
error naming the field, the file and the line (the messages of the start), counted as
`invalid`; sync never drops to no key, nor stops. The file is never re-read while its stamp
stays (a bad file is reported once, not every interval).

A missing or bad key at start is a ConfigError naming the field (`ReplicaSyncConfig.key_field`:
`spec.replicaSync.keyFile`, or the EndpointPickerConfig's syncer parameter that set it): the
syncer never runs unauthenticated. With `keyOptional`, only an empty key directory (an optional
Secret volume without its Secret) leaves sync off (`key_missing`) until the file appears
(`server/sync_service.py`); while it waits, other files appearing in the directory (the
Secret created with another data key) are reported once per listing, counted `invalid`.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Final

from poolkeeper.errors import ConfigError
from poolkeeper.scheduling.replicasync.config import KEY_FIELD, ReplicaSyncConfig, parse_keys

log = logging.getLogger("poolkeeper.replicasync")

RESULTS: Final = ("ok", "invalid")  # `poolkeeper_replica_sync_key_reloads_total{result}`
Stamp = tuple[int, ...] | str  # what `stat` says of the file, or why it could not


def key_missing(config: ReplicaSyncConfig) -> str | None:
    """Why sync stays off (`keyOptional` and the key's optional Secret not created yet), or
    None: start it. Optional only when the key file's directory exists and holds no files:
    what an optional Secret volume mounts without its Secret (an empty directory, or only the
    kubelet's `..data` link and `..<timestamp>` directory). Anything else (the directory
    missing: a wrong mountPath; other files there: the Secret's data key is not the file's
    name; the path unreadable) is a ConfigError naming the field: a typo must not leave sync
    off for good behind one warning."""
    path, field = config.key_file, config.key_field
    if not config.key_optional or not path:
        return None
    key = Path(path)
    try:
        key.stat()
        return None  # there: read_keys reads (and checks) it
    except FileNotFoundError:
        pass
    except OSError as exc:
        raise ConfigError(f"{field}: cannot check {path}: {exc.strerror}") from None
    folder = key.parent
    try:
        present = stray_files(folder)
    except FileNotFoundError:
        raise ConfigError(
            f"{field}: {path} does not exist, nor does its directory {folder}: keyOptional "
            "covers only an optional Secret volume mounted there without its Secret (check "
            "the volume's mountPath)"
        ) from None
    except OSError as exc:
        raise ConfigError(f"{field}: cannot list {folder}: {exc.strerror}") from None
    if present:
        raise ConfigError(misnamed(field, path, present))
    return (
        f"replica sync stays off: {field} {path} does not exist and its directory is empty "
        "(keyOptional: the optional Secret is not created). Create the shared key (e.g. the "
        "Secret the deployment mounts there: kubectl create secret generic <pool>-epp-sync "
        '--from-literal=key="$(head -c 32 /dev/urandom | base64)"): sync starts once the '
        "file appears (the kubelet mounts it within about a minute), no restart needed"
    )


def stray_files(folder: Path) -> list[str]:
    """The files in the key's directory other than the kubelet's own (`..data`, and the
    `..<timestamp>` directory it points to); OSError when it cannot be listed."""
    return sorted(e.name for e in folder.iterdir() if not e.name.startswith(".."))


def misnamed(field: str, path: str, present: list[str]) -> str:
    """The key's file is not there but others are: the Secret's data key is another name."""
    return (
        f"{field}: {path} does not exist, but {Path(path).parent} holds "
        f"{', '.join(present[:8])}: keyFile must name the key's file (the Secret's data key)"
    )


def read_keys(path: str | None, field: str = KEY_FIELD) -> list[bytes]:
    """The shared keys in `path` (`config.parse_keys`: the first signs); ConfigError naming
    `field`, the file and the line otherwise."""
    if not path:
        raise ConfigError(f"{field}: required: the syncer never runs without a key")
    try:
        data = Path(path).read_bytes()
    except OSError as exc:
        raise ConfigError(f"{field}: cannot read {path}: {exc.strerror}") from None
    try:
        return parse_keys(data, path)
    except ValueError as exc:
        raise ConfigError(f"{field}: {exc}") from None


def check_key(config: ReplicaSyncConfig) -> str | None:
    """What the start will find of the key, checked before anything starts: why sync stays
    off (`key_missing`), None when the key reads, ConfigError naming the field otherwise. For
    the EPP command, whose key file is a plugin parameter (cli/epp.py)."""
    if not config.enabled:
        return None
    if (why := key_missing(config)) is not None:
        return why
    read_keys(config.key_file, config.key_field)
    return None


def stamp(path: str) -> Stamp:
    """The key file as `stat` sees it through its links: what changes when the kubelet swaps
    `..data` (another inode), or when the file is rewritten in place (size, times); why not
    when it cannot be stat'ed (then every other reason is a change too)."""
    try:
        st = os.stat(path)
    except OSError as exc:
        return exc.strerror or type(exc).__name__
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


class KeyFile:
    """The key file followed: `poll` says when it holds other valid keys than those in use.
    `keys` None: none yet (`keyOptional`, the file not there at start)."""

    def __init__(self, config: ReplicaSyncConfig, *, every_s: float, now: float) -> None:
        if every_s <= 0:
            raise ValueError(f"every_s must be > 0, got {every_s}")
        self.path, self.field = config.key_file or "", config.key_field
        self.every_s = every_s
        self.keys: list[bytes] | None = None
        self.reloads = dict.fromkeys(RESULTS, 0)  # changed files read, by result
        self._stamp = stamp(self.path)  # before reading: a change meanwhile is seen next
        self._due = now + 0.9 * every_s
        self._seen: list[str] | str | None = None  # the key's directory while no key (`_absent`)

    def load(self) -> list[bytes]:
        """Read the keys at start (ConfigError naming the field, file and line)."""
        self.keys = read_keys(self.path, self.field)
        return self.keys

    def poll(self, now: float, *, running: bool = True) -> list[bytes] | None:
        """The keys to use from now on when the file changed since it was last read and holds
        other valid keys; None otherwise (not due yet: at most one `stat` per `every_s` of the
        runtime's clock; unchanged; the same keys; refused, logged and counted). `running`:
        whether sync runs (False: its late start with `keys` failed, and is tried again)."""
        if now < self._due:
            return None
        # (less a tenth: the loop's timer firing a hair early by the clock must not skip one)
        self._due = now + 0.9 * self.every_s
        current = stamp(self.path)
        if self.keys is None and isinstance(current, str):
            self._stamp = current
            self._absent()  # still not there (keyOptional): but is another file?
            return None
        if current == self._stamp:
            return None
        self._stamp = current
        try:
            keys = read_keys(self.path, self.field)
        except ConfigError as exc:
            self.reloads["invalid"] += 1
            if self.keys is None:
                log.error("%s; replica sync stays off until it holds a valid key", exc.message)
            elif not running:
                log.error("%s; replica sync is not running (its start fails), tried again with "
                          "the %d key(s) read before", exc.message, len(self.keys))  # fmt: skip
            else:
                log.error("%s; the %d key(s) in use stay", exc.message, len(self.keys))
            return None
        self.reloads["ok"] += 1
        if keys == self.keys:
            log.info("replica sync: %s read again, its keys unchanged", self.path)
            return None
        log.info(
            "replica sync: %d key(s) from %s in use from the next datagram (the first signs)",
            len(keys), self.path,
        )  # fmt: skip
        self.keys = keys
        return keys

    def _absent(self) -> None:
        """No key file yet (`keyOptional`): when other files appear in its directory, the
        Secret was created with another data key, and sync would stay off for good (and the
        next start refuse the directory, `key_missing`): one error naming the field and the
        files, counted `invalid`, until the listing changes."""
        try:
            files = stray_files(Path(self.path).parent)
            seen: list[str] | str = files
            problem = misnamed(self.field, self.path, files) if files else None
        except OSError as exc:
            seen = exc.strerror or type(exc).__name__
            problem = f"{self.field}: cannot list {Path(self.path).parent}: {seen}"
        if seen == self._seen:
            return
        self._seen = seen
        if problem is not None:
            self.reloads["invalid"] += 1
            log.error("%s; replica sync stays off until the key's file is there (a restart "
                      "would refuse this directory)", problem)  # fmt: skip
