"""In CI a machine that cannot run the Kafka broker must FAIL the test run, not skip every
broker test (issue 14, finding 8): a CI box without Java would otherwise go green with no
Kafka test run. Locally, without ``CI``, those tests still skip with the reason.

Checked end to end: a pytest subprocess runs two probe tests through the real fixtures
(``kafka_broker`` from conftest.py and ``faults_support.own_broker``) on a machine made
broker-less in the two ways the launcher (``trajbus.infra.broker``) can notice: no ``java`` on
PATH, or ``TRAJBUS_KAFKA_LIB_DIR`` pointing at a directory without Kafka jars. Also: ``.ci/run``
exports ``CI=true`` (keeping a value already set) and runs exactly ``make test``.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from support import REPO, ci_enabled

PROBE = '''
from faults_support import own_broker
from conftest import kafka_broker  # noqa: F401  (the real session fixture)


def test_probe_session_broker(kafka_broker):
    raise AssertionError("a broker started although none can run here")


def test_probe_own_broker(tmp_path):
    with own_broker(tmp_path / "kafka"):
        raise AssertionError("a broker started although none can run here")
'''


def _run_probe(tmp_path: Path, ci: str | None, breakage: str) -> subprocess.CompletedProcess[str]:
    probe = tmp_path / "test_probe_broker_missing.py"
    probe.write_text(PROBE)
    env = {k: v for k, v in os.environ.items()
           if k not in ("CI", "TRAJBUS_TEST_BOOTSTRAP", "TRAJBUS_KAFKA_LIB_DIR",
                        "PYTEST_ADDOPTS", "PYTEST_XDIST_WORKER")}
    if ci is not None:
        env["CI"] = ci
    if breakage == "no-java":
        # Nothing on PATH at all (so no java); the interpreter is called by absolute path.
        empty = tmp_path / "empty-bin"
        empty.mkdir()
        env["PATH"] = str(empty)
        if not any((REPO / "infra" / "kafka" / "lib").glob("kafka_2.13-*.jar")):
            pytest.skip("needs the fetched jars, so that java is the missing piece")
    elif breakage == "no-jars":
        jarless = tmp_path / "no-jars"
        jarless.mkdir()
        env["TRAJBUS_KAFKA_LIB_DIR"] = str(jarless)
    else:
        raise AssertionError(breakage)
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-c", str(REPO / "pyproject.toml"),
         "--rootdir", str(REPO), "-p", "no:cacheprovider", "-p", "no:randomly",
         "--basetemp", str(tmp_path / "inner"), "-rfEs", "-q", str(probe)],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)


def _outcomes(out: str) -> dict[str, int]:
    tail = out.strip().splitlines()[-1] if out.strip() else ""
    return {word: int(n) for n, word in re.findall(r"(\d+) (passed|failed|errors?|skipped)",
                                                   tail)}


@pytest.mark.timeout(180)
@pytest.mark.parametrize(("ci", "breakage"), [("true", "no-java"), ("1", "no-jars"),
                                              ("yes", "no-java")])
def test_ci_run_fails_when_no_broker_can_run(tmp_path: Path, ci: str, breakage: str) -> None:
    res = _run_probe(tmp_path, ci, breakage)
    out = res.stdout + res.stderr
    assert res.returncode == 1, out  # 1 = tests failed/errored (not 0 = green, not 5 = none)
    counts = _outcomes(res.stdout)
    # the session fixture fails in set-up (an error), own_broker inside the test (a failure)
    assert counts.get("error", 0) + counts.get("errors", 0) == 1, out
    assert counts.get("failed") == 1 and "skipped" not in counts and "passed" not in counts, out
    assert "cannot run a local Kafka broker" in out, out
    assert "the Kafka tests must run, not skip" in out, out
    want = "java` not found on PATH" if breakage == "no-java" else "holds no kafka_2.13-*.jar"
    assert want in out, out
    assert "a broker started although none can run here" not in out, out


@pytest.mark.timeout(180)
@pytest.mark.parametrize(("ci", "breakage"), [(None, "no-java"), ("false", "no-jars"),
                                              ("0", "no-java"), ("", "no-jars")])
def test_local_run_skips_with_the_reason_when_no_broker_can_run(
        tmp_path: Path, ci: str | None, breakage: str) -> None:
    res = _run_probe(tmp_path, ci, breakage)
    out = res.stdout + res.stderr
    assert res.returncode == 0, out
    assert _outcomes(res.stdout) == {"skipped": 2}, out
    assert "cannot run a local Kafka broker" in out and "set CI=true" in out, out


@pytest.mark.parametrize(("value", "expected"), [
    (None, False), ("", False), ("false", False), ("FALSE", False), ("0", False), ("no", False),
    ("off", False), (" false ", False), ("true", True), ("True", True), ("1", True),
    ("yes", True), ("on", True)])
def test_ci_enabled_reads_the_ci_variable(value: str | None, expected: bool) -> None:
    assert ci_enabled({} if value is None else {"CI": value}) is expected


@pytest.mark.parametrize(("preset", "expected"), [(None, "true"), ("1", "1")])
def test_ci_script_sets_ci_and_runs_exactly_make_test(tmp_path: Path, preset: str | None,
                                                      expected: str) -> None:
    """``.ci/run`` with a stand-in ``make`` first on PATH: it is called once, as ``make test``,
    with ``CI`` exported (``true`` unless the CI system already set it)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    record = tmp_path / "make-calls"
    fake = bin_dir / "make"
    fake.write_text(f'#!/bin/sh\nprintf "%s|%s\\n" "${{CI-unset}}" "$*" >> "{record}"\n')
    fake.chmod(0o755)
    env = {k: v for k, v in os.environ.items() if k != "CI"}
    env["PATH"] = f"{bin_dir}{os.pathsep}{env.get('PATH', '')}"
    if preset is not None:
        env["CI"] = preset
    res = subprocess.run([str(REPO / ".ci" / "run")], env=env, capture_output=True, text=True,
                         timeout=60)
    assert res.returncode == 0, res.stdout + res.stderr
    assert record.read_text().splitlines() == [f"{expected}|test"]
