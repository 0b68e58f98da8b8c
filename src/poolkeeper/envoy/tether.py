"""Envoy's ties to `serve`: outside the terminal's signals, and dead when `serve` dies.

`serve` starts Envoy in a session (and process group) of its own. A terminal sends Ctrl-C's
SIGINT, and SIGHUP when it closes, to its whole foreground process group: with Envoy in that
group the keystroke stopped Envoy at once, cutting the streams `serve`'s drain was about to
finish, and the supervisor logged a restart. Now the signal reaches `serve` only, which drains
Envoy's listeners and then stops it (server/runtime.py).

Outside the group, nothing would stop an Envoy whose `serve` died without stopping it (SIGKILL,
a crash): it would keep the gateway's ports and serve without its endpoint picker. On Linux
Envoy therefore gets the parent-death signal, SIGKILL (`prctl(PR_SET_PDEATHSIG)`, which an
exec keeps). It is armed by a few lines of Python that then exec Envoy in the same process:
not by a `preexec_fn`, which would run Python between fork and exec in a process whose gRPC
threads do not survive the fork (gRPC's fork handlers aborted the child: seen under load).
Elsewhere (macOS) there is no such signal: Envoy outlives a `serve` that dies hard, as before.
"""

from __future__ import annotations

import os
import sys

# argv: the parent's pid, then Envoy's command. Arms the signal, makes sure the parent did not
# die before it was armed, and becomes Envoy (same pid). Without prctl it execs all the same.
_ARM_AND_EXEC = """\
import ctypes, os, signal, sys
parent, command = int(sys.argv[1]), sys.argv[2:]
try:
    armed = ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGKILL), 0, 0, 0) == 0
except (OSError, AttributeError):
    armed = False
if armed and os.getppid() != parent:
    sys.exit(1)
os.execv(command[0], command)
"""


def tethered(command: list[str]) -> list[str]:
    """`command` (Envoy's) wrapped so that it dies with this process (Linux); unchanged
    elsewhere. Linux sends the signal when the *thread* that started the child ends, so the
    caller starts it from the thread that lives as long as Envoy should (the event loop's)."""
    if not sys.platform.startswith("linux") or not sys.executable:
        return command
    return [sys.executable, "-S", "-c", _ARM_AND_EXEC, str(os.getpid()), *command]
