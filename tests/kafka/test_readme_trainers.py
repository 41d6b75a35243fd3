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
from concurrent.futures import ThreadPoolExecutor
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

    def run(snippet: Snippet) -> str | None:
        code = re.sub(r'"trainer-', f'"{unique_name}-trainer-', snippet.code)
        runnable = Snippet(snippet.lang, code, snippet.output, snippet.line)
        hook = late_fleet if f'["{LATE_TASK}"]' in code else None
        out = _run(runnable, env, tmp_path, hook)
        if out == snippet.output:
            return None
        return f"README.md line {snippet.line}: printed\n{out}\nREADME shows\n{snippet.output}"

    def run_chain(chain: list[Snippet]) -> list[str]:
        return [m for m in map(run, chain) if m is not None]

    # The examples before the one that waits for the late task's fleet run side by side (each
    # mostly waits out its idle timeout), those sharing a consumer group in the README's order;
    # from that one on, in order (what they print depends on the late task existing).
    late = next(i for i, s in enumerate(SNIPPETS) if f'["{LATE_TASK}"]' in s.code)
    with ThreadPoolExecutor(max_workers=late) as pool:
        results = list(pool.map(run_chain, _chains_by_group(SNIPPETS[:late])))
    mismatches = [m for chain in results for m in chain] + run_chain(SNIPPETS[late:])
    assert mismatches == [], "\n".join(mismatches)


def _chains_by_group(examples: list[Snippet]) -> list[list[Snippet]]:
    """The examples in chains: two that name the same ``trainer-*`` group are in one chain, in
    the README's order (the later one may read the earlier one's commits)."""
    chains: list[tuple[set[str], list[Snippet]]] = []
    for snippet in examples:
        groups = set(re.findall(r'"(trainer-[\w-]*)"', snippet.code))
        joined = [c for c in chains if c[0] & groups]
        for c in joined:
            chains.remove(c)
        merged_groups = groups.union(*(c[0] for c in joined))
        merged = [*sorted((s for c in joined for s in c[1]), key=lambda s: s.line), snippet]
        chains.append((merged_groups, merged))
    return [c[1] for c in chains]


def test_examples_sharing_a_group_run_in_one_chain_in_order() -> None:
    late = next(i for i, s in enumerate(SNIPPETS) if f'["{LATE_TASK}"]' in s.code)
    chains = _chains_by_group(SNIPPETS[:late])
    resume = next(s for s in SNIPPETS if '"resume"' in s.code)
    chain = next(c for c in chains if resume in c)
    assert [s.line for s in chain] == sorted(s.line for s in chain)
    assert chain.index(resume) > 0  # after the example whose commits it resumes from
    assert sum(len(c) for c in chains) == late
