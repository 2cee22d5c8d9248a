"""Free TCP ports for the stores that ranks rendezvous on.

Binding to port 0 gets a port from the kernel's ephemeral range, which is also where every
outgoing connection on the host gets its local port (Ray alone opens hundreds): between the
pick and the store's own bind, such a connection can take it (EADDRINUSE, seen with two test
suites side by side). A port below that range is never handed out by the kernel, so only
another explicit pick can collide, and picks at random over thousands of ports rarely do.
"""

from __future__ import annotations

import random
import socket
from pathlib import Path

#: the lowest port picked (below it: registered services' ports)
PORT_FLOOR = 20000
_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")


def ephemeral_range() -> tuple[int, int]:
    """The kernel's ephemeral port range (Linux's default where it cannot be read)."""
    try:
        low, high = (int(x) for x in _RANGE.read_text().split())
    except (OSError, ValueError):
        return 32768, 60999
    return low, high


def free_port(host: str = "", attempts: int = 64) -> int:
    """A TCP port free on ``host`` now, below the ephemeral range where there is room (a
    kernel-assigned port otherwise)."""
    low, _ = ephemeral_range()
    pick = random.SystemRandom()
    for _ in range(attempts if low - PORT_FLOOR >= 1000 else 0):
        port = pick.randrange(PORT_FLOOR, low)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
        return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])
