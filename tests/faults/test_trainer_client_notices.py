"""A trainer's mistakes and waits are said, not silent (issue 41, item 3; notices.py).

Tried as a trainer would: a task-name typo waited for ever with no message (only
``missing_tasks()`` showed it); a group-id typo silently re-read everything; a restart after
SIGKILL stalled 9-10 s with no word (the group waits for the killed member until its session
times out). Each now logs a WARNING saying what is waited for and what to do; a restart with
``group_instance_id`` (static membership, KIP-345; aiokafka 0.14 sends it) takes the killed
run's place at once.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import subprocess
import sys
import time
from typing import Any

import pytest
from replay_support import publish_replay, settings_with_replay
from support import env_for, make_episodes

from trajbus.consumers.replay import notices
from trajbus.consumers.replay.client import ReplayClient

pytestmark = [pytest.mark.kafka, pytest.mark.timeout(180)]

LOGGER = "trajbus.consumers.replay.client"


def _lines(caplog: pytest.LogCaptureFixture, text: str) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.name == LOGGER and r.levelno >= logging.WARNING and text in r.getMessage()]


async def _wait_for_line(caplog: pytest.LogCaptureFixture, text: str, timeout: float) -> str:
    deadline = time.monotonic() + timeout
    while not (found := _lines(caplog, text)):
        assert time.monotonic() < deadline, f"no log line with {text!r} within {timeout} s"
        await asyncio.sleep(0.1)
    return found[0]


async def test_a_task_without_a_replay_topic_is_warned_about_after_a_bounded_wait(
        kafka_broker: Any, unique_name: str, caplog: pytest.LogCaptureFixture,
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(notices, "MISSING_TASK_WARN_AFTER_S", 1.0)
    monkeypatch.setattr(notices, "MISSING_TASK_WARN_EVERY_S", 1.0)
    caplog.set_level(logging.WARNING, LOGGER)
    settings = await settings_with_replay(kafka_broker.bootstrap, unique_name, "web-shop", 1,
                                          seed=51)
    async with ReplayClient(["web-shp"], f"{unique_name}-typo", settings):
        line = await _wait_for_line(caplog, "have no replay topic", 30)
        assert "['web-shp']" in line and "did you mean 'web-shop'" in line, line
        assert "list_tasks()" in line and "web-shop" in line, line
        # the task appears later (the fleet started after the trainer): said once more
        await publish_replay(settings, "web-shp", make_episodes(1, seed=52, task="web-shp"))
        await _wait_for_line(caplog, "now has a replay topic", 30)
    warnings = _lines(caplog, "have no replay topic")
    assert 1 <= len(warnings) <= 10, warnings  # bounded: one per interval


async def test_a_new_group_is_said_once_with_the_similar_existing_groups(
        kafka_broker: Any, unique_name: str, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, LOGGER)
    settings = await settings_with_replay(kafka_broker.bootstrap, unique_name, "web-shop", 2,
                                          seed=53)
    group = f"{unique_name}-trainer-main"
    for _ in range(2):  # a new group, then the same one resumed: said the first time only
        async with ReplayClient("web-shop", group, settings) as client:
            async for ep in client.episodes(idle_timeout=2):
                await client.ack(ep)
            await asyncio.sleep(0.5)  # the notice is logged beside start(), not in it
    said = _lines(caplog, "has no committed offsets")
    assert len(said) == 1 and group in said[0], said
    assert "earliest retained record" in said[0]
    caplog.clear()
    typo = f"{unique_name}-trainer-mian"
    async with ReplayClient("web-shop", typo, settings):
        line = await _wait_for_line(caplog, "has no committed offsets", 20)
    assert f"similar names: {group}" in line, line
    caplog.clear()
    async with ReplayClient("web-shop", f"{unique_name}-x", settings, start="earliest"):
        await asyncio.sleep(1.0)
    assert _lines(caplog, "has no committed offsets") == []  # asked for: nothing to say


_TRAINER = """
import asyncio, sys
from trajbus.consumers.replay.client import ReplayClient

async def main() -> None:
    static = {"group_instance_id": sys.argv[2]} if sys.argv[2] else {}
    async with ReplayClient("web-shop", sys.argv[1], **static) as client:
        async for ep in client.episodes():
            await client.ack(ep)
            print("joined", flush=True)
            await asyncio.sleep(3600)  # killed here

asyncio.run(main())
"""


def _killed_trainer(settings: Any, group: str, instance: str) -> None:
    """A trainer process that joined ``group``, then was SIGKILLed (no LeaveGroup)."""
    env = env_for(settings)
    env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
    proc = subprocess.Popen([sys.executable, "-c", _TRAINER, group, instance], env=env,
                            stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == "joined"
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)


async def _time_to_join(settings: Any, group: str, instance: str | None) -> float:
    started = time.monotonic()
    static: dict[str, Any] = {"group_instance_id": instance} if instance else {}
    async with ReplayClient("web-shop", group, settings, **static) as c:
        assert c._consumer is not None
        while not c._consumer.assignment():
            await asyncio.sleep(0.05)
            # the fetch loop is what lets the group settle
            async for _ in c.segments(idle_timeout=0.1):
                pass
        return time.monotonic() - started


async def _join_after_a_killed_run(settings: Any, group: str, instance: str | None) -> float:
    """Seconds a trainer (``instance``: its group_instance_id) takes to join ``group`` right
    after a run of it with the same ``instance`` was SIGKILLed."""
    await asyncio.to_thread(_killed_trainer, settings, group, instance or "")
    return await _time_to_join(settings, group, instance)


async def test_a_restart_waits_for_the_killed_runs_session_and_says_so(
        kafka_broker: Any, unique_name: str, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, LOGGER)
    settings = await settings_with_replay(kafka_broker.bootstrap, unique_name, "web-shop", 4,
                                          seed=54)
    took = await _join_after_a_killed_run(settings, f"{unique_name}-restart", None)
    assert took > notices.JOIN_WAIT_LOG_AFTER_S, took  # the case in question: a stall
    line = _lines(caplog, "to join the group")[0]
    assert "member(s)" in line and "session times out" in line, line
    assert "group_instance_id" in line, line
    assert _lines(caplog, "joined the group after"), "the end of the wait is said too"


async def test_a_restart_with_a_group_instance_id_takes_the_killed_runs_place_at_once(
        kafka_broker: Any, unique_name: str, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, LOGGER)
    settings = await settings_with_replay(kafka_broker.bootstrap, unique_name, "web-shop", 4,
                                          seed=55)
    took = await _join_after_a_killed_run(settings, f"{unique_name}-static", "trainer-0")
    assert took < notices.SESSION_TIMEOUT_S / 2, took
    assert _lines(caplog, "to join the group") == []
