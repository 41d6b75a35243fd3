"""The soak's short form, in CI: one pipeline run of `make soak` (tests/soak.py) on a private
broker, with both CPU cores saturated by competing processes (two hogs; beside other
pytest-xdist workers, whose processes already compete for the cores, the hogs only fill idle
CPU), the worker SIGKILLed and restarted mid-run and the broker restarted mid-run; the run must
pass the demo's exact check (trainer view, replay topics raw, loops, lifecycles, no dead letter
or anomaly, archive)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import soak

pytestmark = [pytest.mark.kafka, pytest.mark.slow, pytest.mark.timeout(600)]


def test_one_soak_run_under_cpu_hogs_worker_kill_and_broker_restart_is_exact(
        tmp_path: Path) -> None:
    code = soak.main(["--runs", "1", "--sandboxes", "16", "--episodes", "2", "--hogs", "2",
                      "--hog-niceness", str(soak.hog_niceness_beside_other_tests()),
                      "--work", str(tmp_path)])
    [result] = [json.loads(line) for line in (tmp_path / "results.jsonl").read_text()
                .splitlines()]
    faults = " ".join(result["faults"])
    assert "SIGKILLed" in faults and "broker restarted" in faults, result
    assert code == 0 and result["ok"], result["output_tail"]
