"""Operators' HTTP endpoints of a long-running process (``trajbus worker``, ``trajbus archive
run``), on one port (``--metrics-port``):

- ``/metrics``: Prometheus text format (every ``trajbus_*`` metric of the process);
- ``/healthz``: the process is alive and its event loop responsive (a heartbeat task on the
  loop beats every 0.5 s; no beat for ``stale_after_s`` -> 503). For a liveness probe: a
  loop blocked this long is a hung process, and restarting it is the fix;
- ``/readyz``: the process is connected and serving -- its clients started, its consumer
  group joined, its partitions assigned and restored (the process says what, as JSON);
  503 meanwhile (starting, restoring, rebalancing, riding out a broker restart). For a
  readiness probe and for "is the deployment done" checks, not for restarting.

The server runs in a daemon thread, so a blocked event loop still answers ``/healthz`` (with
503) and ``/metrics``.

Also the metric shared by every consumer of the pipeline, :data:`CONSUMER_LAG`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import threading
import time
from collections.abc import Callable, Iterable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, REGISTRY, Gauge, generate_latest

from trajbus.bus.settings import Settings

CONSUMER_LAG = Gauge(
    "trajbus_consumer_lag_records",
    "Records not yet read by this member, per assigned partition: the partition's last stable "
    "offset minus the member's position (transaction markers are already skipped by the "
    "position; the processors' Ticks count until read, so an idle member reads 0 within a "
    "tick interval)", ["group", "topic", "partition"])

ReadyFn = Callable[[], tuple[bool, dict[str, Any]]]

HEARTBEAT_S = 0.5


class OpsServer:
    """``/metrics``, ``/healthz`` and ``/readyz`` on ``host:port`` (port 0: any free port,
    see :attr:`port`)."""

    def __init__(self, host: str, port: int, ready: ReadyFn | None = None, *,
                 stale_after_s: float = 10.0) -> None:
        self.ready = ready
        self.stale_after_s = stale_after_s
        self._beat: float | None = None  # monotonic time of the loop's last heartbeat
        self._task: asyncio.Task[None] | None = None
        server = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                path = self.path.split("?", 1)[0]
                if path == "/metrics":
                    self._send(200, generate_latest(REGISTRY), CONTENT_TYPE_LATEST)
                elif path == "/healthz":
                    self._json(*server.health())
                elif path == "/readyz":
                    self._json(*server.readiness())
                else:
                    self._json(404, {"error": "not found",
                                     "endpoints": ["/metrics", "/healthz", "/readyz"]})

            def _json(self, code: int, body: dict[str, Any]) -> None:
                self._send(code, json.dumps(body, sort_keys=True).encode() + b"\n",
                           "application/json")

            def _send(self, code: int, body: bytes, ctype: str) -> None:
                self.send_response(code)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format: str, *args: Any) -> None:
                pass  # a probe every few seconds is not news

        self.httpd = ThreadingHTTPServer((host, port), Handler)
        self.httpd.daemon_threads = True
        self.port: int = self.httpd.server_address[1]
        self._thread = threading.Thread(target=self.httpd.serve_forever, name="trajbus-ops",
                                        daemon=True)
        self._thread.start()

    # -- the event loop's heartbeat -------------------------------------------------------
    def attach(self) -> asyncio.Task[None]:
        """Start the heartbeat on the running loop (call from it)."""
        async def beat() -> None:
            while True:
                self._beat = time.monotonic()
                await asyncio.sleep(HEARTBEAT_S)

        self._task = asyncio.get_running_loop().create_task(beat(), name="trajbus-heartbeat")
        return self._task

    def health(self) -> tuple[int, dict[str, Any]]:
        if self._beat is None:
            return 200, {"status": "ok", "loop": "not started yet"}
        age = time.monotonic() - self._beat
        if age > self.stale_after_s:
            return 503, {"status": "unresponsive", "loop_silent_s": round(age, 1),
                         "limit_s": self.stale_after_s}
        return 200, {"status": "ok", "loop_silent_s": round(age, 3)}

    def readiness(self) -> tuple[int, dict[str, Any]]:
        if self.ready is None:  # the process has not got as far as its clients yet
            return 503, {"status": "not ready", "starting": True}
        try:
            ok, detail = self.ready()
        except Exception as exc:  # a probe never takes the process down
            return 503, {"status": "not ready", "error": f"{type(exc).__name__}: {exc}"}
        return (200 if ok else 503), {"status": "ready" if ok else "not ready", **detail}

    def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
        self.httpd.shutdown()
        self.httpd.server_close()


async def export_lag(group: str, consumer: Any, every_s: float = 5.0) -> None:
    """Keep :data:`CONSUMER_LAG` of ``consumer``'s assigned partitions current (a task; cancel
    it to stop). Partitions given away are removed from the metric."""
    shown: set[tuple[str, int]] = set()
    while True:
        now: set[tuple[str, int]] = set()
        for tp in sorted(_assignment(consumer)):
            end = consumer.last_stable_offset(tp)
            if end is None:
                end = consumer.highwater(tp)
            if end is None:
                continue
            try:
                pos = await consumer.position(tp)
            except Exception:  # revoked meanwhile, or no position yet
                continue
            CONSUMER_LAG.labels(group, tp.topic, str(tp.partition)).set(max(0, end - pos))
            now.add((tp.topic, tp.partition))
        for topic, partition in shown - now:
            try:
                CONSUMER_LAG.remove(group, topic, str(partition))
            except KeyError:
                pass
        shown = now
        await asyncio.sleep(every_s)


def _assignment(consumer: Any) -> Iterable[Any]:
    try:
        return list(consumer.assignment())
    except Exception:  # not subscribed yet
        return []


def add_ops_arguments(p: argparse.ArgumentParser) -> None:
    """--metrics-port, --metrics-host and --log-format of a long-running process."""
    p.add_argument("--metrics-port", type=int, default=None,
                   help="serve /metrics (Prometheus), /healthz (alive, event loop "
                   "responsive) and /readyz (connected, partitions assigned and restored) on "
                   "this port")
    p.add_argument("--metrics-host", default="127.0.0.1",
                   help="address for --metrics-port (default 127.0.0.1; 0.0.0.0 for a "
                   "Prometheus or probes from outside the host)")
    p.add_argument("--log-format", choices=("text", "json"), default=None,
                   help="log lines as text or one JSON object per line (default: "
                   "TRAJBUS_LOG_FORMAT, else text)")


def start_ops(args: argparse.Namespace, settings: Settings) -> OpsServer | None:
    """Set up the log and, with --metrics-port, the operators' endpoints (bus/ops.py)."""
    from trajbus.bus.logs import setup_logging

    setup_logging(getattr(args, "verbose", False), args.log_format or settings.log_format)
    if not getattr(args, "debug", False):  # --debug: every line of the Kafka client
        from trajbus.bus.logs import limit_client_log

        limit_client_log()
    if args.metrics_port is None:
        return None
    return OpsServer(args.metrics_host, args.metrics_port)



__all__ = ["CONSUMER_LAG", "HEARTBEAT_S", "OpsServer", "ReadyFn", "add_ops_arguments",
           "export_lag", "start_ops"]
