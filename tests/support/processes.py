"""`poolkeeper serve` and `poolkeeper sim` as subprocesses of a test: started with their output
in a log file, waited on (a port, a log line, gRPC readiness) and stopped; Envoy children
of a killed `serve` reaped."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO

import grpc

SERVING = 1


@dataclass
class Proc:
    process: subprocess.Popen[bytes]
    log_path: Path
    log: IO[bytes]

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace")

    def children(self) -> list[int]:
        pid = self.process.pid
        with contextlib.suppress(OSError):
            text = Path(f"/proc/{pid}/task/{pid}/children").read_text()
            return [int(p) for p in text.split()]
        return []

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 15) -> None:
        if self.process.poll() is None:
            self.process.send_signal(sig)
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(5)
        self.log.close()


# The `serve` and `sim` subcommands exactly as `poolkeeper` registers them, without importing
# the other command modules (so these tests depend only on the code they exercise).
_RUNNER = """
import argparse, sys
from poolkeeper.cli import serve, sim
parser = argparse.ArgumentParser(prog="poolkeeper")
commands = parser.add_subparsers()
serve.register(commands)
sim.register(commands)
args = parser.parse_args(sys.argv[1:])
sys.exit(args.handler(args))
"""


def poolkeeper(args: list[str], log_path: Path, *, own_group: bool = False) -> Proc:
    """`own_group`: in a process group of its own, as a shell starts a job (a terminal's
    Ctrl-C goes to that whole group: `os.killpg(proc.process.pid, SIGINT)` does the same)."""
    log = log_path.open("wb")
    process = subprocess.Popen(
        [sys.executable, "-c", _RUNNER, *args],
        stdout=log,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
        process_group=0 if own_group else None,
    )
    return Proc(process, log_path, log)


# How long a subprocess may take to come up before a wait gives up. It bounds a hang only:
# `poolkeeper serve` imports for ~2 s of CPU and then starts Envoy, which a loaded 2-core
# machine stretches many times over (30 s failed 5 e2e tests with one competing CPU hog).
STARTUP_S = 90.0


def wait_for_port(port: int, proc: Proc, timeout: float = STARTUP_S) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.process.poll() is not None:
            raise RuntimeError(f"process exited early:\n{proc.log_text()[-3000:]}")
        with socket.socket() as s:
            s.settimeout(0.2)
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.05)
    raise TimeoutError(f"port {port} not open after {timeout}s:\n{proc.log_text()[-3000:]}")


def wait_for_text(proc: Proc, text: str, timeout: float = STARTUP_S) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if text in proc.log_text():
            return
        if proc.process.poll() is not None:
            raise RuntimeError(f"process exited early:\n{proc.log_text()[-3000:]}")
        time.sleep(0.05)
    raise TimeoutError(f"{text!r} not seen after {timeout}s:\n{proc.log_text()[-3000:]}")


_LISTENING = re.compile(r"^\S+ listening on http://\S+:(\d+) ", re.MULTILINE)


def listening_ports(proc: Proc, count: int, timeout: float = STARTUP_S) -> list[int]:
    """The ports of a `poolkeeper sim --port 0` process's `count` servers, in server order,
    once all listen (it prints `<name> listening on <url> ...` for each after binding).

    With `--port 0` every server binds a port the kernel picks as it binds. A port chosen
    beforehand (`free_ports`) must stay free for the seconds such a process spends importing
    on a loaded machine, which every other program's choice from the same range may break:
    the e2e fleet failed so ("cannot listen: [Errno 98] Address already in use")."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        ports = [int(port) for port in _LISTENING.findall(proc.log_text())]
        if len(ports) >= count:
            return ports[:count]
        if proc.process.poll() is not None:
            raise RuntimeError(f"process exited early:\n{proc.log_text()[-3000:]}")
        time.sleep(0.05)
    raise TimeoutError(
        f"{count} servers not listening after {timeout}s:\n{proc.log_text()[-3000:]}"
    )


def health_status(port: int, service: str) -> int:
    from poolkeeper.telemetry.health import HealthCheckRequest, HealthCheckResponse

    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        call = channel.unary_unary(
            "/grpc.health.v1.Health/Check",
            request_serializer=HealthCheckRequest.SerializeToString,
            response_deserializer=HealthCheckResponse.FromString,
        )
        return int(call(HealthCheckRequest(service=service), timeout=2).status)


def wait_ready(port: int, proc: Proc, timeout: float = STARTUP_S) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with contextlib.suppress(grpc.RpcError):
            if health_status(port, "readiness") == SERVING:
                return
        if proc.process.poll() is not None:
            raise RuntimeError(f"serve exited early:\n{proc.log_text()[-3000:]}")
        time.sleep(0.1)
    raise TimeoutError(f"gateway not ready after {timeout}s:\n{proc.log_text()[-3000:]}")


@contextlib.contextmanager
def killing_orphans(proc: Proc) -> Iterator[None]:
    """Makes sure children (Envoy) of a serve process we SIGKILL do not outlive the test."""
    children = proc.children()
    try:
        yield
    finally:
        for pid in children:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
