"""The runner rebuilds a partition's core from the committed changelog: every record in log
order, deletes (tombstones) included. Until compaction, a changelog holds a key's put and its
later delete; skipping the delete would resurrect state the core had dropped (an expired
episode, a forgotten sandbox)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from aiokafka import TopicPartition
from support import settings_for

from trajbus.bus.admin import ensure_topics
from trajbus.bus.producer import close_producer, get_producer
from trajbus.bus.topics import TopicSpec
from trajbus.consumers.engine.runner import (
    InRecord,
    OutRecord,
    ProcessorSpec,
    RestoreAborted,
    Runner,
)

pytestmark = [pytest.mark.kafka, pytest.mark.timeout(90)]


class Recording:
    """A processor whose state is a dict fed by restore() (None deletes)."""

    def __init__(self) -> None:
        self.state: dict[str, bytes] = {}
        self.calls: list[tuple[str, bytes | None]] = []

    def handle(self, rec: InRecord) -> list[OutRecord]:
        return []

    def handle_batch(self, records: list[InRecord]) -> list[OutRecord]:
        return []

    def tick(self, now_ms: int) -> list[OutRecord]:
        return []

    def take_dirty(self) -> dict[str, bytes | None]:
        return {}

    def restore(self, key: str, blob: bytes | None) -> None:
        self.calls.append((key, blob))
        if blob is None:
            self.state.pop(key, None)
        else:
            self.state[key] = blob


async def _runner_with_changelog(kafka_broker: Any, unique_name: str,
                                 records: list[tuple[str, bytes | None]]) -> Runner:
    """A runner of a Recording core whose changelog (one partition) holds ``records``."""
    settings = settings_for(kafka_broker.bootstrap, unique_name, partitions=1)
    spec = ProcessorSpec(name="rec", input_topics=[f"{unique_name}.in"], factory=Recording)
    runner = Runner(settings, spec, "w0")
    await ensure_topics(settings, [TopicSpec(runner.changelog, 1, "test", "key",
                                             retention_ms=-1, compacted=True)])
    producer = await get_producer(settings.kafka)
    try:
        for key, value in records:
            fut = await producer.send(runner.changelog, value, key=key.encode(), partition=0)
            await fut
    finally:
        await close_producer()
    return runner


async def test_restore_applies_deletes_in_log_order(kafka_broker, unique_name) -> None:
    runner = await _runner_with_changelog(kafka_broker, unique_name, [
        ("gone", b"v1"), ("kept", b"k1"), ("gone", None), ("kept", b"k2"), ("back", None),
        ("back", b"b1")])
    await runner.restore([TopicPartition(f"{unique_name}.in", 0)])
    core = runner.cores[0]
    assert isinstance(core, Recording)
    assert core.state == {"kept": b"k2", "back": b"b1"}
    # each key once, with its latest value, in the order of its last write (what a fully
    # compacted changelog holds): the core never builds state it then throws away, and the
    # state is built after the fetched records are gone (RSS after a restore, bench_recovery)
    assert core.calls == [("gone", None), ("kept", b"k2"), ("back", b"b1")]


async def test_the_changelog_is_created_to_be_compacted_promptly(kafka_broker,
                                                                 unique_name) -> None:
    """Kafka never compacts the active segment; with its defaults (1 GiB, 7 days) a restore
    re-reads the whole history. The runner's changelog rolls and cleans promptly."""
    from aiokafka.admin import AIOKafkaAdminClient
    from aiokafka.admin.config_resource import ConfigResource, ConfigResourceType

    from trajbus.bus.kafka import connection_options
    from trajbus.consumers.engine.runner import changelog_configs

    settings = settings_for(kafka_broker.bootstrap, unique_name, partitions=1)
    spec = ProcessorSpec(name="rec", input_topics=[f"{unique_name}.in"], factory=Recording)
    runner = Runner(settings, spec, "w0")
    await runner._prepare_topics()
    admin = AIOKafkaAdminClient(**connection_options(settings.kafka))
    await admin.start()
    try:
        [resp] = await admin.describe_configs(
            [ConfigResource(ConfigResourceType.TOPIC, runner.changelog)])
        entries = {e[0]: e[1] for res in resp.resources for e in res[4]}
    finally:
        await admin.close()
    assert entries["cleanup.policy"] == "compact"
    expected = changelog_configs(runner.topics.derived_max_bytes + 65536)
    # segments just above the largest batch the runner writes: ~10 MiB, not Kafka's 1 GiB
    assert int(expected["segment.bytes"]) <= 11 * 1024 * 1024
    for name, value in expected.items():
        assert entries[name] == value, name


async def _runner_and_previous_owner(bootstrap: str, name: str, owner: str):
    """A runner with an empty one-partition changelog, and a transactional producer standing
    for the partition's previous owner, which has committed key ``a`` = ``b"committed"``."""
    from aiokafka import AIOKafkaProducer

    from trajbus.bus.producer import producer_options

    settings = settings_for(bootstrap, name, partitions=1)
    spec = ProcessorSpec(name="rec", input_topics=[f"{name}.in"], factory=Recording)
    runner = Runner(settings, spec, "w0")
    await ensure_topics(settings, [TopicSpec(runner.changelog, 1, "test", "key",
                                             retention_ms=-1, compacted=True)])
    p = AIOKafkaProducer(**producer_options(settings.kafka, transactional_id=f"{name}.{owner}"))
    await p.start()
    async with p.transaction():
        await (await p.send(runner.changelog, b"committed", key=b"a", partition=0))
    return runner, p


