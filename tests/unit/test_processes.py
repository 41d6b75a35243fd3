"""Freezing a process (a paused broker in the fault tests) is done when ``freeze`` returns."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from trajbus.infra.processes import freeze

SPINNERS = """
import threading, time
def spin():
    while True:
        pass
for _ in range(8):
    threading.Thread(target=spin, daemon=True).start()
print("spinning", flush=True)
time.sleep(600)
"""

pytestmark = pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="needs /proc")


@pytest.fixture
def spinning_process() -> Iterator[subprocess.Popen[str]]:
    proc = subprocess.Popen([sys.executable, "-c", SPINNERS], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline() == "spinning\n"
        yield proc
    finally:
        os.kill(proc.pid, signal.SIGCONT)
        proc.kill()
        proc.wait(10)


def thread_states(pid: int) -> list[str]:
    return [Path(f"/proc/{pid}/task/{tid}/stat").read_text().rsplit(")", 1)[1].split()[0]
            for tid in os.listdir(f"/proc/{pid}/task")]


def test_every_thread_is_stopped_when_freeze_returns(
        spinning_process: subprocess.Popen[str]) -> None:
    # eight runnable threads: right after kill(SIGSTOP) some of them still run
    for _ in range(20):
        freeze(spinning_process.pid)
        states = thread_states(spinning_process.pid)
        assert len(states) == 9 and set(states) == {"T"}, states
        os.kill(spinning_process.pid, signal.SIGCONT)
