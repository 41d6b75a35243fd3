"""What-if replay on a real demo run (issue 40): the pipeline runs on a simulated fleet through a
real broker and a worker process; then `trajbus whatif`, run as an operator runs it, re-runs the
watchdog and the scheduler over that log. With the recorded rules it reproduces every recorded
decision and alert exactly (the self-check passes, the diff is empty); with a higher loop
threshold the planted loops' terminations go away, and the self-check still passes."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from support import REPO, env_for, settings_for

from trajbus.bus.settings import ArchiveSettings
from trajbus.pipeline_demo import run_pipeline

pytestmark = [pytest.mark.kafka, pytest.mark.timeout(400)]


def _whatif(env: dict[str, str], *argv: str) -> tuple[int, dict[str, Any], str]:
    proc = subprocess.run([sys.executable, "-m", "trajbus", "whatif", *argv, "--json"],
                          env=env, cwd=REPO, capture_output=True, text=True, timeout=180,
                          check=False)
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    return proc.returncode, json.loads(proc.stdout), proc.stderr


async def test_whatif_on_a_demo_run_reproduces_the_recorded_decisions(
        kafka_broker: Any, unique_name: str, tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    settings = settings_for(kafka_broker.bootstrap, unique_name, partitions=2,
                            archive=ArchiveSettings(url=str(tmp_path / "archive"),
                                                    spool_dir=str(tmp_path / "spool")))
    code = await run_pipeline(settings, sandboxes=8, episodes=1, seed=4242,
                              work_root=tmp_path / "work", settle_timeout_s=90)
    assert code == 0
    manifest = json.loads((tmp_path / "work" / "4242" / "manifest.json").read_text())
    assert manifest["loops"], "the seed plants loops"
    env = env_for(settings)

    rc, same, _ = _whatif(env)
    check = same["self_check"]
    assert rc == 0 and check["passed"], check["mismatches"]
    assert check["unchecked"] == [] and check["compared"] > 0
    assert check["reproduced"] == check["compared"]
    assert same["sandboxes"] == [] and same["totals"]["unchanged"] == check["compared"]

    rc, looser, _ = _whatif(env, "--set", "watchdog.loop_min_repeats=1000")
    assert rc == 0 and looser["self_check"]["passed"]
    removed = {(c["sandbox"], c["processor"], c["label"])
               for s in looser["sandboxes"] for c in s["changes"] if c["change"] == "removed"}
    for lp in manifest["loops"]:  # every planted loop's alert and termination is gone
        assert (lp["sandbox"], "watchdog", "LOOP") in removed, lp
        assert (lp["sandbox"], "watchdog", "TERMINATE") in removed, lp
    assert not any(c["change"] == "added" and c["processor"] == "watchdog"
                   for s in looser["sandboxes"] for c in s["changes"])

    html = tmp_path / "whatif.html"
    proc = subprocess.run([sys.executable, "-m", "trajbus", "whatif", "--set",
                           "loop_min_repeats=1000", "--html", str(html), "--quiet"], env=env,
                          cwd=REPO, capture_output=True, text=True, timeout=180, check=False)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.startswith("self-check passed")
    assert "watchdog.loop_min_repeats 20 -> 1000" in proc.stdout
    assert "self-check passed" in html.read_text()

    proc = subprocess.run([sys.executable, "-m", "trajbus", "whatif", "--sandbox", "sb-nope"],
                          env=env, cwd=REPO, capture_output=True, text=True, timeout=180,
                          check=False)
    assert proc.returncode == 1 and "no events of sandbox 'sb-nope'" in proc.stderr
    assert "existing sandboxes:" in proc.stderr and "Traceback" not in proc.stderr

    # the README's notebook snippet, against this run (settings from the environment)
    from readme_support import snippets

    from trajbus.bus.settings import get_settings

    (snippet,) = snippets("For operators", "python")
    for k, v in env.items():
        if k.startswith("TRAJBUS_"):
            monkeypatch.setenv(k, v)
    get_settings.cache_clear()
    try:
        scope: dict[str, Any] = {}
        await asyncio.to_thread(exec, snippet.code, scope)  # whatif() runs its own loop
        diff = scope["diff"]
        assert diff.self_check.passed and diff.rules[0][0] == "scheduler.lease_ttl_ms"
    finally:
        get_settings.cache_clear()
