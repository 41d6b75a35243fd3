"""The lint (`make lint`: ruff, then mypy through .ci/typecheck.py) passes on the checkout, and
its mypy run type-checks calls between trajbus's modules: `trajbus.bus`, `trajbus.consumers`,
... resolve to the checked-out folders (laid out as the installed package), not to `Any`."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

# one worker, in this order: the planted check then reads mypy's cache that the lint wrote
pytestmark = [pytest.mark.timeout(600), pytest.mark.xdist_group("mypy-cache")]


def test_make_lint_is_clean() -> None:
    # -o: never reinstall the virtualenv from here, even if pyproject.toml is newer than it
    run = subprocess.run(["make", "--no-print-directory", "-o", ".venv/.installed", "lint"],
                         cwd=ROOT, capture_output=True, text=True, timeout=540)
    assert run.returncode == 0, run.stdout + run.stderr


def test_a_wrong_argument_to_another_trajbus_module_is_reported(tmp_path: Path) -> None:
    planted = tmp_path / "planted.py"
    planted.write_text(
        "from trajbus.bus.positions import resolve_offsets\n"
        "from trajbus.consumers.replay.client import ReplayClient\n\n\n"
        "async def f(consumer: object) -> None:\n"
        "    await resolve_offsets(consumer, [], 'resume')\n"
        "    ReplayClient(['t'], group_id=7)\n")
    run = subprocess.run(
        [sys.executable, str(ROOT / ".ci" / "typecheck.py"), str(planted)],
        cwd=ROOT, capture_output=True, text=True, timeout=540)
    out = run.stdout + run.stderr
    assert run.returncode == 1, out
    assert 'Argument 3 to "resolve_offsets" has incompatible type' in out, out
    assert 'Argument "group_id" to "ReplayClient" has incompatible type "int"' in out, out
    assert "import-not-found" not in out and "import-untyped" not in out, out
