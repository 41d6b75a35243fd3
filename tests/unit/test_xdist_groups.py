"""The suite's layout relies on ``--dist loadgroup`` keeping each ``xdist_group`` on one worker:
the tests of the 3-node cluster share one cluster per group (tests/conftest.py). A pytest and
pytest-xdist pair that scatters a group (pytest-xdist#1386) would start a cluster on every
worker that gets one of its tests, silently; this catches it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

GROUPED = """
import os
import pytest

pytestmark = pytest.mark.xdist_group("together")


@pytest.mark.parametrize("i", range(6))
def test_grouped(i):
    with open("workers.txt", "a") as out:
        out.write(os.environ["PYTEST_XDIST_WORKER"] + "\\n")
"""


def test_loadgroup_runs_a_group_on_one_worker(tmp_path: Path) -> None:
    (tmp_path / "test_grouped.py").write_text(GROUPED)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_", "PYTHONPATH"))}
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-n", "2", "--dist", "loadgroup", "-q",
         "-p", "no:cacheprovider", "test_grouped.py"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    workers = (tmp_path / "workers.txt").read_text().split()
    assert len(workers) == 6
    assert len(set(workers)) == 1, f"one group ran on workers {sorted(set(workers))}"
