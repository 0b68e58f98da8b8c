"""Envoy's ties to `serve`: outside the terminal's signals, and dead when `serve` dies.

`serve` starts Envoy in a session (and process group) of its own. A terminal sends Ctrl-C's
SIGINT, and SIGHUP when it closes, to its whole foreground process group: with Envoy in that
group the keystroke stopped Envoy at once, cutting the streams `serve`'s drain was about to
finish, and the supervisor logged a restart. Now the signal reaches `serve` only, which drains
Envoy's listeners and then stops it (server/runtime.py).

Outside the group, nothing would stop an Envoy whose `serve` died without stopping it (SIGKILL,
a crash): it would keep the gateway's ports and serve without its endpoint picker. On Linux
Envoy therefore gets the parent-death signal, SIGKILL, armed between fork and exec. Elsewhere
(macOS) there is no such hook and `child_setup` returns None: Envoy then outlives a `serve`
that dies hard, as it did before.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
from collections.abc import Callable

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def child_setup() -> Callable[[], None] | None:
    """For Envoy's `Popen(preexec_fn=...)`: arms SIGKILL on the death of this process (Linux);
    None where that is not available. The caller must also ask for a new session.

    Linux sends the signal when the *thread* that forked the child ends, so the caller forks
    from the thread that runs as long as Envoy should (serve's event loop thread)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    # Everything is looked up here, before the fork: the child may only call, never import.
    prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]
    prctl.restype = ctypes.c_int
    parent = os.getpid()
    kill = int(signal.SIGKILL)
    getppid, exit_now = os.getppid, os._exit

    def arm() -> None:
        if prctl(PR_SET_PDEATHSIG, kill, 0, 0, 0) != 0:
            return  # not armed: Envoy runs as it did before this module
        if getppid() != parent:  # the parent died before the signal was armed
            exit_now(1)

    return arm
