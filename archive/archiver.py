"""The archiver: raw event topics -> Parquet objects + index in the object store.

Why a plain aiokafka consumer group, not a faust agent: the archiver's one guarantee is
"commit an offset only after the objects holding everything before it are durable". A faust
agent commits on its own schedule (and, with exactly-once processing, inside a Kafka
transaction whose side effects to S3 are not part of it): an offset could be committed for
rows still in a local buffer, and a crash would lose them. A plain consumer with
``enable_auto_commit=False`` lets the shell commit exactly when the batch's objects, index and
marker are written. Exactly-once into the store then comes from the object keys: they are
derived from (topic, partition, first offset, last offset), and a crash between upload and
commit replays the same batch boundary (the batch marker + ``ArchiveBatcher.expect``), so the
same keys are overwritten with the same rows. Readers never see partial objects (complete
object PUTs / atomic renames). Exactly one row per *event* (not per record) comes from the
write-time dedupe (``dedupe.py``): re-sent copies of an archived event are never written,
conflicting copies go to ``conflicts/``.

Structure: :func:`run_archiver` (here) is the asyncio loop that polls Kafka, sets partitions
up on assignment, runs the shell in a single worker thread (keeping the event loop responsive
for heartbeats), publishes dead letters, and commits; :class:`ArchiveShell`
(:mod:`trajbus.archive.shell`) is the synchronous part (decode, dedupe, spool, batcher
decisions, Parquet writes, uploads); :mod:`trajbus.archive.rejects` publishes the records
the shell refuses as dead letters. Every name of the two is importable from here as well.

Beside the raw event topics the archiver reads the decision context (``Topics.context_areas``:
scheduling decisions, watchdog alerts, dead letters) into its own data areas, with the same
batches, keys, markers, commits and dedupe. A record of the dead-letter topic the archiver
cannot read is logged and counted (``ArchiverStats.unreadable_dead_letters``), never
dead-lettered again.
"""

from __future__ import annotations

import asyncio
import hashlib
import inspect
import logging
import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from trajbus.archive.rejects import DeadLetterFn, dead_letter_ids, kafka_dead_letter
from trajbus.archive.shell import (
    _SAFE,
    ArchiveShell,
    Rejected,
    SourceRecord,
    StepResult,
    context_task,
    keep_original_task,
    log_warning,
)
from trajbus.archive.shell import _index_refs as _index_refs
from trajbus.archive.storage import ObjectStore, open_store
from trajbus.bus.clients import new_consumer
from trajbus.bus.closing import close_client
from trajbus.bus.settings import Settings
from trajbus.bus.topics import Topics
from trajbus.schemas.codec import Codec

__all__ = [
    "IDLE_COMMIT_INTERVAL_S",
    "ArchiveShell",
    "ArchiverState",
    "ArchiverStats",
    "DeadLetterFn",
    "Rejected",
    "SourceRecord",
    "StepResult",
    "archiver_group",
    "context_task",
    "dead_letter_ids",
    "kafka_dead_letter",
    "keep_original_task",
    "log_warning",
    "run_archiver",
]

log = logging.getLogger(__name__)

IDLE_COMMIT_INTERVAL_S = 1.0
"""How often at most the archiver commits past records that need no writing (ticks...)."""

@dataclass
class ArchiverStats:
    records: int = 0
    rows: int = 0
    dead_letters: int = 0
    dead_letters_known: int = 0  # refused, but already on the dead-letter topic: not re-sent
    duplicates: int = 0  # re-sent copies not archived again
    conflicts: int = 0  # conflicting copies written to conflicts/, not events/
    unreadable_dead_letters: int = 0  # dead-letter topic records skipped (not re-sent)
    batches: int = 0
    objects: int = 0
    committed: dict[str, int] = field(default_factory=dict)  # "topic:partition" -> offset
    group_id: str = ""
    destination: str = ""
    note: str | None = None  # why the archiver had nothing to do, when it had nothing to do


@dataclass
class ArchiverState:
    """What ``/readyz`` of ``trajbus archive run`` reports, kept current by :func:`run_archiver`:
    ready once its consumer started, the group assigned it partitions (possibly none, in a
    group with more members than partitions) and every one is set up (batch markers read)."""

    started: bool = False
    assigned: int | None = None  # partitions of the last assignment; None: none yet
    setting_up: int = 0  # assigned partitions whose store state is still being read
    stopping: bool = False

    def ready(self) -> tuple[bool, dict[str, Any]]:
        ok = (self.started and self.assigned is not None and self.setting_up == 0
              and not self.stopping)
        return ok, {"started": self.started, "assigned_partitions": self.assigned,
                    "setting_up": self.setting_up, "stopping": self.stopping}



