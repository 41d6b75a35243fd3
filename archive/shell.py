"""The archiver's shell: the synchronous part of ``trajbus archive run`` that turns consumed
records into archived rows -- decode, validate, dedupe, spool, ask the batcher
(:class:`~trajbus.archive.core.ArchiveBatcher`) when to flush, write Parquet objects, the
index and the batch marker (:class:`~trajbus.archive.writer.ArchiveWriter`). It knows no
Kafka client: :func:`trajbus.archive.archiver.run_archiver` polls, runs it in one worker
thread and commits what it reports written.

Guarantees: a batch covers a contiguous offset range of one partition and its objects are
named by it, so a batch replayed after a crash (:meth:`ArchiveShell.assigned` re-arms the
boundaries recorded but not committed) rewrites the same keys with the same rows. One row per
*event*: a re-sent copy of an archived event is skipped, a conflicting copy is written to
``conflicts/`` instead (``dedupe.py``). A record that cannot be decoded or names an invalid
task or sandbox is returned as :class:`Rejected` (a dead letter for the caller to publish),
never archived; a record of the dead-letter topic that cannot be read is logged and counted,
never rejected again. The watermark and the freshness are the fleet's event time only.

Beside the raw event topics the shell archives the decision context (``Topics.context_areas``:
scheduling decisions, watchdog alerts, dead letters) into its own data areas (``decisions/``,
``alerts/``, ``dead_letters/``), with the same batches, keys, markers and dedupe (there by
event id). Its records carry a task (``_fleet`` / ``_unknown`` when they concern none), which
partitions them like events; their sandbox need not be a sandbox id (a tenant's decision:
``tenant:<name>``).
"""

from __future__ import annotations

import json
import logging
import re
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from trajbus.archive.core import ArchiveBatcher, Flush
from trajbus.archive.dedupe import Deduper, Verdict, event_identity, to_signed
from trajbus.archive.rows import decode_as_written, decoded_to_row, row_nbytes
from trajbus.archive.spool import Spool, clear_spool_dir
from trajbus.archive.storage import ObjectStore, mark_archive
from trajbus.archive.writer import ArchiveWriter, BatchResult
from trajbus.bus.blobref import root_uri
from trajbus.bus.digest import content_digest
from trajbus.bus.settings import ArchiveSettings
from trajbus.bus.topics import validate_name
from trajbus.schemas.codec import Codec, DecodeError, default_codec

log = logging.getLogger("trajbus.archive.archiver")


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

