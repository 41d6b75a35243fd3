"""Is a Kafka broker there? A minimal Kafka protocol client that asks, without a Kafka library.

:func:`probe_broker` sends ApiVersions, then Metadata, and counts the unfenced brokers: a node
answers, and has registered, only once it can serve clients. Nothing there (or something that
does not speak Kafka) is None, never an exception.
"""

from __future__ import annotations

import socket
import struct


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise ConnectionError("connection closed by broker")
        buf += chunk
    return bytes(buf)


def _request(sock: socket.socket, api_key: int, version: int, corr: int, body: bytes) -> bytes:
    client_id = b"trajbus-probe"
    header = struct.pack(">hhih", api_key, version, corr, len(client_id)) + client_id
    payload = header + body
    sock.sendall(struct.pack(">i", len(payload)) + payload)
    (size,) = struct.unpack(">i", _recv_exact(sock, 4))
    resp = _recv_exact(sock, size)
    (resp_corr,) = struct.unpack(">i", resp[:4])
    if resp_corr != corr:
        raise ConnectionError("correlation id mismatch")
    return resp[4:]


def probe_broker(host: str, port: int, timeout: float = 2.0) -> int | None:
    """Ask the broker at host:port for its live brokers using the Kafka wire protocol.

    Returns the number of unfenced brokers in its Metadata response (0 while it is still
    registering), or None if nothing answers the Kafka protocol there.
    """
    try:
        with socket.create_connection((host, port), timeout=timeout) as sock:
            sock.settimeout(timeout)
            # ApiVersions v0: supported by every broker, tells us the Metadata version range.
            resp = _request(sock, api_key=18, version=0, corr=1, body=b"")
            (error,) = struct.unpack(">h", resp[:2])
            if error != 0:
                return None
            (count,) = struct.unpack(">i", resp[2:6])
            md_range: tuple[int, int] | None = None
            for i in range(count):
                key, lo, hi = struct.unpack(">hhh", resp[6 + 6 * i : 12 + 6 * i])
                if key == 3:
                    md_range = (lo, hi)
            # Metadata v4..v8 share a non-flexible layout: throttle_time_ms, then brokers.
            usable = [v for v in range(4, 9) if md_range and md_range[0] <= v <= md_range[1]]
            if not usable:
                return 1  # the broker answers; we cannot count brokers on this version
            version = max(usable)
            body = struct.pack(">i", -1) + b"\x00"  # all topics, no auto-creation
            if version >= 8:
                body += b"\x00\x00"  # include_cluster/topic_authorized_operations = false
            resp = _request(sock, api_key=3, version=version, corr=2, body=body)
            (brokers,) = struct.unpack(">i", resp[4:8])
            return brokers
    except (OSError, ConnectionError, struct.error):
        return None
