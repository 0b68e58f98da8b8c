"""free_ports: distinct, bindable, never from the kernel's ephemeral range (where outgoing
connections take their local ports and could steal a picked port before the server binds)."""

from __future__ import annotations

import socket

import pytest

from poolkeeper import netutil
from poolkeeper.netutil import LOOPBACK, ephemeral_range, free_ports


def test_ports_are_distinct_bindable_and_outside_the_ephemeral_range() -> None:
    low, high = ephemeral_range()
    ports = free_ports(8)
    assert len(set(ports)) == 8
    assert all(not low <= p <= high for p in ports)
    run = free_ports(4, consecutive=True)
    assert run == list(range(run[0], run[0] + 4))
    assert all(not low <= p <= high for p in run)
    for port in [*ports, *run]:
        with socket.socket() as sock:
            sock.bind((LOOPBACK, port))


def test_a_port_in_use_is_never_handed_out(monkeypatch: pytest.MonkeyPatch) -> None:
    taken, other = free_ports(2, consecutive=True)
    with socket.socket() as held:
        held.bind((LOOPBACK, taken))
        held.listen()
        # A pool of two ports, one of them listening: only the other can come back.
        monkeypatch.setattr(netutil, "_pool", lambda: range(taken, taken + 2))
        assert free_ports(1) == [other]
        with pytest.raises(OSError, match="no 2 free ports"):
            free_ports(2)
        with pytest.raises(ValueError, match="cannot pick 3 ports"):
            free_ports(3)
