"""Local TCP ports for brokers and tests: free ones, never handed out twice, outside the
kernel's ephemeral range.

:func:`free_port` is racy by nature (the port is free when it returns); it guarantees a port
this process was not given before and, where the kernel's range leaves room, one below the
ephemeral range (:func:`ephemeral_ports`). :func:`port_free` tells whether a listener could bind
a port now.
"""

from __future__ import annotations

import random
import socket
from pathlib import Path

DEFAULT_HOST = "127.0.0.1"

_HANDED_OUT: set[int] = set()
_LOW_PORT = 10_000  # below it: well-known services' ports


def ephemeral_ports() -> tuple[int, int]:
    """The kernel's range of local ports for outgoing connections (Linux; else IANA's)."""
    try:
        lo, hi = (int(x) for x in
                  Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
    except (OSError, ValueError):
        return 49152, 65535
    return lo, hi


def free_port(host: str = DEFAULT_HOST) -> int:
    """A TCP port that is free right now on ``host`` (for tests; racy by nature), never one
    this process was given before, and below the kernel's ephemeral range: the port of a node
    that is stopped and started again must stay free meanwhile, and in the ephemeral range any
    outgoing connection of any process may take it as its local port (a 3-node cluster of the
    drill could not bind its listener: "Address already in use")."""
    lo, _ = ephemeral_ports()
    if lo - 1 > _LOW_PORT + 1000:
        rng = random.SystemRandom()
        for _ in range(500):
            port = rng.randint(_LOW_PORT, lo - 1)
            if port not in _HANDED_OUT and port_free(host, port):
                _HANDED_OUT.add(port)
                return port
    for _ in range(100):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind((host, 0))
            port = int(sock.getsockname()[1])
        if port not in _HANDED_OUT:
            _HANDED_OUT.add(port)
            return port
    raise OSError("no free port that was not handed out already")


def port_free(host: str, port: int) -> bool:
    """Whether a listener could bind ``host:port`` now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        # Kafka binds with SO_REUSEADDR too, so TIME_WAIT leftovers do not count as "in use".
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError:
            return False
        return True
