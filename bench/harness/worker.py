"""The trajbus reorder worker as a subprocess (``python -m trajbus worker --processors reorder
--worker-id ID -v``): its environment, starting, SIGKILL, stopping; and how long its imports
take in a fresh interpreter."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def worker_env(bootstrap: str, prefix: str, partitions: int, base: dict[str, str] | None = None,
               **extra: str) -> dict[str, str]:
    """``base`` (default: this process's environment) with the worker's broker, topic prefix
    and partitions (and ``extra`` variables) set."""
    return {**(os.environ if base is None else base), "TRAJBUS_KAFKA__BOOTSTRAP_SERVERS": bootstrap,
            "TRAJBUS_TOPICS__PREFIX": prefix, "TRAJBUS_TOPICS__PARTITIONS": str(partitions),
            **extra}


class WorkerProc:
    """One worker identity, started again after each SIGKILL or stop (an incarnation). Its
    output goes to ``log`` when given (appended), else to ``log_dir/worker-<n>.log`` for the
    n-th incarnation."""

    def __init__(self, env: dict[str, str], log_dir: Path, worker_id: str = "bench",
                 cwd: Path = ROOT, log: Path | None = None) -> None:
        self.env, self.log_dir, self.worker_id, self.cwd, self.log = (
            env, log_dir, worker_id, cwd, log)
        self.proc: subprocess.Popen[bytes] | None = None
        self.log_path: Path | None = None
        self.incarnation = 0

    def start(self) -> subprocess.Popen[bytes]:
        self.log_path = self.log or self.log_dir / f"worker-{self.incarnation}.log"
        self.incarnation += 1
        cmd = [sys.executable, "-m", "trajbus", "worker", "--processors", "reorder",
               "--worker-id", self.worker_id, "-v"]
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(cmd, env=self.env, cwd=self.cwd, stdout=log, stderr=log)
        return self.proc

    def sigkill(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(timeout=30)

    def stop(self, timeout: float = 30) -> int | None:
        """SIGTERM (SIGKILL after ``timeout`` s); the exit code, None if never started."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait(timeout=10)


def stop_process(proc: subprocess.Popen[bytes]) -> None:
    """Terminate ``proc`` if it runs (killed after 20 s)."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)


def import_time() -> float:
    """Wall seconds of the worker's imports in a fresh interpreter (the first stretch of a
    restart that the worker's log cannot show)."""
    code = ("import trajbus.cli, trajbus.consumers.engine.cli, trajbus.consumers.engine.runner, "
            "trajbus.consumers.engine.processors")
    t = time.monotonic()
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True, timeout=120)
    return round(time.monotonic() - t, 2)
