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

Structure: :class:`ArchiveShell` is the synchronous part (decode, spool, batcher decisions,
Parquet writes, uploads); :func:`run_archiver` is the asyncio loop that polls Kafka, runs the
shell in a single worker thread (keeping the event loop responsive for heartbeats), publishes
dead letters, and commits.

Beside the raw event topics the archiver reads the decision context (``Topics.context_areas``:
scheduling decisions, watchdog alerts, dead letters) into its own data areas (``decisions/``,
``alerts/``, ``dead_letters/``), with the same batches, keys, markers, commits and dedupe
(there by event id). Its records carry a task (``_fleet`` / ``_unknown`` when they concern
none), which partitions them like events; their sandbox need not be a sandbox id (a tenant's
decision: ``tenant:<name>``). A record of the dead-letter topic the archiver cannot read is
logged and counted (``ArchiverStats.unreadable_dead_letters``), never dead-lettered again.
"""

from __future__ import annotations

import asyncio
import hashlib
import inspect
import json
import logging
import os
import re
import time
from collections.abc import Awaitable, Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from trajbus.archive.core import ArchiveBatcher, Flush
from trajbus.archive.dedupe import Deduper, Verdict, event_identity, to_signed
from trajbus.archive.rows import decode_as_written, decoded_to_row, row_nbytes
from trajbus.archive.spool import Spool, clear_spool_dir
from trajbus.archive.storage import ObjectStore, mark_archive, open_store
from trajbus.archive.writer import ArchiveWriter, BatchResult
from trajbus.bus.blobref import root_uri
from trajbus.bus.clients import new_consumer
from trajbus.bus.closing import close_client
from trajbus.bus.digest import content_digest
from trajbus.bus.settings import ArchiveSettings, Settings
from trajbus.bus.topics import Topics, validate_name
from trajbus.schemas.codec import Codec, DecodeError, default_codec

log = logging.getLogger(__name__)

IDLE_COMMIT_INTERVAL_S = 1.0
"""How often at most the archiver commits past records that need no writing (ticks...)."""

DeadLetterFn = Callable[[str, int, int, bytes | None, bytes, str, str],
                        Awaitable[bool | None] | bool | None]
"""``dead_letter(topic, partition, offset, key, value, reason_code, reason)``; returns False
when the dead letter was already on the topic (written by another archive destination, or
before a restart) and was not written again."""


class SourceRecord(Protocol):
    """What the shell needs of a consumed record (aiokafka's ConsumerRecord fits)."""

    topic: str
    partition: int
    offset: int
    key: bytes | None
    value: bytes | None


@dataclass(frozen=True, slots=True)
class Rejected:
    topic: str
    partition: int
    offset: int
    key: bytes | None
    value: bytes
    reason_code: str
    reason: str


@dataclass
class StepResult:
    batches: list[BatchResult] = field(default_factory=list)
    rejected: list[Rejected] = field(default_factory=list)
    unreadable_dead_letters: int = 0  # records of the dead-letter topic that do not decode


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


_SAFE = re.compile(r"[^A-Za-z0-9._-]")


class ArchiveShell:
    """Decode, spool, batch and write. Not thread-safe: call from one thread at a time."""

    def __init__(self, store: ObjectStore, cfg: ArchiveSettings, codec: Codec | None = None,
                 spool_dir: str | None = None, dedupe_max_keys: int = 2_000_000,
                 clock: Callable[[], float] = time.monotonic,
                 areas: dict[str, str] | None = None) -> None:
        """``areas``: the data area of each topic not archived into ``events``
        (``Topics.context_areas``)."""
        self.store = store
        # claim-check references into this archive are stored relative to its root
        self.blob_root = root_uri(store.url)
        self.areas = dict(areas or {})
        self.codec = codec or default_codec()
        self.batcher = ArchiveBatcher(cfg.target_object_bytes, cfg.max_open_ms,
                                      cfg.flush_after_ms)
        # The log's time as this shell knows it: the newest Kafka timestamp read, and when
        # (``clock``) it was read. Their sum is a lower bound of the log's time now: the
        # timer that flushes the last batch of a quiet fleet (``ArchiveBatcher.log_tick``).
        self.clock = clock
        self.log_ms: int | None = None
        self._log_read_at = 0.0
        self.writer = ArchiveWriter(store, row_group_rows=cfg.row_group_rows,
                                    write_threads=cfg.write_threads)
        self.spool_dir = Path(spool_dir or cfg.spool_dir)
        clear_spool_dir(self.spool_dir)
        self._spools: dict[tuple[str, int], Spool] = {}
        self._conflict_spools: dict[tuple[str, int], Spool] = {}
        self.dedupe = Deduper(store, max_keys=dedupe_max_keys, areas=self.areas)
        self.watermark_ms: int | None = None
        self.newest_written_ms = 0  # the newest event time in a batch written (metrics)
        self.rows = 0
        self.duplicates = 0  # re-sent copies dropped
        self.conflicts = 0  # conflicting copies sent to conflicts/
        self._valid_names: set[tuple[str, str]] = set()  # (task, sandbox) pairs validated
        mark_archive(store)

    def _spool(self, topic: str, partition: int, conflicts: bool = False) -> Spool:
        tp = (topic, partition)
        spools = self._conflict_spools if conflicts else self._spools
        s = spools.get(tp)
        if s is None:
            name = f"{_SAFE.sub('_', topic)}-{partition}{'-conflicts' if conflicts else ''}"
            s = spools[tp] = Spool(self.spool_dir, name)
        return s

    def process(self, records: Iterable[SourceRecord]) -> StepResult:
        out = StepResult()
        batcher, dedupe = self.batcher, self.dedupe
        valid_names = self._valid_names
        log_ms = self.log_ms
        areas = self.areas
        for rec in records:
            value = rec.value or b""
            topic, partition, offset = rec.topic, rec.partition, rec.offset
            log = getattr(rec, "timestamp", None)  # aiokafka: the record's Kafka timestamp
            if log is not None and (log_ms is None or log > log_ms):
                log_ms = log
            area = areas.get(topic, "events") if areas else "events"
            reason: tuple[str, str] | None = None
            try:
                decoded = decode_as_written(self.codec, value)
                h = decoded.header
                if decoded.kind == "Tick":  # processors' clock marks, not sandbox data
                    self._run(batcher.skip(topic, partition, offset, log), out)
                    continue
                task, sandbox = h["task"], h["sandbox"]
                if area != "events":
                    task = context_task(task)
                    ident = event_identity(str(h["event_id"]))
                else:
                    ident = int(h["seq"])
                    if (task, sandbox) not in valid_names:
                        validate_name("task", task)
                        validate_name("sandbox", sandbox)
                        if len(valid_names) >= 100_000:
                            valid_names.clear()
                        valid_names.add((task, sandbox))
                t = int(h["event_time_ms"])
            except DecodeError as exc:
                reason = (exc.reason_code, str(exc))
            except (ValueError, KeyError, TypeError) as exc:
                reason = ("invalid_header", f"{type(exc).__name__}: {exc}")
            if reason is not None:
                if area == "dead_letters":  # never a dead letter of a dead letter
                    out.unreadable_dead_letters += 1
                    log_warning("%s:%d@%d: unreadable record of the dead-letter topic skipped "
                                "(%s: %s)", topic, partition, offset, *reason)
                else:
                    out.rejected.append(Rejected(topic, partition, offset, rec.key, value,
                                                 *reason))
                self._run(batcher.skip(topic, partition, offset, log), out)
                continue
            digest = content_digest(value)
            verdict = dedupe.check(topic, partition, offset, task, sandbox, h.get("episode"),
                                   ident, digest, t)
            if verdict is Verdict.DUPLICATE:  # a re-sent copy: archived once already
                self.duplicates += 1
                self._run(batcher.skip(topic, partition, offset, log), out)
                continue
            row = decoded_to_row(decoded, topic, partition, offset, self.blob_root)
            row["event_digest"] = to_signed(digest)
            if task != row["task"]:  # a context record naming an invalid task: kept aside
                keep_original_task(row, task)
            if verdict is Verdict.CONFLICT:  # kept out of events/, written to conflicts/
                self.conflicts += 1
                self._spool(topic, partition, conflicts=True).append(row)
                self._run(batcher.skip(topic, partition, offset, log), out)
                continue
            nbytes = row_nbytes(row)
            self._spool(topic, partition).append(row, nbytes)
            self.rows += 1
            flushes = batcher.add(topic, partition, offset, t, nbytes, log)
            if flushes:
                self._run(flushes, out)
            # the watermark is the fleet's event time: context records carry other clocks
            # (a dead letter's is when it was refused), which must not close event batches
            if area == "events" and (self.watermark_ms is None or t > self.watermark_ms):
                self.watermark_ms = t
        if self.watermark_ms is not None:
            self._run(batcher.tick(self.watermark_ms), out)
        now = self.clock()
        if log_ms != self.log_ms:
            self.log_ms, self._log_read_at = log_ms, now
        if self.log_ms is not None:  # the quiet fleet's last batch: by the log's time
            self._run(batcher.log_tick(self.log_ms + int((now - self._log_read_at) * 1000)),
                      out)
        return out

    def flush_all(self) -> StepResult:
        out = StepResult()
        self._run(self.batcher.flush(), out)
        return out

    def _run(self, flushes: list[Flush], out: StepResult) -> None:
        for f in flushes:
            table = self._spool(f.topic, f.partition).take(f.last_offset)
            conflicts = None
            cs = self._conflict_spools.get((f.topic, f.partition))
            if cs is not None and cs.rows:
                conflicts = cs.take(f.last_offset)
            result = self.writer.write_batch(table, f.topic, f.partition, f.first_offset,
                                             f.last_offset, conflicts=conflicts,
                                             area=self.areas.get(f.topic, "events"))
            out.batches.append(result)
            # freshness is the fleet's events': context records carry other clocks
            if f.max_event_time_ms is not None and f.max_event_time_ms > self.newest_written_ms \
                    and f.topic not in self.areas:
                self.newest_written_ms = f.max_event_time_ms
            self.dedupe.flushed(f.topic, f.partition, f.last_offset, _index_refs(result))

    def assigned(self, topic: str, partition: int, committed: int) -> list[tuple[int, int]]:
        """A partition was assigned; consumption resumes at ``committed``. Replays batch
        boundaries recorded (uploaded) but not committed before a crash."""
        self.revoked(topic, partition)
        self.batcher.reset_position(topic, partition, committed)
        self.dedupe.assigned(topic, partition, committed)
        pending = self.writer.pending_batches(topic, partition, committed)
        for first, last in pending:
            self.batcher.expect(topic, partition, first, last)
        return pending

    def revoked(self, topic: str, partition: int) -> None:
        self.batcher.drop(topic, partition)
        self.dedupe.revoked(topic, partition)
        for spools in (self._spools, self._conflict_spools):
            s = spools.pop((topic, partition), None)
            if s is not None:
                s.discard()

    def release_idle(self, positions: dict[tuple[str, int], int]
                     ) -> dict[tuple[str, int], int]:
        """Of the consumer ``positions`` given (already past the last commit), those that may be
        committed now because nothing before them waits to be written: no rows and no
        conflicting copies spooled, no open batch with rows, no recorded boundary to
        reproduce (:meth:`ArchiveBatcher.release_empty`, which drops a row-less open batch).
        The caller commits every one returned, or resets the partition if it cannot."""
        out: dict[tuple[str, int], int] = {}
        for (topic, partition), pos in positions.items():
            cs = self._conflict_spools.get((topic, partition))
            if cs is not None and cs.rows:
                continue
            if self.batcher.release_empty(topic, partition):
                self.dedupe.flushed(topic, partition, pos - 1, [])
                out[(topic, partition)] = pos
        return out

    def committed(self, results: list[BatchResult]) -> None:
        for r in results:
            self.writer.clear_marker(r)

    def close(self) -> None:
        """Stop the writer's threads (between batches nothing is pending)."""
        self.writer.close()


def log_warning(msg: str, *args: Any) -> None:
    log.warning(msg, *args)


def keep_original_task(row: dict[str, Any], task: str) -> None:
    """Archive ``row`` under ``task``; its original task goes to ``payload_json``
    (``$header.task``, which ``rows.row_to_record`` restores)."""
    payload = json.loads(row["payload_json"]) if row.get("payload_json") else {}
    payload.setdefault("$header", {})["task"] = row["task"]
    row["payload_json"] = json.dumps(payload, sort_keys=True, separators=(",", ":"),
                                     default=str)
    row["task"] = task


def context_task(task: Any) -> str:
    """The task a decision-context record is archived under: its own when it is a valid task
    name (``_fleet`` for fleet-wide decisions), else ``_unknown`` (a dead letter of an event
    whose task was itself invalid); such a record keeps its original header in
    ``payload_json``."""
    try:
        return validate_name("task", task) if isinstance(task, str) else "_unknown"
    except ValueError:
        return "_unknown"


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


def _index_refs(result: BatchResult) -> list[tuple[str, str, str, str | None,
                                                  tuple[str, int, int]]]:
    """(date, task, sandbox, episode, (object key, first rg, last rg)) of a batch's index rows."""
    out: list[tuple[str, str, str, str | None, tuple[str, int, int]]] = []
    for o in result.objects:
        if o.index is None:
            continue
        cols = [o.index.column(c).to_pylist() for c in
                ("task", "sandbox", "episode", "row_group_first", "row_group_last")]
        for task, sandbox, episode, lo, hi in zip(*cols, strict=True):
            out.append((o.date, task, sandbox, episode, (o.key, lo, hi)))
    return out


def kafka_dead_letter(settings: Settings, stage: str = "archiver") -> DeadLetterFn:
    """A dead-letter callback publishing to ``Topics.deadletter`` with the shared producer.

    A dead letter's id is derived from the stage, the source position, the reason and the
    bytes, not from the destination: every archive destination (each its own consumer group,
    reading the raw topics from their beginning) refuses the same records with the same ids.
    On its first refusal the callback reads the ids already on the dead-letter topic; one
    already there is not written again (returns False; ``ArchiverStats.dead_letters_known``),
    so a new destination does not dead-letter old garbage a second time."""
    from trajbus.bus.deadletter import count, dead_letter_event
    from trajbus.bus.producer import get_producer

    topic = Topics(settings).deadletter
    known: set[str] | None = None

    async def send(src_topic: str, partition: int, offset: int, key: bytes | None,
                   value: bytes, reason_code: str, reason: str) -> bool:
        nonlocal known
        ev = dead_letter_event(stage=stage, reason_code=reason_code, reason=reason,
                               source_topic=src_topic, source_partition=partition,
                               source_offset=offset, key=key, value=value,
                               producer_id=f"{settings.kafka.client_id}-{stage}")
        if known is None:
            known = await dead_letter_ids(settings, stage)
        if ev.header.event_id in known:
            log.info("%s:%d@%d: %s, already dead-lettered as %s", src_topic, partition, offset,
                     reason_code, ev.header.event_id[:12])
            return False
        producer = await get_producer(settings.kafka)
        await (await producer.send(topic, ev.encode(), key=key))
        known.add(ev.header.event_id)
        count(stage, reason_code)
        return True

    return send


async def dead_letter_ids(settings: Settings, stage: str) -> set[str]:
    """The ids of the dead letters of ``stage`` retained on the dead-letter topic."""
    from trajbus.consumers.operator.tools import read_records
    from trajbus.schemas.codec import DecodeError, default_codec

    codec = default_codec()
    out: set[str] = set()
    for recs in (await read_records(settings, [Topics(settings).deadletter])).values():
        for rec in recs:
            try:
                d = codec.decode(rec.value)
            except DecodeError:
                continue
            if d.kind == "DeadLetter" and d.record["stage"] == stage:
                out.add(str(d.header["event_id"]))
    return out


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
