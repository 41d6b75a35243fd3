"""The README's trainer section is a test: every Python example runs as is against a real
broker (in its own process, configured only by ``TRAJBUS_`` variables, as a trainer's
program would be) and prints exactly the output shown below it.

The data is the one the README describes: task ``web-shop`` with 3 episodes and
``swe-bench`` with 2; ``math-proof`` gets its topic and 1 episode only while the "before the
fleet" example is already waiting for it. Consumer groups named ``trainer-*`` get this run's
prefix, so a rerun against the same broker starts from scratch.
"""

from __future__ import annotations

import asyncio
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from readme_support import Snippet, snippets
from replay_support import publish_replay
from support import env_for, make_episodes, settings_for

pytestmark = [pytest.mark.kafka, pytest.mark.timeout(300)]

SNIPPETS = snippets("For trainers", "python")
LATE_TASK = "math-proof"


def test_the_section_has_the_examples_it_promises() -> None:
    code = "\n".join(s.code for s in SNIPPETS)
    for name in ("list_tasks(", "ALL_TASKS", "task_pattern=", 'start="earliest"', '"latest"',
                 '"-1h"', "datetime", "missing_tasks(", "SyncReplayClient", "break",
                 "max_in_flight=", ".complete", "fragment_reason", "if await client.ack(",
                 "commit()"):
        assert name in code, f"README trainer section lacks an example of {name}"
    assert all(s.output is not None for s in SNIPPETS), "each example shows its output"


def _run(snippet: Snippet, env: dict[str, str], cwd: Path,
         on_first_line: object = None) -> str:
    proc = subprocess.Popen([sys.executable, "-c", snippet.code], env=env, cwd=cwd,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    first = ""
    if callable(on_first_line):
        first = proc.stdout.readline()  # blocks until the example prints its first line
        on_first_line()
    out, err = proc.communicate(timeout=180)
    assert proc.returncode == 0, f"README.md line {snippet.line}: exit {proc.returncode}\n{err}"
    assert "Traceback" not in err, err
    return first + out


def test_every_trainer_example_runs_and_prints_what_the_readme_shows(
        kafka_broker: object, unique_name: str, tmp_path: Path) -> None:
    settings = settings_for(kafka_broker.bootstrap, unique_name)  # type: ignore[attr-defined]
    asyncio.run(publish_replay(settings, "web-shop", make_episodes(3, seed=21, task="web-shop")))
    asyncio.run(publish_replay(settings, "swe-bench",
                               make_episodes(2, seed=22, task="swe-bench")))
    env = env_for(settings)
    env.pop("TRAJBUS_DEBUG", None)
    env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)

    def late_fleet() -> None:
        asyncio.run(publish_replay(settings, LATE_TASK,
                                   make_episodes(1, seed=23, task=LATE_TASK)))

    mismatches = []
    for snippet in SNIPPETS:
        code = re.sub(r'"trainer-', f'"{unique_name}-trainer-', snippet.code)
        runnable = Snippet(snippet.lang, code, snippet.output, snippet.line)
        hook = late_fleet if f'["{LATE_TASK}"]' in code else None
        out = _run(runnable, env, tmp_path, hook)
        if out != snippet.output:
            mismatches.append(f"README.md line {snippet.line}: printed\n{out}\nREADME shows\n"
                              f"{snippet.output}")
    assert mismatches == [], "\n".join(mismatches)
