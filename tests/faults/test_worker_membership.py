"""Group membership of the reorder worker (issue 18): a worker SIGKILLed and restarted with the
same --worker-id takes its partitions back at once (static membership), and a worker stopped
cleanly hands its partitions to the others at once (an explicit static LeaveGroup).

Both run with a 45 s session timeout, so "at once" is told apart from "after the session
timeout" by a margin no loaded machine closes: before static membership the restarted worker
waited for its dead self's session to expire; with static membership but no explicit leave, the
survivor would wait as long for a cleanly stopped peer.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from faults_support import diff_views, trainer_view
from support import (
    Worker,
    consume_until,
    make_episodes,
    produce,
    settings_for,
    shuffled_with_duplicates,
)

from trajbus.bus.admin import ensure_base_topics
from trajbus.bus.topics import Topics

pytestmark = [pytest.mark.kafka, pytest.mark.timeout(240)]

SESSION_MS = 45_000
SESSION_ENV = {"TRAJBUS_KAFKA__SESSION_TIMEOUT_MS": str(SESSION_MS)}
# Well under the session: start-up of a worker process (imports, broker check, restore) on a
# saturated two-core box takes seconds, never tens of them.
AT_ONCE_S = 30.0


def _expected(eps: list) -> dict:
    return {(e.sandbox, e.episode): [(i, f"{e.episode}-{i}") for i in range(e.n)] for e in eps}


def _two_rounds(seed: int, n: int) -> tuple[list, list, list]:
    """Episodes, and their events in two rounds that share no episode: an episode split across
    the pause between rounds (a worker stopping, restarting) would rightly have its gap closed
    after the gap timeout, its missing seqs then going to the late topic."""
    first, second = make_episodes(n, seed=seed), make_episodes(n, seed=seed + 1000)
    return (first + second, shuffled_with_duplicates(first, seed),
            shuffled_with_duplicates(second, seed + 1000))


async def test_a_worker_restarted_after_sigkill_takes_its_partitions_back_at_once(
        kafka_broker, unique_name, tmp_path: Path) -> None:
    settings = settings_for(kafka_broker.bootstrap, unique_name, partitions=3)
    await ensure_base_topics(settings, ["task-a"])
    topics = Topics(settings)
    eps, round1, round2 = _two_rounds(18, 30)
    w = Worker(settings, "reorder", "wa", log_path=tmp_path / "wa.log",
               extra_env=SESSION_ENV).start()
    try:
        await produce(settings, topics.sandbox_events, round1)
        await consume_until(settings, topics.replay("task-a"), lambda v: len(v) >= 10,
                            timeout=60)
        w.kill()
        await produce(settings, topics.sandbox_events, round2)
        restarted = time.monotonic()
        w = Worker(settings, "reorder", "wa", log_path=tmp_path / "wa.log",
                   extra_env=SESSION_ENV).start()
        expected = _expected(eps)
        view = await trainer_view(settings, ["task-a"], f"{unique_name}-trainer",
                                  lambda v: v.complete(expected), timeout=120, settle_s=0.5)
        took = time.monotonic() - restarted
    finally:
        w.stop()
    assert diff_views(expected, view) == []
    assert took < AT_ONCE_S, (
        f"the restarted worker served everything {took:.1f} s after its start: it waited for "
        f"the dead member's {SESSION_MS / 1000:.0f} s session")


async def test_a_cleanly_stopped_worker_hands_its_partitions_over_at_once(
        kafka_broker, unique_name, tmp_path: Path) -> None:
    settings = settings_for(kafka_broker.bootstrap, unique_name, partitions=4)
    await ensure_base_topics(settings, ["task-a"])
    topics = Topics(settings)
    eps, round1, round2 = _two_rounds(19, 40)
    w1 = Worker(settings, "reorder", "w1", log_path=tmp_path / "w1.log",
                extra_env=SESSION_ENV).start()
    w2 = Worker(settings, "reorder", "w2", log_path=tmp_path / "w2.log",
                extra_env=SESSION_ENV).start()
    try:
        await produce(settings, topics.sandbox_events, round1)
        await consume_until(settings, topics.replay("task-a"), lambda v: len(v) >= 10,
                            timeout=90)
        assert w1.stop() == 0  # SIGTERM: a clean stop
        stopped = time.monotonic()
        assert "left group" in (tmp_path / "w1.log").read_text()
        await produce(settings, topics.sandbox_events, round2)
        expected = _expected(eps)
        view = await trainer_view(settings, ["task-a"], f"{unique_name}-trainer",
                                  lambda v: v.complete(expected), timeout=120, settle_s=0.5)
        took = time.monotonic() - stopped
        assert w2.proc is not None and w2.proc.poll() is None
    finally:
        w2.stop()
    assert diff_views(expected, view) == []
    assert took < AT_ONCE_S, (
        f"the survivor served the stopped worker's partitions {took:.1f} s after the stop: "
        f"it waited for the {SESSION_MS / 1000:.0f} s session")
