"""The processes of a live benchmark run: started in a session of their own, waited for, stopped.

`process` runs a command for the duration of a `with` block (its own process group, output to a
log file; SIGTERM then SIGKILL to the group at the end), `wait_http` polls a readiness URL,
`repo_root` finds the checkout the peers are installed in (`.peers/`). Used by `bench live`,
the overhead benchmarks and the scripts under scripts/.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

from poolkeeper.errors import ConfigError

READY_TIMEOUT_S = 40.0  # a simulator or router starting on a busy machine


def repo_root() -> Path:
    here = Path.cwd()
    for candidate in (here, *here.parents):
        if (candidate / "pyproject.toml").is_file():
            return candidate
    return here


def _http_status(url: str, timeout: float = 1.0) -> int | None:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            return int(resp.status)
    except urllib.error.HTTPError as exc:
        return int(exc.code)
    except (OSError, ValueError):
        return None


def wait_http(url: str, ok: Callable[[int], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        status = _http_status(url)
        if status is not None and ok(status):
            return
        time.sleep(0.25)
    raise ConfigError(f"{what} did not become ready at {url} within {timeout:g} s")


@contextlib.contextmanager
def process(
    cmd: Sequence[str], log: Path, env: dict[str, str] | None = None
) -> Iterator[subprocess.Popen[bytes]]:
    """Run `cmd` (own process group, output to `log`) for the duration of the block."""
    with log.open("w") as fh:
        try:
            proc = subprocess.Popen(
                list(cmd), stdout=fh, stderr=subprocess.STDOUT, start_new_session=True,
                env={**os.environ, **(env or {})},
            )  # fmt: skip
        except OSError as exc:
            # E.g. a peer's venv moved after install: its script's `#!` names a python that
            # is gone, and exec reports the script itself as missing.
            raise ConfigError(
                f"cannot start {cmd[0]}: {exc.strerror} (a moved or broken install? "
                "reinstall the peers with scripts/install-peers.sh)"
            ) from exc
        try:
            yield proc
        finally:
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGTERM)
                try:
                    proc.wait(timeout=15)
                except subprocess.TimeoutExpired:
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait(timeout=5)
