"""A bootstrap address that accepts connections but is not a Kafka broker listener (the KRaft
controller port, an HTTP server): every command exits 1 with one clear line saying so, and no
``Task exception was never retrieved`` traceback (issue 37 item 5: seen in 4 of 8 runs
against the controller port). Before, the error said the broker "did not answer (refused after
0.0s)", although something answered."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from support import REPO

pytestmark = [pytest.mark.kafka, pytest.mark.timeout(240)]

COMMANDS = (["status"], ["worker", "--until-idle", "2"], ["archive", "run", "--until-idle"])


@pytest.fixture
def http_port() -> Iterator[int]:
    """A TCP server that answers anything with an HTTP 400 and hangs up."""
    srv = socket.create_server(("127.0.0.1", 0))
    stop = threading.Event()

    def serve() -> None:
        srv.settimeout(0.2)
        while not stop.is_set():
            try:
                conn, _ = srv.accept()
            except OSError:
                continue
            with conn:
                conn.sendall(b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\n\r\n")

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    try:
        yield srv.getsockname()[1]
    finally:
        stop.set()
        t.join(5)
        srv.close()


def _run(args: list[str], bootstrap: str, tmp: Path) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TRAJBUS_")}
    env.update(TRAJBUS_KAFKA__BOOTSTRAP_SERVERS=bootstrap, TRAJBUS_KAFKA__CONNECT_TIMEOUT_S="5",
               TRAJBUS_ARCHIVE__URL=str(tmp / "archive"),
               TRAJBUS_ARCHIVE__SPOOL_DIR=str(tmp / "spool"),
               TRAJBUS_STATE_DIR=str(tmp / "state"))
    return subprocess.run([sys.executable, "-m", "trajbus", *args], env=env, cwd=REPO,
                          capture_output=True, text=True, timeout=90)


@pytest.mark.parametrize("target", ["controller", "http"])
def test_a_port_that_is_no_kafka_listener_gets_one_clear_error(
        kafka_broker: Any, http_port: int, tmp_path: Path, target: str) -> None:
    if target == "controller":
        broker = kafka_broker.require_local()
        address = f"127.0.0.1:{broker.controller_port}"
    else:
        address = f"127.0.0.1:{http_port}"
    for args in COMMANDS:
        got = _run(args, address, tmp_path)
        assert got.returncode == 1, (args, got.stderr)
        assert "Task exception was never retrieved" not in got.stderr, (args, got.stderr)
        assert "Traceback" not in got.stderr, (args, got.stderr)
        error = [line for line in got.stderr.splitlines() if line.startswith("trajbus: error:")]
        assert len(error) == 1, (args, got.stderr)
        assert f"{address} accepted a connection but did not answer as a Kafka broker" in \
            error[0], (args, error[0])
