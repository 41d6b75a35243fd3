"""The trainer client's discovery, subscriptions and start positions (issue 16, item 5),
against a real broker: ``list_tasks()``; several tasks, every task (also those created later)
or a pattern; starting at the beginning, the end, a time or the group's commit; a trainer
started before its task's topic exists waits for it instead of crashing, and so does
``trajbus replay tail``."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import threading
import time
from collections.abc import Iterable
from datetime import UTC, datetime, timedelta

import pytest
from replay_support import create_replay_topic, publish_replay
from support import REPO, Episode, env_for, make_episodes, settings_for

from trajbus.bus.settings import KafkaSettings, Settings
from trajbus.consumers.replay.client import (
    ALL_TASKS,
    ReplayClient,
    SyncReplayClient,
    list_tasks,
)

pytestmark = [pytest.mark.kafka, pytest.mark.timeout(180)]


def _ids(eps: Iterable[Episode]) -> set[tuple[str, str, str]]:
    return {(e.task, e.sandbox, e.episode) for e in eps}


async def _read(client: ReplayClient, want: int | None = None, idle: float = 4.0,
                deadline_s: float = 60.0) -> set[tuple[str, str, str]]:
    """Episodes received until ``want`` of them arrived (then ``idle`` more seconds of
    nothing, so extra deliveries would be seen), or until idle when ``want`` is None."""
    got: set[tuple[str, str, str]] = set()
    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline:
        async for ep in client.episodes(idle_timeout=idle):
            got.add((ep.task, ep.sandbox, ep.episode))
            await client.ack(ep)
        if want is None or len(got) >= want:
            return got
    raise TimeoutError(f"received {len(got)} of {want} episodes in {deadline_s}s")


async def test_list_tasks_and_subscribe_to_several_tasks_all_tasks_or_a_pattern(
        kafka_broker: object, unique_name: str) -> None:
    settings = settings_for(kafka_broker.bootstrap, unique_name)  # type: ignore[attr-defined]
    web = make_episodes(3, seed=1, task="web-shop")
    swe = make_episodes(2, seed=2, task="swe-bench")
    await publish_replay(settings, "web-shop", web)
    await publish_replay(settings, "swe-bench", swe)
    await publish_replay(settings, "debug-web-shop", web[:1])  # an operator's republish

    assert await list_tasks(settings) == ["swe-bench", "web-shop"]
    assert await list_tasks(settings, include_debug=True) == [
        "debug-web-shop", "swe-bench", "web-shop"]

    async with ReplayClient(["web-shop", "swe-bench"], f"{unique_name}-two", settings) as c:
        assert await c.missing_tasks() == []
        assert await _read(c, want=5) == _ids(web + swe)

    async with ReplayClient([], f"{unique_name}-pattern", settings,
                            task_pattern=r"web-.*") as c:
        assert await _read(c, want=3) == _ids(web)

    # every task: the debug topic is left out, and a task created after the start is read
    async with ReplayClient(ALL_TASKS, f"{unique_name}-all", settings) as c:
        assert await c.list_tasks() == ["swe-bench", "web-shop"]
        assert await _read(c, want=5) == _ids(web + swe)
        later = make_episodes(2, seed=3, task="math-proof")
        await publish_replay(settings, "math-proof", later)
        assert await _read(c, want=2) == _ids(later)


async def test_start_at_the_beginning_the_end_a_time_or_the_groups_commit(
        kafka_broker: object, unique_name: str) -> None:
    settings = settings_for(kafka_broker.bootstrap, unique_name)  # type: ignore[attr-defined]
    now = datetime.now(UTC)
    two_hours_ago = make_episodes(2, seed=10, task="web-shop")
    half_an_hour_ago = make_episodes(3, seed=11, task="web-shop")
    await publish_replay(settings, "web-shop", two_hours_ago,
                         timestamp_ms=int((now - timedelta(hours=2)).timestamp() * 1000))
    await publish_replay(settings, "web-shop", half_an_hour_ago,
                         timestamp_ms=int((now - timedelta(minutes=30)).timestamp() * 1000))
    everything = _ids(two_hours_ago + half_an_hour_ago)
    group = f"{unique_name}-trainer"

    # resume (the default) with no commit yet: from the beginning; then nothing is left
    async with ReplayClient("web-shop", group, settings) as c:
        assert await _read(c, want=5) == everything
    async with ReplayClient("web-shop", group, settings) as c:
        assert await _read(c, want=0, idle=3) == set()

    # earliest resets the group: everything again, and the group's commit moves with it
    async with ReplayClient("web-shop", group, settings, start="earliest") as c:
        assert await _read(c, want=5) == everything
    async with ReplayClient("web-shop", group, settings, start="resume") as c:
        assert await _read(c, want=0, idle=3) == set()

    # a time: the first record written at or after it, per partition
    async with ReplayClient("web-shop", f"{group}-1h", settings, start="-1h") as c:
        assert await _read(c, want=3) == _ids(half_an_hour_ago)
    since = now - timedelta(hours=3)
    async with ReplayClient("web-shop", f"{group}-3h", settings, start=since) as c:
        assert await _read(c, want=5) == everything

    # latest: only what is written after the client started
    async with ReplayClient("web-shop", f"{group}-new", settings, start="latest") as c:
        assert await _read(c, want=0, idle=3) == set()
        fresh = make_episodes(2, seed=12, task="web-shop")
        await publish_replay(settings, "web-shop", fresh)
        assert await _read(c, want=2) == _ids(fresh)

    with pytest.raises(ValueError, match="unknown start position"):
        ReplayClient("web-shop", group, settings, start="yesterday-ish")


async def test_a_trainer_started_before_its_tasks_topic_exists_waits_then_reads(
        kafka_broker: object, unique_name: str) -> None:
    base = settings_for(kafka_broker.bootstrap, unique_name)  # type: ignore[attr-defined]
    # A short request timeout: the old client failed after one (30 s by default) when its
    # topic was missing; this one has to outlive several.
    settings = Settings(kafka=KafkaSettings(bootstrap_servers=base.kafka.bootstrap_servers,
                                            request_timeout_ms=2000), topics=base.topics)
    async with ReplayClient(["math-proof"], f"{unique_name}-early", settings) as c:
        assert await c.missing_tasks() == ["math-proof"]
        assert await _read(c, want=0, idle=7) == set()  # 3+ request timeouts: no crash
        eps = make_episodes(3, seed=4, task="math-proof")
        await publish_replay(settings, "math-proof", eps)
        assert await _read(c, want=3) == _ids(eps)
        assert await c.missing_tasks() == []


def test_the_sync_client_lists_tasks_and_starts_where_asked(
        kafka_broker: object, unique_name: str) -> None:
    settings = settings_for(kafka_broker.bootstrap, unique_name)  # type: ignore[attr-defined]
    eps = make_episodes(2, seed=5, task="swe-bench")
    asyncio.run(publish_replay(settings, "swe-bench", eps))
    with SyncReplayClient(ALL_TASKS, f"{unique_name}-sync", settings, start="earliest") as c:
        assert c.list_tasks() == ["swe-bench"]
        got = set()
        for ep in c.episodes(idle_timeout=4):
            got.add((ep.task, ep.sandbox, ep.episode))
            c.ack(ep)
    assert got == _ids(eps)


def test_replay_tail_waits_for_a_task_topic_that_does_not_exist_yet(
        kafka_broker: object, unique_name: str) -> None:
    settings = settings_for(kafka_broker.bootstrap, unique_name)  # type: ignore[attr-defined]
    proc = subprocess.Popen(
        [sys.executable, "-m", "trajbus", "replay", "tail", "--task", "late-task",
         "--idle-exit", "20"], env=env_for(settings), cwd=REPO, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True)
    assert proc.stderr is not None
    first = proc.stderr.readline()  # blocks until tail says it waits
    assert "waiting for the replay topic of task(s) late-task" in first, first
    rest: list[str] = []
    drain = threading.Thread(target=lambda: rest.extend(proc.stderr or []), daemon=True)
    drain.start()
    eps = make_episodes(2, seed=6, task="late-task")
    asyncio.run(publish_replay(settings, "late-task", eps))
    out, _ = proc.communicate(timeout=90)
    drain.join(timeout=10)
    assert proc.returncode == 0, "".join(rest)
    assert "Traceback" not in "".join(rest) and len(rest) <= 2, rest  # no log spam
    lines = out.splitlines()
    assert sorted(line.split()[1] for line in lines) == sorted(
        f"{e.sandbox}/{e.episode}" for e in eps)
    assert all(line.endswith("FIRST LAST") for line in lines), lines


async def test_a_replay_topic_made_before_the_trainer_is_not_missing(
        kafka_broker: object, unique_name: str) -> None:
    settings = settings_for(kafka_broker.bootstrap, unique_name)  # type: ignore[attr-defined]
    await create_replay_topic(settings, "empty-task")
    async with ReplayClient(["empty-task", "other"], f"{unique_name}-m", settings) as c:
        assert await c.missing_tasks() == ["other"]
