"""`trajbus worker` options: the removed faust engine explains itself instead of starting."""

from __future__ import annotations

import subprocess
import sys

from support import REPO


def test_engine_faust_is_refused_with_the_reason_and_exit_2() -> None:
    proc = subprocess.run([sys.executable, "-m", "trajbus", "worker", "--engine", "faust"],
                          capture_output=True, text=True, timeout=60, cwd=REPO)
    assert proc.returncode == 2
    assert "faust engine was removed" in proc.stderr
    assert "Traceback" not in proc.stderr
