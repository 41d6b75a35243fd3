"""Test support shared by the end-to-end tests: settings per test, workers as subprocesses,
a deterministic shuffled workload, and consuming a topic until a condition holds."""

from __future__ import annotations

import asyncio
import os
import random
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NoReturn

from aiokafka import AIOKafkaConsumer

from trajbus.bus.settings import KafkaSettings, Settings, TopicSettings
from trajbus.consumers.engine.runner import TICK_KEY, OutRecord
from trajbus.schemas import models as m

REPO = Path(__file__).resolve().parents[1]


def settings_for(bootstrap: str, prefix: str, partitions: int = 2, **extra: object) -> Settings:
    return Settings(kafka=KafkaSettings(bootstrap_servers=bootstrap),
                    topics=TopicSettings(prefix=prefix, partitions=partitions), **extra)


def env_for(settings: Settings, **extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env.update({
        "TRAJBUS_KAFKA__BOOTSTRAP_SERVERS": settings.kafka.bootstrap_servers,
        "TRAJBUS_TOPICS__PREFIX": settings.topics.prefix,
        "TRAJBUS_TOPICS__PARTITIONS": str(settings.topics.partitions),
        "TRAJBUS_REPLAY__GAP_TIMEOUT_MS": str(settings.replay.gap_timeout_ms),
        "TRAJBUS_SCHEDULER__TICK_INTERVAL_MS": "500",
    })
    env.update(extra)
    return env


@dataclass
class Worker:
    """`trajbus worker` as a separate process."""

    settings: Settings
    processors: str
    worker_id: str = "w0"
    until_idle: float | None = None
    log_path: Path | None = None
    extra_env: dict[str, str] = field(default_factory=dict)
    proc: subprocess.Popen[bytes] | None = None

    def start(self) -> Worker:
        cmd = [sys.executable, "-m", "trajbus", "worker", "--processors", self.processors,
               "--worker-id", self.worker_id, "-v"]
        if self.until_idle is not None:
            cmd += ["--until-idle", str(self.until_idle)]
        out = open(self.log_path, "ab") if self.log_path else subprocess.DEVNULL
        self.proc = subprocess.Popen(cmd, env=env_for(self.settings, **self.extra_env),
                                     stdout=out, stderr=out, cwd=REPO)
        return self

    def kill(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(timeout=10)

    def stop(self, timeout: float = 20) -> int:
        assert self.proc is not None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait(timeout=10)

    def wait(self, timeout: float) -> int:
        assert self.proc is not None
        return self.proc.wait(timeout=timeout)


@dataclass
class Episode:
    task: str
    sandbox: str
    episode: str
    events: list[bytes]  # in seq order

    @property
    def n(self) -> int:
        return len(self.events)


def make_episodes(n_episodes: int, seed: int, task: str = "task-a", steps: int = 6,
                  t0: int | None = None, truncate_every: int = 0,
                  policy_version: int | None = None) -> list[Episode]:
    """Episodes of EpisodeStart, tool call/result pairs and an EpisodeEnd, encoded. Event
    times start at ``t0`` (default: now, so they agree with the workers' wall-clock ticks);
    every event carries ``policy_version``."""
    rng = random.Random(seed)
    t0 = int(time.time() * 1000) if t0 is None else t0
    eps = []
    for i in range(n_episodes):
        sandbox, episode = f"sb-{i % 7}", f"ep-{seed}-{i}"
        seq = 0
        t = t0 + i * 1000

        def header(seq: int, t: int, sandbox: str = sandbox, episode: str = episode
                   ) -> m.Envelope:
            return m.Envelope(event_id=f"{episode}-{seq}", task=task, sandbox=sandbox,
                              episode=episode, seq=seq, event_time_ms=t, producer_id="test",
                              policy_version=policy_version)

        evs: list[bytes] = [m.EpisodeStart(header=header(0, t)).encode()]
        for s in range(rng.randint(1, steps)):
            seq += 1
            evs.append(m.ToolCall(header=header(seq, t + seq), call_id=f"c{s}", tool="exec",
                                  args_hash=f"{s:064x}").encode())
            seq += 1
            evs.append(m.ToolResult(header=header(seq, t + seq), call_id=f"c{s}", tool="exec",
                                    status=m.ToolStatus.OK, result_hash=f"{s:064x}").encode())
        seq += 1
        outcome = (m.EpisodeOutcome.TRUNCATED if truncate_every and i % truncate_every == 0
                   else m.EpisodeOutcome.TERMINAL)
        evs.append(m.EpisodeEnd(header=header(seq, t + seq), outcome=outcome).encode())
        eps.append(Episode(task, sandbox, episode, evs))
    return eps


def shuffled_with_duplicates(eps: list[Episode], seed: int, dup_rate: float = 0.1,
                             window: int = 8) -> list[tuple[str, bytes]]:
    """(sandbox, bytes) in a locally shuffled order with some exact duplicates."""
    rng = random.Random(seed)
    stream = [(e.sandbox, ev) for e in eps for ev in e.events]
    stream += [x for x in stream if rng.random() < dup_rate]
    for i in range(0, len(stream), window):  # shuffle within windows: realistic disorder
        chunk = stream[i:i + window]
        rng.shuffle(chunk)
        stream[i:i + window] = chunk
    return stream


async def produce(settings: Settings, topic: str, items: list[tuple[str, bytes]]) -> None:
    from trajbus.bus.producer import close_producer, get_producer

    producer = await get_producer(settings.kafka)
    try:
        futures = [await producer.send(topic, v, key=k.encode()) for k, v in items]
        await asyncio.gather(*futures)
    finally:
        await close_producer()


async def consume_until(settings: Settings, topic: str, done: Callable[[list[bytes]], bool],
                        timeout: float = 60, read_committed: bool = True) -> list[bytes]:
    """Read ``topic`` from the beginning until ``done(values)`` or the deadline."""
    consumer = AIOKafkaConsumer(
        topic, bootstrap_servers=settings.kafka.bootstrap_servers, enable_auto_commit=False,
        auto_offset_reset="earliest",
        isolation_level="read_committed" if read_committed else "read_uncommitted")
    await consumer.start()
    values: list[bytes] = []
    deadline = time.monotonic() + timeout
    try:
        while not done(values):
            if time.monotonic() > deadline:
                raise TimeoutError(f"{topic}: condition not met in {timeout}s "
                                   f"({len(values)} records read)")
            batch = await consumer.getmany(timeout_ms=300)
            values.extend(msg.value for msgs in batch.values() for msg in msgs)
    finally:
        await consumer.stop()
    return values


# -- CI: a missing broker is a failure, not a skip ---------------------------------------------
_FALSE_WORDS = frozenset({"", "0", "false", "no", "off", "n", "f"})


def ci_enabled(env: Mapping[str, str] | None = None) -> bool:
    """Whether this run is a CI run: ``CI`` set to anything but an empty/false word
    (``CI=true``, ``CI=1``, ``CI=yes`` are CI; unset, ``CI=``, ``CI=false``, ``CI=0`` are not)."""
    value = (os.environ if env is None else env).get("CI")
    return value is not None and value.strip().lower() not in _FALSE_WORDS


def broker_unavailable(exc: BaseException) -> NoReturn:
    """No local Kafka broker can run here (``KafkaSetupError``: no Java, no Maven, no jars).

    Locally that skips the test with the reason. In CI (:func:`ci_enabled`) it fails it: a CI
    machine without Java must not go green with every broker test skipped."""
    import pytest

    what = f"cannot run a local Kafka broker: {exc}"
    if ci_enabled():
        pytest.fail(
            f"{what}\nCI={os.environ.get('CI')!r} is set, so the Kafka tests must run, not skip: "
            "make this machine able to run the broker (a JDK 17+ and Apache Maven 3.6+, e.g. "
            "`apt-get install -y openjdk-17-jdk-headless maven`, or TRAJBUS_KAFKA_LIB_DIR = a "
            "directory of Kafka 4.x jars), or set TRAJBUS_TEST_BOOTSTRAP=host:port to test "
            "against an existing broker. Unset CI to skip these tests instead.",
            pytrace=False)
    pytest.skip(f"{what} (set CI=true to make this a failure)")


class QuietCore:
    """A processor core with no outputs and no state, for runner tests where only the
    runner's own clients (its ticker, its start-up) are under test."""

    def handle(self, rec: object) -> list[object]:
        return []

    def tick(self, now_ms: int) -> list[object]:
        return []

    def take_dirty(self) -> dict[str, bytes | None]:
        return {}

    def restore(self, key: str, blob: bytes | None) -> None:
        pass


class EchoCore:
    """Every input record -> one output record and one changelog record (its key's state),
    so each transaction writes outputs, state and offsets like the reorder worker's."""

    def __init__(self, out_topic: str) -> None:
        self.out_topic = out_topic
        self.dirty: dict[str, bytes | None] = {}

    def handle(self, rec: Any) -> list[Any]:
        if rec.key == TICK_KEY:
            return []
        self.dirty[(rec.key or b"").decode()] = rec.value
        return [OutRecord(self.out_topic, rec.key, rec.value, rec.partition)]

    def tick(self, now_ms: int) -> list[Any]:
        return []

    def take_dirty(self) -> dict[str, bytes | None]:
        dirty, self.dirty = self.dirty, {}
        return dirty

    def restore(self, key: str, blob: bytes | None) -> None:
        pass
