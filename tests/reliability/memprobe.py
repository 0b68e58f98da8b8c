"""Resident memory of processes on this machine, from /proc (Linux): what the memory figures
of docs/reliability.md are measured with."""

from __future__ import annotations

from pathlib import Path


def rss_mb(pid: int) -> float:
    """VmRSS of `pid` in MB (MiB), 0.0 when the process is gone or /proc is unavailable."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        return 0.0
    return 0.0


def children(pid: int) -> list[int]:
    try:
        return [int(p) for p in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []


def main_arena_mb(pid: int) -> float:
    """Resident size of the `[heap]` mapping of `pid` in MB: glibc's main malloc arena, where
    native allocations of the event-loop thread live (0.0 when unreadable)."""
    total, current = 0, ""
    try:
        with open(f"/proc/{pid}/smaps") as smaps:
            for line in smaps:
                head = line.split(maxsplit=1)[0]
                if "-" in head and not head.endswith(":"):
                    current = line.split()[-1]
                elif head == "Rss:" and current == "[heap]":
                    total += int(line.split()[1])
    except OSError:
        return 0.0
    return total / 1024
