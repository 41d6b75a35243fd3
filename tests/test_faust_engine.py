"""The faust-streaming engine (`trajbus worker --engine faust`): the same reorder adapter as the
aiokafka runner, run as a faust agent with a changelog-backed Table, at-least-once.

- In process (`agent.test_context()`, `memory://` store): shuffled events of one episode become
  replay segments that, concatenated, are the episode in order; the state is in the Table under
  the partition's prefix, and a fresh adapter restored from the Table is the same core.
- Against a real broker: a `trajbus worker --engine faust` subprocess turns shuffled, duplicated
  events into replay segments from which a trainer's ReplayClient receives every episode exactly
  as produced (the ReplayClient dedupes by (episode, seq), which at-least-once relies on).
"""

from __future__ import annotations

import asyncio
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from faust.types import TP
from support import (
    REPO,
    consume_until,
    env_for,
    make_episodes,
    produce,
    settings_for,
    shuffled_with_duplicates,
)

from trajbus.bus.admin import ensure_base_topics
from trajbus.bus.settings import ReplaySettings, Settings, TopicSettings
from trajbus.bus.topics import Topics
from trajbus.consumers.faust_app import FaustEngine, UnsupportedProcessor, build_engine
from trajbus.consumers.processors import scheduler_spec, watchdog_spec
from trajbus.consumers.replay_client import ReplayClient
from trajbus.consumers.runner import InRecord, OutRecord
from trajbus.schemas.codec import default_codec


def _engine(tmp_path: Path) -> tuple[FaustEngine, list[OutRecord]]:
    settings = Settings(topics=TopicSettings(prefix="unit", partitions=2), state_dir=tmp_path)
    engine = build_engine(settings, ["reorder"], "u0")
    engine.app.conf.store = "memory://"
    sent: list[OutRecord] = []

    async def capture(out: OutRecord) -> Any:  # the send seam: no broker in unit tests
        sent.append(out)
        done = asyncio.get_running_loop().create_future()
        done.set_result(None)
        return done

    engine.send = capture
    return engine, sent


@pytest.mark.timeout(60)
async def test_agent_turns_shuffled_events_into_ordered_segments_and_table_state(
        tmp_path: Path) -> None:
    engine, sent = _engine(tmp_path)
    codec = default_codec()
    [ep] = make_episodes(1, seed=7, steps=4)
    order = [0, *reversed(range(1, ep.n))]  # start, then everything else backwards
    async with engine.agent.test_context() as agent:
        for i in order:
            await agent.put(ep.events[i], key=ep.sandbox.encode(), partition=1)

    replay = Topics(engine.settings).replay("task-a")
    assert sent and all(o.topic == replay and o.key == ep.episode.encode() for o in sent)
    events: list[bytes] = []
    for out in sent:
        seg = codec.decode(out.value)
        assert seg.kind == "ReplaySegment" and seg.record["gap"] is None
        events.extend(seg.record["events"])
    assert events == ep.events  # the whole episode, in seq order, once
    assert engine.processed == ep.n

    # The state lives in the Table under the input partition's prefix. An adapter restored
    # from it (as after a reassignment) remembers the episode: a replayed event is dropped,
    # where a core without that state would publish the episode again.
    keys = list(engine.table.keys())
    assert keys and all(k.startswith(b"1/") for k in keys)
    live = engine.adapters.pop(1)
    restored = engine.adapter(1)
    assert restored is not live
    again = InRecord(engine.spec.input_topics[0], 1, 99, ep.sandbox.encode(), ep.events[0],
                     ep.n)
    assert [o for o in restored.handle(again) if o.topic == replay] == []
    assert [o.topic for o in engine.spec.factory().handle(again)] == [replay]

    # A revoked partition's adapter is dropped (its next owner restores it from the Table).
    await engine.app.on_partitions_revoked.send({TP(engine.spec.input_topics[0], 1)})
    assert 1 not in engine.adapters


def test_pattern_and_global_processors_are_refused_with_a_reason(tmp_path: Path) -> None:
    settings = Settings(topics=TopicSettings(prefix="unit"), state_dir=tmp_path)
    for spec in (watchdog_spec(settings), scheduler_spec(settings)):
        with pytest.raises(UnsupportedProcessor, match="--engine aiokafka"):
            FaustEngine(settings, spec)
    with pytest.raises(UnsupportedProcessor, match="one processor per worker"):
        build_engine(settings, ["reorder", "watchdog"])


