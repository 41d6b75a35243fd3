"""The mistakes operators actually made, against a real broker: a typo in a task, an unknown
sandbox, an episode given the wrong task, SQL with a typo, deleting a topic that is not a debug
topic, and ``... | head`` (a reader that goes away). Each gets a one-line error saying what
exists or what to do, a non-zero exit, and no traceback (the broker-free half of this promise is
tests/unit/test_cli_hygiene.py).
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from support import REPO, env_for, make_episodes, produce, settings_for
from test_cli_hygiene import NOISE

from trajbus.bus.admin import ensure_base_topics
from trajbus.bus.inventory import topic_names
from trajbus.bus.topics import Topics
from trajbus.cli import EXIT_BROKEN_PIPE


def _cli(env: dict[str, str], *argv: str, stdout: int | None = None
         ) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run([sys.executable, "-m", "trajbus", *argv], env=env, cwd=REPO,
                          stdout=stdout if stdout is not None else subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True, timeout=120, check=False)
    out = (proc.stdout or "") + proc.stderr
    assert not any(n in out for n in NOISE), out
    return proc


@pytest.mark.kafka
@pytest.mark.timeout(300)
def test_operators_mistakes_against_the_broker(kafka_broker: object, unique_name: str,
                                               tmp_path: Path) -> None:
    settings = settings_for(kafka_broker.bootstrap, unique_name)  # type: ignore[attr-defined]
    env = env_for(settings, TRAJBUS_ARCHIVE__URL=str(tmp_path / "archive"))
    topics = Topics(settings)
    eps = make_episodes(2, seed=3, task="web-shop")

    async def setup() -> None:
        await ensure_base_topics(settings, ["web-shop"])
        await produce(settings, topics.sandbox_events,
                      [(e.sandbox, v) for e in eps for v in e.events])

    asyncio.run(setup())

    # `topics list` asks the broker and exits 0
    proc = _cli(env, "topics", "list")
    assert proc.returncode == 0, proc.stderr
    assert topics.replay("web-shop") in proc.stdout and "tasks with a replay topic: web-shop" \
        in proc.stdout

    # a typo in a task: waits quietly, honours --idle-exit, says what exists, exits 1
    started = time.monotonic()
    proc = _cli(env, "replay", "tail", "--task", "web-shopp", "--idle-exit", "3")
    assert proc.returncode == 1
    assert time.monotonic() - started < 60
    assert "web-shopp" in proc.stderr and "existing tasks: web-shop" in proc.stderr
    assert len(proc.stderr.splitlines()) <= 4, proc.stderr  # no log spam

    # unknown sandbox / episode: non-zero, with what exists
    proc = _cli(env, "replay", "events", "--sandbox", "sb-nope")
    assert proc.returncode == 1 and "existing sandboxes: sb-0, sb-1" in proc.stderr
    proc = _cli(env, "replay", "events", "--sandbox", eps[0].sandbox, "--episode", "ep-nope")
    assert proc.returncode == 1 and f"episodes of {eps[0].sandbox}: {eps[0].episode}" \
        in proc.stderr
    for argv in (["watchdog", "explain", "--sandbox", "sb-nope"],
                 ["watchdog", "explain", "--sandbox", "sb-nope", "--from-log"],
                 ["replay", "explain", "--sandbox", "sb-nope"],
                 ["replay", "waterfall", "--sandbox", "sb-nope", "--episode", "e",
                  "--out", str(tmp_path / "w.html")]):
        proc = _cli(env, *argv)
        assert proc.returncode == 1, (argv, proc.stderr)
        assert "sb-nope" in proc.stderr and "existing sandboxes: sb-0, sb-1" in proc.stderr, argv

    # republish with the wrong task: refused, and no debug topic appears
    ep = eps[0]
    proc = _cli(env, "replay", "republish", "--task", "math-proof", "--sandbox", ep.sandbox,
                "--episode", ep.episode)
    assert proc.returncode == 1
    assert "belongs to task web-shop, not 'math-proof'" in proc.stderr
    names = asyncio.run(topic_names(settings))
    assert topics.replay("debug-math-proof") not in names

    # topics delete: only debug topics
    proc = _cli(env, "topics", "delete", topics.sandbox_events)
    assert proc.returncode == 1 and "only debug replay topics" in proc.stderr
    proc = _cli(env, "replay", "republish", "--task", "web-shop", "--sandbox", ep.sandbox,
                "--episode", ep.episode)
    assert proc.returncode == 0, proc.stderr
    proc = _cli(env, "topics", "delete", "debug-web-shop")
    assert proc.returncode == 0 and topics.replay("debug-web-shop") in proc.stdout
    assert topics.replay("debug-web-shop") not in asyncio.run(topic_names(settings))
    proc = _cli(env, "topics", "delete", "debug-web-shop")
    assert proc.returncode == 1 and "no topic" in proc.stderr

    # SQL with a typo: DuckDB's message and a hint (in an archive, empty: not yet written)
    from trajbus.archive.storage import LocalStore, mark_archive

    mark_archive(LocalStore(tmp_path / "archive"))
    proc = _cli(env, "archive", "sql", "SELECT * FROM evnts")
    assert proc.returncode == 1
    assert 'Did you mean "events"' in proc.stderr and "hint:" in proc.stderr

    # a reader that goes away while a Kafka read is printing
    r, w = os.pipe()
    os.close(r)
    try:
        proc = _cli(env, "replay", "events", "--sandbox", ep.sandbox, stdout=w)
    finally:
        os.close(w)
    assert proc.returncode == EXIT_BROKEN_PIPE and proc.stderr == ""