async def test_restore_waits_for_a_transaction_that_commits_while_it_reads(
        kafka_broker, unique_name) -> None:
    """The previous owner's last transaction can still be completing (commit markers on their
    way) when the new owner restores, while its input offsets are visible already. Reading only
    to the last stable offset would restore state without that transaction and resume after its
    inputs: their state lost. The restore waits until no transaction is pending."""
    import asyncio

    runner, owner = await _runner_and_previous_owner(kafka_broker.bootstrap, unique_name,
                                                     "old-owner")
    try:
        await owner.begin_transaction()
        await (await owner.send(runner.changelog, b"last", key=b"b", partition=0))

        async def commit_soon() -> None:
            await asyncio.sleep(1.0)  # the restore is reading meanwhile
            await owner.commit_transaction()

        committer = asyncio.create_task(commit_soon())
        await runner.restore([TopicPartition(f"{unique_name}.in", 0)])
        await committer
    finally:
        await owner.stop()
    core = runner.cores[0]
    assert isinstance(core, Recording)
    assert core.state == {"a": b"committed", "b": b"last"}


async def test_restore_takes_a_transaction_pending_for_long_as_abandoned(
        kafka_broker, unique_name) -> None:
    """An owner SIGKILLed mid-transaction leaves it open until the broker's transaction
    timeout (its offsets were never committed): after RESTORE_PENDING_TXN_WAIT_S the restore
    proceeds with the committed state instead of stalling failover for the timeout."""
    import time

    from trajbus.consumers.engine.runner import RESTORE_PENDING_TXN_WAIT_S

    runner, owner = await _runner_and_previous_owner(kafka_broker.bootstrap, unique_name,
                                                     "dead-owner")
    try:
        await owner.begin_transaction()
        await (await owner.send(runner.changelog, b"never", key=b"b", partition=0))
        started = time.monotonic()
        await runner.restore([TopicPartition(f"{unique_name}.in", 0)])
        took = time.monotonic() - started
        await owner.abort_transaction()
    finally:
        await owner.stop()
    core = runner.cores[0]
    assert isinstance(core, Recording)
    assert core.state == {"a": b"committed"}
    assert RESTORE_PENDING_TXN_WAIT_S <= took < RESTORE_PENDING_TXN_WAIT_S + 15


@pytest.mark.kafka
@pytest.mark.timeout(240)
async def test_a_restore_that_begins_while_the_broker_restarts_waits_for_it(
        unique_name, tmp_path) -> None:
    """A rebalance during a broker outage starts a restore whose consumer cannot bootstrap
    (the soak of 2026-12-01: the worker exited with "Unable to bootstrap"): it waits."""
    import asyncio

    from faults_support import own_broker

    with own_broker(tmp_path / "kafka") as broker:
        settings = settings_for(broker.bootstrap, unique_name, partitions=1)
        spec = ProcessorSpec(name="rec", input_topics=[f"{unique_name}.in"], factory=Recording)
        runner = Runner(settings, spec, "w0")
        await ensure_topics(settings, [TopicSpec(runner.changelog, 1, "test", "key",
                                                 retention_ms=-1, compacted=True)])
        producer = await get_producer(settings.kafka)
        try:
            await (await producer.send(runner.changelog, b"v", key=b"k", partition=0))
        finally:
            await close_producer()
        broker.stop()
        restarted = asyncio.create_task(asyncio.to_thread(
            lambda: (__import__("time").sleep(3), broker.start(timeout=120))))
        await runner.restore([TopicPartition(f"{unique_name}.in", 0)])
        await restarted
    core = runner.cores[0]
    assert isinstance(core, Recording)
    assert core.state == {"k": b"v"}


async def test_a_restore_that_loses_its_broker_connection_reads_again_and_completes(
        kafka_broker, unique_name, monkeypatch) -> None:
    """Soak, 2026-12-02: the broker went down while a worker restored at start-up; the
    restore consumer's fetch was cancelled as its connection closed, and the CancelledError
    stopped the worker. A restore is idempotent (it reads the changelog from its beginning):
    it is read again once the broker answers."""
    from aiokafka import AIOKafkaConsumer

    runner = await _runner_with_changelog(kafka_broker, unique_name,
                                          [(f"k{i % 7}", f"v{i}".encode()) for i in range(50)])
    interrupted = {"left": 1}
    real_getmany = AIOKafkaConsumer.getmany

    async def getmany(self: AIOKafkaConsumer, *tps: TopicPartition, **kw: object) -> object:
        batch = await real_getmany(self, *tps, **kw)  # type: ignore[arg-type]
        if batch and interrupted["left"] and self._client._client_id.endswith("-restore"):
            interrupted["left"] -= 1
            raise asyncio.CancelledError()  # what aiokafka's fetcher raised as it closed
        return batch

    monkeypatch.setattr(AIOKafkaConsumer, "getmany", getmany)
    await runner.restore([TopicPartition(f"{unique_name}.in", 0)])
    assert interrupted["left"] == 0
    core = runner.cores[0]
    assert isinstance(core, Recording)
    assert core.state == {f"k{k}": f"v{max(i for i in range(50) if i % 7 == k)}".encode()
                          for k in range(7)}


async def test_a_restore_called_off_ends_its_thread(kafka_broker, unique_name) -> None:
    """A restore runs in a thread; cancelling the task that awaits it does not stop the
    thread, and a process waits for its threads at exit. Calling it off ends the thread."""
    runner = await _runner_with_changelog(kafka_broker, unique_name, [("k", b"v")])
    runner._abort_restore.set()
    with pytest.raises(RestoreAborted):
        await asyncio.wait_for(runner.restore([TopicPartition(f"{unique_name}.in", 0)]), 30)
    assert 0 not in runner.cores