def archiver_group(prefix: str, url: str) -> str:
    """The consumer group of the archiver writing to ``url``: one per destination, so a
    second destination (a new bucket) archives everything instead of sharing the first one's
    committed offsets. ``s3://bucket/pre/fix`` -> ``<prefix>.archiver.s3.bucket.pre-fix``; a
    local directory -> ``<prefix>.archiver.local.<dir name>-<hash of the absolute path>``."""
    if url.startswith("s3://"):
        bucket, _, path = url[5:].partition("/")
        tail = f"s3.{bucket}" + (f".{path.strip('/').replace('/', '-')}" if path.strip("/")
                                 else "")
    else:
        path = os.path.abspath(url)
        tail = (f"local.{os.path.basename(path.rstrip('/')) or 'root'}-"
                f"{hashlib.sha1(path.encode()).hexdigest()[:8]}")
    return f"{prefix}.archiver.{_SAFE.sub('-', tail)[:180]}"




async def run_archiver(settings: Settings, stop_event: asyncio.Event | None = None, *,
                       store: ObjectStore | None = None,
                       dead_letter: DeadLetterFn | None = None,
                       until_idle: bool = False,
                       group_id: str | None = None,
                       topics: list[str] | None = None,
                       codec: Codec | None = None,
                       poll_timeout_ms: int = 500,
                       assignment_timeout_s: float = 60.0,
                       state: ArchiverState | None = None) -> ArchiverStats:
    """Archive the raw event topics and the decision context (``Topics.archive_topics``)
    until ``stop_event`` is set (or, with ``until_idle``,
    until every assigned partition is caught up with its end offset at start). On exit the
    open batches are flushed and committed.

    An offset is committed only after every row before it is in the store (objects, index,
    batch marker): a crash loses nothing and, with the dedupe, writes nothing twice. The
    consumer group defaults to one per destination (:func:`archiver_group` of the store's
    URL); when the group has nothing left to read, ``ArchiverStats.note`` says so and why."""
    from aiokafka import ConsumerRebalanceListener, TopicPartition
    from aiokafka.errors import CommitFailedError

    from trajbus.archive import metrics
    from trajbus.bus.ops import export_lag

    cfg = settings.archive
    catalog = Topics(settings)
    topics = topics or catalog.archive_topics
    if store is None:
        store = await asyncio.to_thread(
            lambda: open_store(cfg.url, cfg.s3_endpoint_url, retry_s=cfg.store_retry_s))
    dest: ObjectStore = store
    group_id = group_id or archiver_group(catalog.prefix, dest.url)
    stop_event = stop_event or asyncio.Event()
    dead = dead_letter or kafka_dead_letter(settings)
    executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="archiver")
    loop = asyncio.get_running_loop()
    shell = await loop.run_in_executor(
        executor, lambda: ArchiveShell(store, cfg, codec, areas=catalog.context_areas))
    stats = ArchiverStats(group_id=group_id, destination=dest.url)
    st: ArchiverState = state or ArchiverState()
    newest_ms = [0]  # the newest archived (written and committed) event time
    metrics.track_freshness(group_id, newest_ms)
    for counter in (metrics.BATCHES, metrics.OBJECTS, metrics.ROWS, metrics.BYTES):
        counter.labels(group_id)  # shown as 0 from the start
    for kind in ("transient", "gave_up"):
        metrics.STORE_ERRORS.labels(kind)
    log.info("archiving %s into %s as consumer group %s", topics, dest.url, group_id)

    consumer = new_consumer(
        settings.kafka,
        client_id=f"{settings.kafka.client_id}-archiver",
        group_id=group_id,
        enable_auto_commit=False,
        auto_offset_reset="earliest",
        isolation_level="read_committed",
        max_partition_fetch_bytes=max(settings.topics.max_message_bytes, 1_048_576),
        fetch_max_bytes=max(4 * settings.topics.max_message_bytes, 52_428_800),
        fetch_max_wait_ms=settings.kafka.fetch_max_wait_ms,  # idle partitions: see there
        # The store may block a batch for up to store_retry_s while S3 is down: stay in the
        # group meanwhile (heartbeats run on the event loop; this bounds the time between polls).
        max_poll_interval_ms=max(300_000, int((cfg.store_retry_s + 120) * 1000)),
    )

    async def call_shell(fn: Callable[..., Any], *args: Any) -> Any:
        return await loop.run_in_executor(executor, fn, *args)

    ready: set[Any] = set()  # partitions whose shell state matches the consumer's position
    to_set_up: set[Any] = set()  # assigned, shell state not yet reset to the committed offset

    class Listener(ConsumerRebalanceListener):
        async def on_partitions_revoked(self, revoked: Any) -> None:
            for tp in revoked:
                ready.discard(tp)
                to_set_up.discard(tp)
                await call_shell(shell.revoked, tp.topic, tp.partition)

        async def on_partitions_assigned(self, assigned: Any) -> None:
            # No store I/O here: listing batch markers may wait out an S3 outage, and a
            # callback that blocks the join gets the member expired. The main loop sets up.
            to_set_up.update(assigned)
            st.assigned = len(assigned)
            st.setting_up = len(to_set_up)
            logging.getLogger("trajbus.ops").info(
                "archiver (group %s): assigned %d partitions %s", group_id, len(assigned),
                ", ".join(f"{tp.topic}[{tp.partition}]" for tp in sorted(assigned)) or "none")

    async def set_up(tp: Any) -> None:
        """Reset the shell's state of ``tp`` to its committed offset (replaying the batch
        boundaries uploaded but not committed before a crash) and consume from there."""
        committed = await consumer.committed(tp)
        if committed is None:
            committed = (await consumer.beginning_offsets([tp]))[tp]
        start_offsets[tp] = committed
        group_committed[tp] = committed
        pending = await call_shell(shell.assigned, tp.topic, tp.partition, committed)
        if tp not in to_set_up:  # revoked while the store was being read
            return
        to_set_up.discard(tp)
        st.setting_up = len(to_set_up)
        consumer.seek(tp, committed)
        ready.add(tp)
        if pending:
            log.info("replaying %d uncommitted batch boundaries of %s-%d",
                     len(pending), tp.topic, tp.partition)

    async def finish(step: StepResult) -> None:
        stats.unreadable_dead_letters += step.unreadable_dead_letters
        for r in step.rejected:
            res = dead(r.topic, r.partition, r.offset, r.key, r.value, r.reason_code, r.reason)
            if inspect.isawaitable(res):
                res = await res
            if res is False:
                stats.dead_letters_known += 1
            else:
                stats.dead_letters += 1
        if not step.batches:
            return
        offsets: dict[Any, int] = {}
        for b in step.batches:
            tp = TopicPartition(b.topic, b.partition)
            offsets[tp] = max(offsets.get(tp, 0), b.last_offset + 1)
            stats.batches += 1
            stats.objects += len(b.objects)
            stats.rows += sum(o.rows for o in b.objects)  # archived, not merely read
        try:
            await consumer.commit(offsets)
        except CommitFailedError as exc:
            # The group rebalanced under us (e.g. the store blocked us too long). The objects
            # are written and their batch markers kept, so whoever gets these partitions next
            # (this process after rejoining, or another) replays the same batches to the same
            # keys: nothing lost, nothing twice.
            log.warning("offset commit refused after a rebalance (%s); the batches stay "
                        "recorded and are replayed after reassignment", exc)
            for tp in offsets:
                ready.discard(tp)
            return
        for tp, off in offsets.items():
            stats.committed[f"{tp.topic}:{tp.partition}"] = off
            group_committed[tp] = off
        await call_shell(shell.committed, step.batches)
        metrics.LAST_COMMIT.labels(group_id).set_to_current_time()
        for b in step.batches:
            metrics.BATCHES.labels(group_id).inc()
            metrics.OBJECTS.labels(group_id).inc(len(b.objects))
            metrics.ROWS.labels(group_id).inc(sum(o.rows for o in b.objects))
            metrics.BYTES.labels(group_id).inc(sum(o.bytes for o in b.objects))
        if shell.newest_written_ms > newest_ms[0]:
            newest_ms[0] = shell.newest_written_ms
            metrics.NEWEST_EVENT.labels(group_id).set(newest_ms[0] / 1000)

    last_idle_commit = 0.0

    async def commit_idle() -> None:
        """Commit past what needs no writing (ticks, re-sent copies, dead letters, transaction
        markers) when nothing before it waits in an open batch: an idle archiver's lag, as
        `kafka-consumer-groups --describe` computes it, is then 0 instead of growing by the
        processors' ticks (RELIABILITY, "Operators' monitoring"). At most once a second."""
        nonlocal last_idle_commit
        now = loop.time()
        if now - last_idle_commit < IDLE_COMMIT_INTERVAL_S:
            return
        last_idle_commit = now
        positions: dict[tuple[str, int], int] = {}
        for tp in sorted(ready):
            pos = await consumer.position(tp)
            if pos > group_committed.get(tp, pos):
                positions[(tp.topic, tp.partition)] = pos
        if not positions:
            return
        released = await call_shell(shell.release_idle, positions)
        if not released:
            return
        offsets = {TopicPartition(t, p): off for (t, p), off in released.items()}
        try:
            await consumer.commit(offsets)
        except CommitFailedError as exc:
            log.warning("offset commit refused after a rebalance (%s); the partitions are set "
                        "up again from their committed offsets", exc)
            for tp in offsets:
                ready.discard(tp)
                if tp in consumer.assignment():
                    to_set_up.add(tp)
            return
        for tp, off in offsets.items():
            stats.committed[f"{tp.topic}:{tp.partition}"] = off
            group_committed[tp] = off

    start_offsets: dict[Any, int] = {}
    group_committed: dict[Any, int] = {}  # the group's committed offset, as this member left it
    explained = False

    async def explain() -> None:
        """Once every assigned partition is set up: say how much there is to do, and when
        there is nothing, why (the group already committed everything into this store)."""
        ends = await consumer.end_offsets(sorted(ready))
        lag = sum(max(0, ends[tp] - start_offsets.get(tp, 0)) for tp in ready)
        if lag:
            log.info("%d records to archive from %d partitions into %s (group %s)", lag,
                     len(ready), dest.url, group_id)
            return
        done = sum(start_offsets.get(tp, 0) for tp in ready)
        stats.note = (
            f"nothing to archive into {dest.url}: consumer group {group_id} has already "
            f"committed all {len(ready)} partitions of {', '.join(topics)} up to their end "
            f"({done} records consumed earlier by this group). Each destination has its own "
            "group, derived from its URL; `trajbus archive run --group NAME` picks another "
            "(a new group archives the topics' retained records from the beginning)")
        log.info("%s", stats.note)

    await consumer.start()
    st.started = True
    lag = asyncio.create_task(export_lag(group_id, consumer))
    try:
        consumer.subscribe(topics, listener=Listener())
        ends: dict[Any, int] = {}
        waited = 0.0
        while not stop_event.is_set():
            for tp in sorted(to_set_up & consumer.assignment()):
                await set_up(tp)
            if not explained and ready and not to_set_up:
                explained = True
                await explain()
            polled = await consumer.getmany(timeout_ms=poll_timeout_ms)
            for tp, batch in list(polled.items()):
                if tp not in ready and batch:
                    # handed out before the partition was set up: not ours to process yet;
                    # set_up seeks back to the committed offset
                    consumer.seek(tp, batch[0].offset)
                    del polled[tp]
            records = [r for batch in polled.values() for r in batch]
            stats.records += len(records)
            step = await call_shell(shell.process, records)
            await finish(step)
            await commit_idle()
            metrics.OPEN_ROWS.labels(group_id).set(
                sum(b[2] for b in shell.batcher.open_batches().values()))
            if until_idle:
                assignment = consumer.assignment()
                if not assignment:
                    waited += poll_timeout_ms / 1000
                    if waited > assignment_timeout_s:
                        raise TimeoutError(f"no partitions of {topics} assigned to group "
                                           f"{group_id} within {assignment_timeout_s:.0f}s")
                    continue
                # until-idle is a single-member run: wait until the group owns every partition
                # of every topic (a topic whose metadata came late joins in a later rebalance).
                expected = {TopicPartition(t, p) for t in topics
                            for p in consumer.partitions_for_topic(t) or ()}
                if any(not consumer.partitions_for_topic(t) for t in topics) or \
                        not expected <= set(assignment):
                    waited += poll_timeout_ms / 1000
                    if waited > assignment_timeout_s:
                        raise TimeoutError(f"not every partition of {topics} was assigned to "
                                           f"group {group_id} within "
                                           f"{assignment_timeout_s:.0f}s")
                    continue
                if to_set_up & set(assignment) or not explained:
                    continue  # set up (and explained) first: then decide whether we are done
                missing = [tp for tp in assignment if tp not in ends]
                if missing:
                    ends.update(await consumer.end_offsets(missing))
                tps = sorted(assignment)
                positions = [await consumer.position(tp) for tp in tps]
                if all(pos >= ends[tp] for pos, tp in zip(positions, tps, strict=True)):
                    break
        await finish(await call_shell(shell.flush_all))
        stats.duplicates, stats.conflicts = shell.duplicates, shell.conflicts
    finally:
        st.stopping = True
        lag.cancel()
        try:
            await close_client(consumer, "archiver consumer")
        finally:
            executor.shutdown(wait=True)
            shell.close()
    return stats
