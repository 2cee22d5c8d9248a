"""The ports ranks rendezvous on are picked below the kernel's ephemeral range: a port
from bind(0) could be taken by any outgoing connection before the store bound it (the Ray
suite failed so, EADDRINUSE, beside the e2e suite)."""

from __future__ import annotations

import socket

import pytest
from geartrain.cluster import ports
from geartrain.cluster.update_group import free_address


def test_a_free_port_is_below_the_ephemeral_range_and_bindable() -> None:
    low, high = ports.ephemeral_range()
    assert 0 < low <= high
    for _ in range(20):
        port = ports.free_port()
        assert ports.PORT_FLOOR <= port < low
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("", port))
    host, port = free_address()
    assert ports.PORT_FLOOR <= port < low and host


def test_a_taken_port_is_passed_over(monkeypatch: pytest.MonkeyPatch) -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as held:
        held.bind(("", 0))
        held.listen()
        taken = held.getsockname()[1]
        picks = iter([taken, taken, taken + 1])

        class Picks:
            def randrange(self, low: int, high: int) -> int:
                return next(picks)

        monkeypatch.setattr(ports.random, "SystemRandom", Picks)
        monkeypatch.setattr(ports, "PORT_FLOOR", taken - 5000)
        monkeypatch.setattr(ports, "ephemeral_range", lambda: (taken + 5000, 60999))
        assert ports.free_port() == taken + 1


def test_without_room_below_the_range_the_kernel_picks(monkeypatch: pytest.MonkeyPatch) -> None:
    low, high = ports.ephemeral_range()
    monkeypatch.setattr(ports, "PORT_FLOOR", low - 10)
    assert low <= ports.free_port() <= high
