"""Operators' endpoints and logs of the long-running processes (issue 37 item 4).

`trajbus worker --metrics-port P` and `trajbus archive run --metrics-port P`, as operators run
them (subprocesses, a real broker), serve ``/metrics``, ``/healthz`` (alive, loop responsive)
and ``/readyz`` (connected, partitions assigned and restored); without ``-v`` they still log
which partitions they took over, and ``TRAJBUS_LOG_FORMAT=json`` makes every line a JSON
object. Before: only the worker had ``/metrics`` (no health or readiness endpoints), the
archiver had none, and a worker without ``-v`` never said that it took partitions over.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families
from support import REPO, env_for, settings_for

from trajbus.bus.ops import OpsServer
from trajbus.infra.broker import free_port

pytestmark = [pytest.mark.kafka, pytest.mark.timeout(240)]


def get(port: int, path: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def wait_for(port: int, path: str, status: int, proc: subprocess.Popen[bytes],
             log: Path, timeout: float = 90) -> str:
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"exited {proc.returncode}: {log.read_text()[-2000:]}"
        try:
            code, body = get(port, path)
            last = (code, body)
            if code == status:
                return body
        except OSError as exc:
            last = exc
        time.sleep(0.3)
    raise AssertionError(f"{path} never answered {status}; last {last}; log "
                         f"{log.read_text()[-2000:]}")


def exported_names(text: str) -> set[str]:
    """The sample names a Prometheus scrape of ``text`` offers (also for families without a
    sample yet: a counter ``x`` offers ``x_total``, a histogram ``x_bucket``/``_sum``/...)."""
    names: set[str] = set()
    for fam in text_string_to_metric_families(text):
        suffixes = {"counter": ("_total", "_created"),
                    "histogram": ("_bucket", "_sum", "_count", "_created"),
                    "summary": ("_sum", "_count", "_created")}.get(fam.type, ("",))
        names.update(fam.name + s for s in suffixes)
        names.update(s.name for s in fam.samples)
    return names


def committed_transactions(port: int) -> float:
    return sum(s.value for f in text_string_to_metric_families(get(port, "/metrics")[1])
               for s in f.samples if s.name == "trajbus_transactions_total"
               and s.labels["outcome"] == "committed")


@dataclass
class Running:
    proc: subprocess.Popen[bytes]
    port: int
    log: Path
    env: dict[str, str]

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)


def _start(args: list[str], env: dict[str, str], log: Path) -> Running:
    port = free_port()
    out = open(log, "wb")
    proc = subprocess.Popen([sys.executable, "-m", "trajbus", *args, "--metrics-port",
                             str(port)], env=env, cwd=REPO, stdout=out, stderr=out)
    return Running(proc, port, log, env)


@pytest.fixture(scope="module")
def processes(kafka_broker: Any, tmp_path_factory: pytest.TempPathFactory
              ) -> Iterator[dict[str, Running]]:
    """A worker (reorder, watchdog, scheduler; no -v; JSON log) and an archiver."""
    tmp = tmp_path_factory.mktemp("ops")
    prefix = f"t-ops-{uuid.uuid4().hex[:8]}"
    settings = settings_for(kafka_broker.bootstrap, prefix)
    env = env_for(settings, TRAJBUS_LOG_FORMAT="json", TRAJBUS_STATE_DIR=str(tmp / "state"),
                  TRAJBUS_ARCHIVE__URL=str(tmp / "archive"),
                  TRAJBUS_ARCHIVE__SPOOL_DIR=str(tmp / "spool"))
    env.pop("TRAJBUS_DEBUG", None)
    subprocess.run([sys.executable, "-m", "trajbus", "topics", "create"], env=env, cwd=REPO,
                   check=True, capture_output=True, timeout=120)
    running = {
        "worker": _start(["worker", "--worker-id", "ops-w1"], env, tmp / "worker.log"),
        "archiver": _start(["archive", "run"], env, tmp / "archiver.log"),
    }
    try:
        yield running
    finally:
        for r in running.values():
            r.stop()


@pytest.mark.parametrize("which", ["worker", "archiver"])
def test_healthz_readyz_and_metrics_are_served(processes: dict[str, Running],
                                               which: str) -> None:
    r = processes[which]
    ready = json.loads(wait_for(r.port, "/readyz", 200, r.proc, r.log))
    assert ready["status"] == "ready"
    code, body = get(r.port, "/healthz")
    assert code == 200 and json.loads(body)["status"] == "ok"
    code, text = get(r.port, "/metrics")
    assert code == 200
    names = exported_names(text)
    if which == "worker":
        assert {p for p in ready["processors"]} == {"reorder", "watchdog", "scheduler"}
        for name in ("trajbus_transactions_total", "trajbus_restore_seconds_count",
                     "trajbus_consumer_lag_records", "trajbus_dead_letters_total",
                     "trajbus_reorder_conflicts_total", "trajbus_reorder_late_total"):
            assert name in names, name
        # the ticks' batches commit transactions while the worker is idle
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and not committed_transactions(r.port):
            time.sleep(0.5)
        assert committed_transactions(r.port) > 0
    else:
        # 2 partitions each of events, traces, decisions, alerts and dead letters
        assert ready["assigned_partitions"] == 10
        for name in ("trajbus_archiver_batches_total", "trajbus_archiver_bytes_total",
                     "trajbus_archiver_store_errors_total", "trajbus_archiver_freshness_seconds",
                     "trajbus_consumer_lag_records", "trajbus_dead_letters_total"):
            assert name in names, name
    assert get(r.port, "/nope")[0] == 404


def test_takeovers_are_logged_without_v_as_json(processes: dict[str, Running]) -> None:
    for which, needle in (("worker", "reorder (t-ops-"), ("archiver", "archiver (group ")):
        r = processes[which]
        wait_for(r.port, "/readyz", 200, r.proc, r.log)
        lines = [json.loads(line) for line in r.log.read_text().splitlines()
                 if line.startswith("{")]
        assert lines, r.log.read_text()[-2000:]
        assert all({"ts", "level", "logger", "message"} <= set(x) for x in lines)
        takeovers = [x for x in lines if x["logger"] == "trajbus.ops"
                     and x["message"].startswith(needle) and "assigned" in x["message"]]
        assert takeovers and takeovers[0]["level"] == "INFO", lines


def test_healthz_fails_while_the_event_loop_is_blocked() -> None:
    """A loop that stopped turning (a blocking call, a deadlock) answers 503; /metrics still
    answers (the server has a thread of its own)."""
    got: dict[str, tuple[int, str]] = {}

    async def main() -> None:
        server = OpsServer("127.0.0.1", 0, lambda: (False, {"why": "restoring"}),
                           stale_after_s=0.5)
        try:
            server.attach()
            await asyncio.sleep(0.7)
            got["before"] = get(server.port, "/healthz")
            got["ready"] = get(server.port, "/readyz")

            def probe() -> None:
                time.sleep(1.2)
                got["blocked"] = get(server.port, "/healthz")
                got["metrics"] = get(server.port, "/metrics")

            t = threading.Thread(target=probe)
            t.start()
            time.sleep(2.0)  # the loop blocked
            t.join()
            await asyncio.sleep(0.7)
            got["after"] = get(server.port, "/healthz")
        finally:
            server.close()

    asyncio.run(main())
    assert got["before"][0] == 200
    assert got["blocked"][0] == 503 and json.loads(got["blocked"][1])["status"] == "unresponsive"
    assert got["metrics"][0] == 200
    assert got["after"][0] == 200
    assert got["ready"][0] == 503 and json.loads(got["ready"][1])["why"] == "restoring"


MONITORING = REPO / "infra" / "monitoring"


def _queries() -> dict[str, list[str]]:
    import yaml

    rules = yaml.safe_load((MONITORING / "trajbus-alerts.yml").read_text())
    dash = json.loads((MONITORING / "trajbus-dashboard.json").read_text())
    return {
        "rules": [r["expr"] for g in rules["groups"] for r in g["rules"]],
        "dashboard": [t["expr"] for p in dash["panels"] for t in p.get("targets", [])],
    }


def test_the_alert_rules_pass_promtool() -> None:
    import shutil

    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("no promtool (Debian/Ubuntu: apt-get install prometheus; `make setup` "
                    "installs it as root); the metric names are still checked below")
    got = subprocess.run([promtool, "check", "rules", str(MONITORING / "trajbus-alerts.yml")],
                         capture_output=True, text=True, timeout=60)
    assert got.returncode == 0, got.stdout + got.stderr


def test_every_metric_the_rules_and_dashboard_query_is_exported(
        processes: dict[str, Running]) -> None:
    """The rules and the dashboard shipped in infra/monitoring/ query only names that a
    running worker or archiver exports (scraped from their /metrics), so a renamed metric
    cannot leave an alert that never fires."""
    import re

    exported: set[str] = set()
    for r in processes.values():
        wait_for(r.port, "/readyz", 200, r.proc, r.log)
        exported |= exported_names(get(r.port, "/metrics")[1])
    queries = _queries()
    assert len(queries["rules"]) >= 10 and len(queries["dashboard"]) >= 15
    for where, exprs in queries.items():
        used = {n for e in exprs for n in re.findall(r"\btrajbus_[a-z0-9_]+", e)}
        assert used, where
        missing = sorted(used - exported)
        assert not missing, f"{where} query metrics nobody exports: {missing}"


def test_status_lists_the_archiver_with_its_members_and_lag(
        processes: dict[str, Running]) -> None:
    """`trajbus status` shows the archiver's consumer group like a processor's (it was not
    listed at all)."""
    r = processes["archiver"]
    wait_for(r.port, "/readyz", 200, r.proc, r.log)
    got = subprocess.run([sys.executable, "-m", "trajbus", "status"], env=r.env, cwd=REPO,
                         capture_output=True, text=True, timeout=120)
    assert got.returncode == 0, got.stderr
    lines = got.stdout.splitlines()
    at = next(i for i, line in enumerate(lines) if line.startswith("archivers (lag"))
    assert "archiver.local." in lines[at + 1] and "1 live member" in lines[at + 1], got.stdout
    assert "sandbox.events [0-1]" in lines[at + 2], got.stdout