@dataclass
class FaustWorker:
    """`trajbus worker --engine faust --processors reorder` as a subprocess."""

    settings: Settings
    tmp_path: Path
    name: str = "faust-worker"
    proc: subprocess.Popen[bytes] | None = None

    @property
    def log_path(self) -> Path:
        return self.tmp_path / f"{self.name}.log"

    def start(self) -> FaustWorker:
        cmd = [sys.executable, "-m", "trajbus", "worker", "--engine", "faust",
               "--processors", "reorder", "--worker-id", "f0", "-v"]
        env = env_for(self.settings, TRAJBUS_STATE_DIR=str(self.tmp_path / "state"))
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=log, cwd=REPO)
        return self

    def kill(self) -> None:
        assert self.proc is not None
        self.proc.kill()
        self.proc.wait(timeout=10)

    def stop(self) -> int | None:
        """SIGTERM (faust's graceful shutdown); SIGKILL if it does not exit within 30s."""
        assert self.proc is not None
        if self.proc.poll() is None:
            self.proc.terminate()
        try:
            return self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=10)
            return None

    async def exited(self) -> None:
        assert self.proc is not None
        while self.proc.poll() is None:
            await asyncio.sleep(0.2)

    def log_tail(self) -> str:
        return self.log_path.read_text(errors="replace")[-4000:]


async def _trainer_view(settings: Settings, group: str, worker: FaustWorker, n: int,
                        timeout: float = 120) -> dict[tuple[str, str], list[bytes]]:
    """Episodes as a trainer's ReplayClient delivers them (ordered, deduplicated), until ``n``
    arrived; fails at once, with the worker's log, if the worker exits or time runs out."""
    codec = default_codec()
    got: dict[tuple[str, str], list[bytes]] = {}
    async with ReplayClient(["task-a"], group, settings) as client:
        async def read() -> None:
            async for ep in client.episodes(idle_timeout=None):
                got[(ep.sandbox, ep.episode)] = [codec.encode(e.kind, e.record)
                                                 for e in ep.events]
                await client.ack(ep)
                if len(got) >= n:
                    return

        reader, watcher = asyncio.create_task(read()), asyncio.create_task(worker.exited())
        done, _ = await asyncio.wait({reader, watcher}, timeout=timeout,
                                     return_when=asyncio.FIRST_COMPLETED)
        for task in (reader, watcher):
            task.cancel()
        if reader not in done or reader.exception() is not None:
            why = "the worker exited" if watcher in done else f"timed out after {timeout}s"
            pytest.fail(f"{why} with {len(got)}/{n} episodes; worker log tail:\n"
                        + worker.log_tail())
    return got


@pytest.mark.kafka
@pytest.mark.timeout(180)
async def test_faust_worker_delivers_every_episode_as_produced(
        kafka_broker, unique_name: str, tmp_path: Path) -> None:
    settings = settings_for(kafka_broker.bootstrap, unique_name)
    await ensure_base_topics(settings, ["task-a"])
    eps = make_episodes(40, seed=11)
    await produce(settings, Topics(settings).sandbox_events, shuffled_with_duplicates(eps, 11))
    worker = FaustWorker(settings, tmp_path).start()
    try:
        got = await _trainer_view(settings, f"{unique_name}-trainer", worker, len(eps))
    finally:
        code = worker.stop()
    assert got == {(e.sandbox, e.episode): e.events for e in eps}
    assert code == 0, worker.log_tail()  # SIGTERM is a clean shutdown


@pytest.mark.kafka
@pytest.mark.timeout(240)
async def test_faust_worker_killed_mid_stream_resumes_from_its_table(
        kafka_broker, unique_name: str, tmp_path: Path) -> None:
    """SIGKILL mid-stream, restart: the restarted worker rebuilds its adapters from the Table's
    changelog; at-least-once may republish segments, the trainer still sees each episode once
    and complete. The gap timeout is long: an episode whose first half and second half of
    events straddle the kill must wait for them (what this test is about), not have its
    missing seqs declared a gap because the box was slow between the two produce calls."""
    settings = settings_for(kafka_broker.bootstrap, unique_name,
                            replay=ReplaySettings(gap_timeout_ms=120_000))
    await ensure_base_topics(settings, ["task-a"])
    topics = Topics(settings)
    eps = make_episodes(120, seed=12)
    stream = shuffled_with_duplicates(eps, 12)
    half = len(stream) // 2
    await produce(settings, topics.sandbox_events, stream[:half])
    worker = FaustWorker(settings, tmp_path, "first").start()
    # Kill only once output and state both reached the broker, mid-stream.
    await consume_until(settings, topics.replay("task-a"), lambda v: len(v) >= 10, timeout=60)
    changelog = f"{unique_name}.reorder.faust-state-changelog"
    await consume_until(settings, changelog, lambda v: len(v) >= 1, timeout=30)
    await produce(settings, topics.sandbox_events, stream[half:])
    worker.kill()
    worker = FaustWorker(settings, tmp_path, "second").start()
    try:
        got = await _trainer_view(settings, f"{unique_name}-trainer", worker, len(eps))
    finally:
        worker.stop()
    assert got == {(e.sandbox, e.episode): e.events for e in eps}
    restored = re.findall(r"restored (\d+) state records", worker.log_path.read_text())
    assert sum(map(int, restored)) > 0, worker.log_tail()
