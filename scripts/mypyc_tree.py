"""A copy of `src/` with the EPP's per-request modules compiled by mypyc (a measuring script).

Issue 36 asked whether a compiled hot path closes the small-request gap. This builds the tree
that question was measured with, outside the worktree: `src/` copied to `OUT/src`, then the
modules of `COMPILED` compiled in place by mypyc (it ships in the mypy wheel of `.venv`; gcc
and the Python headers are needed). An extension module next to its `.py` wins on import, so
any script that runs a variant from another tree measures it:

    .venv/bin/python scripts/mypyc_tree.py --out /tmp/pk-mypyc
    PYTHONPATH=/tmp/pk-mypyc/src .venv/bin/python scripts/route_profile.py --gap-ms 10
    PYTHONPATH=/tmp/pk-mypyc/src .venv/bin/python scripts/transport_profile.py --gap-ms 10
    .venv/bin/python scripts/chain_cost.py --variant pure= --variant comp=@/tmp/pk-mypyc/src \\
        --floor --peers sglang-router --rounds 6 --seconds 10

The result (docs/notes/2026-12-07-compiled-hot-path.md): no gain, so nothing is compiled in
the shipped tree. `NOT_COMPILED` says why the rest of the request path is not in the set:
mypyc refuses or miscompiles it as it is written today. Not a test: run it by hand.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# The request path's own modules that mypyc 2.4 compiles and that import and run as compiled.
COMPILED = (
    "poolkeeper/extproc/h2/connection.py",  # the lean transport: reads, streams, handlers
    "poolkeeper/extproc/h2/receiver.py",  # frames in (connection.py as split in December)
    "poolkeeper/extproc/h2/sender.py",  # frames out
    "poolkeeper/extproc/h2/shared.py",
    "poolkeeper/extproc/h2/stream.py",
    "poolkeeper/extproc/h2/frames.py",
    "poolkeeper/extproc/h2/headers.py",
    "poolkeeper/extproc/h2/limits.py",
    "poolkeeper/extproc/messages.py",  # replies (messages.py as split in December:)
    "poolkeeper/extproc/routing_replies.py",  # the replies that route a request
    "poolkeeper/extproc/request_fields.py",  # header maps, the proxy's metadata
    "poolkeeper/extproc/state.py",  # the Exchange
    "poolkeeper/extproc/response_path.py",  # state.py as split in December
    "poolkeeper/extproc/exchange_state.py",
    "poolkeeper/requestcontrol/director.py",
    "poolkeeper/requestcontrol/prepare.py",  # director.py as split in December
    "poolkeeper/requestcontrol/candidates.py",
    "poolkeeper/requestcontrol/sends.py",
    "poolkeeper/requestcontrol/flowgate.py",
    "poolkeeper/requestcontrol/flowoutcomes.py",  # flowgate.py as split in December
    "poolkeeper/requestcontrol/flowgate_reads.py",
    "poolkeeper/requestcontrol/flowroom.py",
    "poolkeeper/requestcontrol/heldrequests.py",
    "poolkeeper/scheduling/scheduler.py",
    "poolkeeper/scheduling/profile.py",
    "poolkeeper/scheduling/types.py",
)

# The rest of the request path, and why it stays interpreted (what mypyc 2.4 said).
NOT_COMPILED = {
    "poolkeeper/extproc/h2/rpc.py": "async generators are unimplemented",
    "poolkeeper/extproc/server.py": "async generators are unimplemented (Process)",
    "poolkeeper/requestcontrol/body_json.py": "AnyStr methods fail mypyc's type check",
    "poolkeeper/scheduling/stats.py": "a Final tuple read before it is set (import cycle)",
    "poolkeeper/scheduling/plugins/filters.py": "mypyc crashes (vtable KeyError, _LeastLoadFilter)",
    "poolkeeper/scheduling/plugins/*": "pydantic parameter models: Field() defaults break"
    " native attributes (TypeError at import); base classes with interpreted subclasses",
}


def mypy_config(path: Path) -> None:
    """pyproject's [tool.mypy] as an ini mypyc reads: strict, and the stub-less packages."""
    conf = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["mypy"]
    lines = ["[mypy]", f"python_version = {conf['python_version']}", "strict = True"]
    lines.append("mypy_path = src")
    for override in conf.get("overrides", []):
        if override.get("ignore_missing_imports"):
            lines += [f"[mypy-{','.join(override['module'])}]", "ignore_missing_imports = True"]
    path.write_text("\n".join(lines) + "\n")


def build(out: Path, modules: list[str]) -> float:
    """Copy `src/` to `out/src` and compile `modules` there; the build's seconds."""
    src = out / "src"
    if src.exists():
        shutil.rmtree(src)
    ignore = shutil.ignore_patterns("__pycache__", "*.so", "*.pyc")
    shutil.copytree(ROOT / "src", src, ignore=ignore)
    mypy_config(out / "mypy.ini")
    env = {**os.environ, "MYPYC_OPT_LEVEL": "3"}
    env.pop("PYTHONPATH", None)
    began = time.monotonic()
    cmd = [sys.executable, "-m", "mypyc", "--config-file", str(out / "mypy.ini"), *modules]
    done = subprocess.run(cmd, cwd=src, env=env, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        sys.stderr.write(done.stdout[-4000:] + done.stderr[-4000:])
        raise SystemExit(f"mypyc failed ({done.returncode})")
    shutil.rmtree(src / "build", ignore_errors=True)
    return time.monotonic() - began


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="", help="where the tree goes (default: a new temp dir)")
    parser.add_argument(
        "--module", action="append", default=[], help="a module path under src/ (default: all)"
    )
    args = parser.parse_args(argv)
    out = Path(args.out or tempfile.mkdtemp(prefix="pk-mypyc-")).resolve()
    out.mkdir(parents=True, exist_ok=True)
    modules = args.module or list(COMPILED)
    seconds = build(out, modules)
    built = sorted(p.relative_to(out / "src") for p in (out / "src").rglob("*.so"))
    print(f"compiled {len(modules)} modules in {seconds:.0f} s ({len(built)} extension files)")
    print(f"PYTHONPATH={out / 'src'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
