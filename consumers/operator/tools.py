"""Operators' tools: what did a sandbox do, and why did the processors decide what they did.

Three entry points, all read-only on the live topics except :func:`republish`:

* :func:`read_sandbox_log` -- a sandbox's raw events (``Topics.sandbox_events`` and
  ``Topics.trace_chunks``) as a human timeline of :class:`TimelineEntry`.
* :func:`explain` -- re-runs the processor adapters (``SchedulerProcessor`` and, when it
  exists, ``WatchdogProcessor``) over the log, collects what they derive for a sandbox, and
  compares it with what was recorded on ``Topics.decisions`` / ``Topics.alerts``.
* :func:`republish` -- re-emits one episode as ``ReplaySegment`` records to a debug replay
  topic a trainer's ``ReplayClient`` can read.

Bounded reads
-------------
Every read assigns all partitions of its topics (no consumer group, nothing committed), takes
the end offsets when it starts and stops there: a read sees a consistent prefix of the log and
always terminates, even while producers keep writing. Reads are ``read_committed``, so aborted
transactional outputs of the processors are never shown.

Timeline order
--------------
Entries are deduplicated by ``event_id`` (the first copy in log order wins) and ordered:
sandbox-level events (``episode`` null: lifecycle, heartbeats, probes, drained) first, by
event time then ``seq``; then each episode, episodes ordered by their earliest event time (then
id), events within an episode by ``seq`` (the producer's gapless order, not arrival order).

Replay order for :func:`explain` (an approximation, documented)
---------------------------------------------------------------
Each processor is re-run over exactly the input records its consumer group has committed (what
the live worker has processed, so records that arrived after it stopped are not counted
against it); a processor whose group has committed nothing is not re-run, and its recorded
outputs are listed as ``unchecked``.
A live processor sees its input partitions interleaved in whatever order the fetches returned.
That order is not recorded anywhere, so the re-run merges the partitions by **record
timestamp** (each partition stays in offset order; ties go to the topic listed first, then the
lower partition). This is the best available approximation of the live order. The scheduler
core is built to be insensitive to it for deadline-driven decisions (decisions are stamped with
their deadline, event ids are uuid5 of the decision's identity), so reproduced decisions match
recorded ones by event id; divergences point at either a real nondeterminism, an input lost to
retention, a state restored from a different log, or an out-of-band write to the outputs.
"""

from __future__ import annotations

import asyncio
import base64
import heapq
import importlib
import re
import time
import uuid
from collections import defaultdict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, Literal

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition

from trajbus.bus.closing import close_client
from trajbus.bus.errors import NotFoundError, UserError, existing
from trajbus.bus.kafka import admin_client, check_broker, connection_options
from trajbus.bus.settings import Settings
from trajbus.bus.topics import Topics, episode_record_key
from trajbus.consumers.engine.runner import InRecord, OutRecord
from trajbus.schemas.codec import Codec, Decoded, DecodeError, default_codec

__all__ = [
    "REPUBLISH_PRODUCER",
    "DerivedRecord",
    "Divergence",
    "ExplainedItem",
    "Explanation",
    "RepublishResult",
    "TimelineEntry",
    "debug_replay_task",
    "entry_from_decoded",
    "explain",
    "fleet_status",
    "group_lag",
    "group_offsets",
    "merge_by_timestamp",
    "order_timeline",
    "read_records",
    "read_sandbox_log",
    "republish",
    "restore_scheduler",
    "retained_records",
    "summarize",
    "topic_partitions",
    "watchdog_explain",
]

Source = Literal["kafka", "archive"]
_REPUBLISH_NS = uuid.uuid5(uuid.NAMESPACE_URL, "https://trajbus/operator/republish")
REPUBLISH_PRODUCER = "trajbus.operator.republish"
_TEXTUAL = ("text/", "application/json", "application/x-ndjson", "application/jsonl")


# -- timeline ------------------------------------------------------------------------------
def _iso(ms: int) -> str:
    return datetime.fromtimestamp(ms / 1000, tz=UTC).isoformat(timespec="milliseconds")


@dataclass(frozen=True, slots=True)
class TimelineEntry:
    """One event of a sandbox, decoded, with a one-line human summary.

    ``time_ms`` is the event time (``header.event_time_ms``); ``record`` is the decoded Avro
    record (a dict, ``header`` included); ``raw`` the original single-object-encoded bytes
    (empty when the event came from a source that does not keep them)."""

    time_ms: int
    kind: str
    episode: str | None
    seq: int
    summary: str
    event_id: str
    sandbox: str
    task: str
    record: dict[str, Any] = field(repr=False)
    topic: str = ""
    partition: int = -1
    offset: int = -1
    raw: bytes = field(default=b"", repr=False)
    log_time_ms: int = -1
    """The record's Kafka timestamp (when it was written or appended), -1 when unknown."""

    @property
    def time(self) -> datetime:
        """The event time as an aware UTC datetime."""
        return datetime.fromtimestamp(self.time_ms / 1000, tz=UTC)

    @property
    def time_iso(self) -> str:
        return _iso(self.time_ms)

    def text(self) -> str | None:
        """A trace chunk's inline bytes as text (undecodable bytes replaced), else None."""
        if self.kind != "TraceChunk":
            return None
        data = self.record.get("data")
        if not isinstance(data, bytes | bytearray):
            return None
        return bytes(data).decode("utf-8", errors="replace")

    def line(self, expand: bool = False) -> str:
        """``time  episode#seq  kind  summary`` (with the trace text below when ``expand``)."""
        where = f"{self.episode}#{self.seq}" if self.episode is not None else f"sandbox#{self.seq}"
        out = f"{self.time_iso}  {where:<24} {self.kind:<17} {self.summary}"
        text = self.text() if expand else None
        if text is not None:
            out += "\n" + "\n".join("    | " + ln for ln in text.splitlines() or [""])
        return out

    def to_dict(self, expand: bool = False) -> dict[str, Any]:
        """JSON-ready: bytes become ``"<N bytes>"`` (base64 and ``text`` when ``expand``)."""
        d: dict[str, Any] = {
            "time": self.time_iso, "time_ms": self.time_ms, "kind": self.kind,
            "sandbox": self.sandbox, "task": self.task, "episode": self.episode,
            "seq": self.seq, "event_id": self.event_id, "summary": self.summary,
            "source": {"topic": self.topic, "partition": self.partition, "offset": self.offset},
            "record": _jsonable(self.record, expand),
        }
        text = self.text() if expand else None
        if text is not None:
            d["text"] = text
        return d


def _jsonable(value: Any, expand: bool) -> Any:
    if isinstance(value, bytes | bytearray):
        return base64.b64encode(bytes(value)).decode() if expand else f"<{len(value)} bytes>"
    if isinstance(value, dict):
        return {k: _jsonable(v, expand) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_jsonable(v, expand) for v in value]
    return value


def _ms(x: Any) -> str:
    from trajbus.bus.positions import duration

    n = int(x or 0)
    return f"{n} ms" if n < 10_000 else duration(n)


_LONG_HEX = re.compile(r"\b([0-9a-f]{8})[0-9a-f]{8,}\b")


def shorten_ids(text: str) -> str:
    """Long hex runs (event ids, 64-hex hashes) cut to their first 8 characters and '…'."""
    return _LONG_HEX.sub(r"\1…", text)


def short_id(event_id: str) -> str:
    """An event id as operators read it: 8 characters of a hex id, other ids whole."""
    return shorten_ids(event_id).rstrip("…") if _LONG_HEX.fullmatch(event_id) else event_id


def _clip(text: str, n: int = 80) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= n else text[: n - 1] + "…"


def summarize(kind: str, record: dict[str, Any]) -> str:
    """A human one-liner for an event record (any kind; unknown kinds get a generic line)."""
    r = record
    if kind == "ToolCall":
        args = r.get("args_summary") or _clip(r.get("args_canonical") or "", 60) \
            or f"args {str(r.get('args_hash', ''))[:12]}"
        return f"call {r.get('call_id')}: {r.get('tool')}({_clip(args)})"
    if kind == "ToolResult":
        s = f"result {r.get('call_id')}: {r.get('tool')} {r.get('status')} in " \
            f"{_ms(r.get('duration_ms'))}"
        res = r.get("result_summary")
        return f"{s}: {_clip(res)}" if res else s
    if kind == "SandboxLifecycle":
        prev = r.get("previous_state")
        s = f"lifecycle {prev + ' -> ' if prev else ''}{r.get('state')}"
        if r.get("node"):
            s += f" on {r['node']}"
        if r.get("tenant"):
            s += f" (tenant {r['tenant']})"
        return s + (f": {_clip(r['reason'])}" if r.get("reason") else "")
    if kind == "Heartbeat":
        return f"heartbeat (lease {_ms(r.get('lease_ttl_ms'))})"
    if kind == "LivenessProbe":
        ok = "ok" if r.get("ok") else "FAILED"
        s = f"probe {r.get('probe')} {r.get('target') or ''} {ok} in {_ms(r.get('latency_ms'))}"
        return " ".join(s.split()) + (f": {_clip(r['error'])}" if r.get("error") else "")
    if kind == "TraceChunk":
        s = f"trace {r.get('length')} bytes at offset {r.get('file_offset')} " \
            f"(sha {str(r.get('sha256', ''))[:12]})"
        blob = r.get("blob")
        if isinstance(blob, dict):
            s += f" claim-check {blob.get('uri')}"
        if r.get("reset"):
            s += f" RESET: {_clip(r['reset'], 40)}"
        return s
    if kind == "EpisodeStart":
        parts = [f"tenant {r['tenant']}" if r.get("tenant") else "",
                 f"env {r['env_snapshot']}" if r.get("env_snapshot") else ""]
        extra = ", ".join(p for p in parts if p)
        return "episode start" + (f" ({extra})" if extra else "")
    if kind == "EpisodeEnd":
        s = f"episode end {r.get('outcome')}"
        if r.get("reward") is not None:
            s += f" reward {r['reward']:g}"
        return s + (f": {_clip(r['reason'])}" if r.get("reason") else "")
    if kind == "Drained":
        finals = ", ".join(f"{f['episode']}@{f['final_seq']}" for f in r.get("final_seqs") or [])
        return (f"drained complete={r.get('complete')} unflushed={r.get('unflushed')}"
                + (f" final seqs {finals}" if finals else ""))
    if kind == "SandboxRequest":
        return (f"request {r.get('request_id')} tenant {r.get('tenant')} cpu {r.get('cpu')} "
                f"mem {r.get('memory_mb')} MB gpu {r.get('gpu_share')}"
                + (f" dataset {r['dataset']}" if r.get("dataset") else ""))
    if kind == "TrainerRelease":
        return "trainer release" + (f": {_clip(r['reason'])}" if r.get("reason") else "")
    if kind == "NodeReport":
        return (f"node {r.get('node')} cpu {r.get('cpu_free')}/{r.get('cpu_total')} "
                f"mem {r.get('memory_free_mb')}/{r.get('memory_total_mb')} MB "
                f"gpu {r.get('gpu_free')}/{r.get('gpu_total')}")
    if kind == "SchedulingDecision":
        return f"decision {r.get('decision')}: {_clip(r.get('reason', ''))}"
    if kind == "WatchdogAlert":
        return (f"alert {r.get('alert')} x{r.get('repeat_count')} over {_ms(r.get('span_ms'))} "
                f"seq {r.get('first_seq')}..{r.get('last_seq')}: {_clip(r.get('reason', ''))}")
    if kind == "ReplaySegment":
        flags = [f for f, on in (("FIRST", r.get("is_first")), ("LAST", r.get("is_last")),
                                 ("TRUNCATED", r.get("is_last") and not r.get("is_terminal")))
                 if on]
        gap = r.get("gap")
        return (f"segment seq {r.get('first_seq')}..{r.get('last_seq')} "
                f"({len(r.get('events') or [])} events)"
                + (f" after gap {gap['from_seq']}..{gap['to_seq']}" if gap else "")
                + (" " + " ".join(flags) if flags else ""))
    if kind == "DeadLetter":
        where = f"{r.get('source_topic')} p{r.get('source_partition')}@{r.get('source_offset')}"
        extra = " (with the kept version)" if r.get("conflicting_value") else ""
        return (f"dead letter {r.get('stage')}/{r.get('reason_code')} from {where}, "
                f"{len(r.get('original_value') or b'')} bytes{extra}: {_clip(r.get('reason', ''))}")
    if kind == "Tick":
        return "tick"
    return kind


def entry_from_decoded(decoded: Decoded, rec: InRecord | None = None) -> TimelineEntry:
    """A :class:`TimelineEntry` for a decoded record (``rec``: where it was read from)."""
    h = decoded.header
    return TimelineEntry(
        time_ms=int(h["event_time_ms"]), kind=decoded.kind, episode=h.get("episode"),
        seq=int(h["seq"]), summary=summarize(decoded.kind, decoded.record),
        event_id=str(h["event_id"]), sandbox=str(h["sandbox"]), task=str(h["task"]),
        record=decoded.record,
        topic=rec.topic if rec else "", partition=rec.partition if rec else -1,
        offset=rec.offset if rec else -1, raw=rec.value if rec else b"",
        log_time_ms=rec.timestamp_ms if rec else -1,
    )


def order_timeline(entries: Iterable[TimelineEntry]) -> list[TimelineEntry]:
    """Deduplicate by event id (first in the given order wins) and order as the module
    docstring describes: sandbox-level by time, then episodes (earliest first) by seq."""
    seen: set[str] = set()
    sandbox_level: list[TimelineEntry] = []
    episodes: dict[str, list[TimelineEntry]] = defaultdict(list)
    for e in entries:
        if e.event_id in seen:
            continue
        seen.add(e.event_id)
        if e.episode is None:
            sandbox_level.append(e)
        else:
            episodes[e.episode].append(e)
    sandbox_level.sort(key=lambda e: (e.time_ms, e.seq))
    groups = sorted(episodes.items(), key=lambda kv: (min(e.time_ms for e in kv[1]), kv[0]))
    out = sandbox_level
    for _, evs in groups:
        out.extend(sorted(evs, key=lambda e: (e.seq, e.time_ms)))
    return out


# -- bounded reads ---------------------------------------------------------------------------
async def _retrying(call: Callable[[], Any], what: str, attempts: int = 60) -> Any:
    """Admin calls answer "coordinator not available" for a while on a fresh cluster."""
    from aiokafka.errors import KafkaError

    for attempt in range(attempts):
        try:
            return await call()
        except KafkaError as exc:
            if not getattr(exc, "retriable", False) or attempt == attempts - 1:
                raise
            await asyncio.sleep(0.5)
    raise AssertionError(f"unreachable: {what}")


async def topic_partitions(settings: Settings, topics: Sequence[str] | None = None,
                           pattern: str | None = None) -> dict[str, list[int]]:
    """Partitions of the existing topics among ``topics`` (all topics when None) plus those
    whose name fully matches ``pattern``. Uses the admin client: a bare consumer has no
    metadata for topics it is not subscribed to."""
    from trajbus.bus.inventory import partitions_of

    return await partitions_of(settings, topics, pattern)


async def group_offsets(settings: Settings, group: str) -> dict[TopicPartition, int]:
    """The committed offsets of a consumer group ({} when it has none)."""

    admin = admin_client(settings.kafka, "admin")
    await admin.start()
    try:
        offsets = await _retrying(lambda: admin.list_consumer_group_offsets(group), group)
    finally:
        await admin.close()
    return {tp: om.offset for tp, om in offsets.items() if om.offset >= 0}


async def group_lag(settings: Settings, group: str, topics: Sequence[str]) -> dict[str, int]:
    """Records in ``topics`` beyond ``group``'s committed offsets, per topic (a partition
    without a commit counts from its beginning offset). Records, not offsets: transaction
    markers and aborted records (which a ``read_committed`` processor never sees) are not
    counted, so a caught-up group on transactional input shows 0. A partition more than
    20 000 offsets behind is not read: its offset difference is counted instead."""
    from trajbus.bus.inventory import count_records

    parts = await topic_partitions(settings, topics)
    tps = [TopicPartition(t, p) for t in topics for p in parts.get(t, [])]
    if not tps:
        return {}
    committed = await group_offsets(settings, group)
    consumer = AIOKafkaConsumer(**connection_options(settings.kafka), enable_auto_commit=False,
                                isolation_level="read_committed")
    await consumer.start()
    try:
        begin = await consumer.beginning_offsets(tps)
        end = await consumer.end_offsets(tps)  # the last stable offset: read_committed's end
    finally:
        await close_client(consumer, "consumer")
    ranges = {tp: (max(committed.get(tp, begin[tp]), begin[tp]), end[tp]) for tp in tps}
    records = await count_records(settings, ranges)
    lag: dict[str, int] = {}
    for tp in tps:
        a, b = ranges[tp]
        n = records.get(tp)
        lag[tp.topic] = lag.get(tp.topic, 0) + (max(b - a, 0) if n is None else n)
    return lag


async def read_records(
    settings: Settings, topics: Sequence[str], *, pattern: str | None = None,
    timeout_s: float = 120.0,
) -> dict[TopicPartition, list[InRecord]]:
    """Every record of ``topics`` (and of existing topics matching the regex ``pattern``) from
    the beginning to the end offsets taken at the start, per partition in offset order.
    Missing topics are skipped. Raises ``TimeoutError`` if the end is not reached in time."""
    parts = await topic_partitions(settings, list(dict.fromkeys(topics)), pattern)
    tps = [TopicPartition(t, p) for t in sorted(parts) for p in parts[t]]
    out: dict[TopicPartition, list[InRecord]] = {}
    if not tps:
        return out
    k = settings.kafka
    consumer = AIOKafkaConsumer(
        **connection_options(k), enable_auto_commit=False, isolation_level="read_committed",
        auto_offset_reset="earliest",  # a "latest" reset racing the seek would skip everything
        client_id=f"{k.client_id}-operator", max_partition_fetch_bytes=k.max_request_size,
        fetch_max_bytes=4 * k.max_request_size,
    )
    await consumer.start()
    try:
        consumer.assign(tps)
        begin = await consumer.beginning_offsets(tps)
        end = await consumer.end_offsets(tps)
        for tp in tps:
            out[tp] = []
        pending = {tp for tp in tps if end[tp] > begin[tp]}
        for tp in pending:
            consumer.seek(tp, begin[tp])  # explicit offsets: no asynchronous reset involved
        deadline = time.monotonic() + timeout_s
        while pending:
            if time.monotonic() > deadline:
                raise TimeoutError(f"reading {sorted({tp.topic for tp in pending})} did not "
                                   f"reach the end offsets within {timeout_s:.0f}s")
            batch = await consumer.getmany(*pending, timeout_ms=500)
            for tp, msgs in batch.items():
                for msg in msgs:
                    if msg.offset >= end[tp]:
                        continue
                    out[tp].append(InRecord(tp.topic, tp.partition, msg.offset, msg.key,
                                            msg.value or b"", msg.timestamp))
            for tp in list(pending):
                if await consumer.position(tp) >= end[tp]:
                    pending.discard(tp)
    finally:
        await close_client(consumer, "consumer")
    return out


def merge_by_timestamp(parts: dict[TopicPartition, list[InRecord]],
                       topic_order: Sequence[str] = ()) -> list[InRecord]:
    """One stream from per-partition lists: by record timestamp, each partition in offset
    order, ties to the topic listed first in ``topic_order`` (then name), then the lower
    partition (see "Replay order" in the module docstring)."""
    rank = {t: i for i, t in enumerate(topic_order)}
    keys = sorted(parts, key=lambda tp: (rank.get(tp.topic, len(rank)), tp.topic, tp.partition))
    return list(heapq.merge(*(parts[tp] for tp in keys), key=lambda r: r.timestamp_ms))


def _decode_all(records: Iterable[InRecord], codec: Codec
                ) -> list[tuple[InRecord, Decoded]]:
    out = []
    for rec in records:
        try:
            out.append((rec, codec.decode(rec.value)))
        except DecodeError:
            continue  # the processors dead-letter these; they have no sandbox to show
    return out


def _parse_time_bound(value: int | str | datetime | None) -> int | None:
    if value is None:
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, str):
        if value.lstrip("-").isdigit():
            return int(value)
        value = datetime.fromisoformat(value.replace("Z", "+00:00"))
    if value.tzinfo is None:
        value = value.replace(tzinfo=UTC)
    return int(value.timestamp() * 1000)


async def read_sandbox_log(
    settings: Settings, sandbox: str, episode: str | None = None,
    from_ms: int | str | datetime | None = None, to_ms: int | str | datetime | None = None,
    source: Source = "kafka", *, must_exist: bool = False,
) -> list[TimelineEntry]:
    """The timeline of ``sandbox`` (one ``episode`` of it when given), from the raw input
    topics or from the archive. ``from_ms``/``to_ms`` bound the event time (inclusive; epoch
    ms, an ISO-8601 string, or a datetime; naive times are UTC). Ordered and deduplicated as
    the module docstring says. ``must_exist``: raise :class:`NotFoundError` saying which
    sandboxes (or which episodes of the sandbox) exist when the log has no event of the
    sandbox (or episode) at all."""
    lo, hi = _parse_time_bound(from_ms), _parse_time_bound(to_ms)
    sandboxes: set[str] = set()
    if source == "archive":
        entries = _archive_entries(settings, sandbox, episode)
    elif source == "kafka":
        await check_broker(settings.kafka)
        topics = Topics(settings)
        parts = await read_records(settings, topics.input_topics)
        records = [r for tp in sorted(parts, key=lambda tp: (tp.topic, tp.partition))
                   for r in parts[tp]]
        entries = []
        for rec, d in _decode_all(records, default_codec()):
            owner = d.header.get("sandbox")
            if owner == sandbox:
                entries.append(entry_from_decoded(d, rec))
            elif d.kind != "Tick" and isinstance(owner, str):
                sandboxes.add(owner)
    else:
        raise ValueError(f"unknown source {source!r}: use 'kafka' or 'archive'")
    if must_exist:
        _require(sandbox, episode, entries, sandboxes, source)
    entries = [e for e in entries
               if (episode is None or e.episode == episode)
               and (lo is None or e.time_ms >= lo) and (hi is None or e.time_ms <= hi)]
    return order_timeline(entries)


def _require(sandbox: str, episode: str | None, entries: Sequence[TimelineEntry],
             others: set[str], source: Source) -> None:
    where = "the Kafka topics (within their retention)" if source == "kafka" else "the archive"
    if not entries:
        raise NotFoundError(f"no events of sandbox {sandbox!r} in {where}",
                            hint=existing("sandboxes", others) if source == "kafka" else
                            "try --source kafka for recent events")
    if episode is not None and not any(e.episode == episode for e in entries):
        episodes = {e.episode for e in entries if e.episode is not None}
        raise NotFoundError(f"sandbox {sandbox!r} has no episode {episode!r} in {where}",
                            hint=existing(f"episodes of {sandbox}", episodes))


async def sandboxes_in_log(settings: Settings) -> set[str]:
    """Every sandbox with an event on the raw input topics."""
    parts = await read_records(settings, Topics(settings).input_topics)
    return {str(d.header.get("sandbox")) for tp in parts
            for _, d in _decode_all(parts[tp], default_codec()) if d.kind != "Tick"}


def _archive_entries(settings: Settings, sandbox: str, episode: str | None
                     ) -> list[TimelineEntry]:
    """The seam to the archive: ``trajbus.archive.query.sandbox_events(settings, sandbox,
    episode=None)`` returning the sandbox's events as :class:`Decoded`, ``(kind, record)``
    pairs, or archive rows (dicts with ``kind`` and the archive columns)."""
    try:
        query = importlib.import_module("trajbus.archive.query")
    except ModuleNotFoundError as exc:
        raise NotImplementedError("--source archive needs trajbus.archive.query, which is not "
                                  "installed; use --source kafka") from exc
    fn: Callable[..., Iterable[Any]] | None = getattr(query, "sandbox_events", None)
    if fn is None:
        raise NotImplementedError(
            "--source archive is not available yet: trajbus.archive.query has no "
            "sandbox_events(settings, sandbox, episode=None) function returning a sandbox's "
            "events (ArchiveReader.episode needs the task). Use --source kafka while the "
            "events are still within the topics' retention.")
    entries = []
    for item in fn(settings, sandbox, episode=episode):
        if isinstance(item, Decoded):
            entries.append(entry_from_decoded(item))
            continue
        if isinstance(item, tuple):
            kind, record = item
        else:
            from trajbus.archive.rows import row_to_record

            kind, record = item["kind"], row_to_record(item)
        h = record["header"]
        entries.append(TimelineEntry(
            time_ms=int(h["event_time_ms"]), kind=kind, episode=h.get("episode"),
            seq=int(h["seq"]), summary=summarize(kind, record), event_id=str(h["event_id"]),
            sandbox=str(h["sandbox"]), task=str(h["task"]), record=record))
    return entries


# -- explain ---------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class DerivedRecord:
    """A scheduling decision or watchdog alert, recorded or reproduced."""

    event_id: str
    kind: str  # SchedulingDecision | WatchdogAlert
    label: str  # the decision or alert kind (RECLAIM, LOOP, ...)
    time_ms: int
    reason: str
    producer_id: str
    record: dict[str, Any] = field(repr=False)
    log_time_ms: int = -1
    """When it was written (recorded) or when its triggering input was written (reproduced)."""

    @property
    def cause_event_ids(self) -> list[str]:
        return list(self.record.get("cause_event_ids") or [])

    def comparable(self) -> dict[str, Any]:
        """The record without fields allowed to differ between runs (producer id, and the
        scheduler's global decision counter ``header.seq``)."""
        d = dict(self.record)
        d["header"] = {k: v for k, v in self.record["header"].items()
                       if k not in ("producer_id", "seq")}
        return d

    @classmethod
    def from_decoded(cls, d: Decoded, log_time_ms: int = -1) -> DerivedRecord:
        r = d.record
        label = r.get("decision") or r.get("alert") or d.kind
        return cls(event_id=str(r["header"]["event_id"]), kind=d.kind, label=str(label),
                   time_ms=int(r["header"]["event_time_ms"]), reason=str(r.get("reason", "")),
                   producer_id=str(r["header"]["producer_id"]), record=r,
                   log_time_ms=log_time_ms)


Status = Literal["reproduced", "recorded_only", "reproduced_only", "differs", "unchecked"]


@dataclass(frozen=True, slots=True)
class ExplainedItem:
    """One decision/alert about the sandbox with the events that caused it."""

    derived: DerivedRecord
    status: Status
    causes: tuple[TimelineEntry, ...]
    unresolved_causes: tuple[str, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        return {
            "event_id": self.derived.event_id, "kind": self.derived.kind,
            "label": self.derived.label, "time": _iso(self.derived.time_ms),
            "time_ms": self.derived.time_ms, "written_ms": self.derived.log_time_ms,
            "reason": self.derived.reason,
            "producer_id": self.derived.producer_id, "status": self.status,
            "record": _jsonable(self.derived.record, False),
            "causes": [c.to_dict() for c in self.causes],
            "unresolved_causes": list(self.unresolved_causes),
        }


@dataclass(frozen=True, slots=True)
class Divergence:
    kind: Literal["recorded_not_reproduced", "reproduced_not_recorded", "content_differs"]
    event_id: str
    summary: str
    detail: str = ""

    def to_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "event_id": self.event_id, "summary": self.summary,
                "detail": self.detail}


@dataclass
class Explanation:
    """What the processors decided about a sandbox, why, and whether a re-run agrees."""

    sandbox: str
    items: list[ExplainedItem]
    divergences: list[Divergence]
    notes: list[str]
    processors: list[str]
    inputs_read: dict[str, int]

    @property
    def consistent(self) -> bool:
        return not self.divergences

    def to_dict(self) -> dict[str, Any]:
        return {
            "sandbox": self.sandbox, "consistent": self.consistent,
            "processors": self.processors, "inputs_read": self.inputs_read,
            "items": [i.to_dict() for i in self.items],
            "divergences": [d.to_dict() for d in self.divergences], "notes": self.notes,
        }

    def render(self) -> str:
        """Each decision/alert as cause -> effect, in the order they happened (when they were
        written to Kafka; a decision citing another comes after it), with human times and
        short ids (``--json`` has the whole ids and epoch ms)."""
        lines = [f"sandbox {self.sandbox}: {len(self.items)} decisions/alerts, causes before "
                 f"effects; re-ran {', '.join(self.processors) or 'nothing'} over "
                 f"{sum(self.inputs_read.values())} input records"]
        day = _day(_when(self.items[0].derived)) if self.items else None
        if day:
            lines.append(f"times: when written to Kafka, UTC, {day}; ids: first 8 characters")
        for it in self.items:
            d = it.derived
            lines.append("")
            lines.append(f"{_clock(_when(d), day)}  {d.label} by "
                         f"{d.producer_id.removeprefix('trajbus.')} [{it.status}]  id "
                         f"{short_id(d.event_id)}")
            for c in sorted(it.causes, key=lambda c: (_entry_when(c), c.seq)):
                where = f"{c.episode}#{c.seq}" if c.episode is not None else f"sandbox#{c.seq}"
                lines.append(f"    cause   {_clock(_entry_when(c), day)}  {c.kind:<17} "
                             f"{where:<14} {humanize(c.summary)}  (id {short_id(c.event_id)})")
            for cid in it.unresolved_causes:
                lines.append(f"    cause   {'?':<12}  id {short_id(cid)} (not found in the log "
                             "read)")
            lines.append(f"    effect  {humanize(d.reason)}")
        lines.append("")
        if self.divergences:
            lines.append(f"DIVERGENCES ({len(self.divergences)}):")
            for dv in self.divergences:
                lines.append(f"  {dv.kind}: {short_id(dv.event_id)} {humanize(dv.summary)}"
                             + (f" ({dv.detail})" if dv.detail else ""))
        else:
            lines.append("no divergence: every recorded decision/alert was reproduced, "
                         "and nothing else")
        lines.extend(f"note: {n}" for n in self.notes)
        return "\n".join(lines)


def _when(d: DerivedRecord) -> int:
    return d.log_time_ms if d.log_time_ms >= 0 else d.time_ms


def _entry_when(e: TimelineEntry) -> int:
    return e.log_time_ms if e.log_time_ms >= 0 else e.time_ms


def _day(ms: int) -> str:
    return datetime.fromtimestamp(ms / 1000, tz=UTC).strftime("%Y-%m-%d")


def _clock(ms: int, day: str | None) -> str:
    """``22:33:31.695`` (with the date in front when it is not ``day``)."""
    t = datetime.fromtimestamp(ms / 1000, tz=UTC)
    text = t.strftime("%H:%M:%S.") + f"{t.microsecond // 1000:03d}"
    return text if _day(ms) == day else f"{_day(ms)} {text}"


_MS_AMOUNT = re.compile(r"\b(\d{4,}) ?ms\b")


def humanize(text: str) -> str:
    """Long hex ids shortened, millisecond amounts of 1 s and more as durations."""
    from trajbus.bus.positions import duration

    return _MS_AMOUNT.sub(lambda m: duration(int(m[1])), shorten_ids(text))


def causal_order(items: Sequence[ExplainedItem]) -> list[ExplainedItem]:
    """Items by the time they were written, except that an item citing another (its
    ``cause_event_ids``) always comes after it."""
    by_time = sorted(items, key=lambda it: (_when(it.derived), it.derived.event_id))
    ids = {it.derived.event_id: it for it in by_time}
    out: list[ExplainedItem] = []
    placed: set[str] = set()

    def place(it: ExplainedItem, visiting: set[str]) -> None:
        eid = it.derived.event_id
        if eid in placed or eid in visiting:
            return
        visiting.add(eid)
        for cid in it.derived.cause_event_ids:
            if cid in ids:
                place(ids[cid], visiting)
        placed.add(eid)
        out.append(it)

    for it in by_time:
        place(it, set())
    return out


@dataclass
class _Rerun:
    name: str
    input_topics: list[str]
    pattern: str | None
    factory: Callable[[], Any]
    global_state: bool


def _reruns(settings: Settings, notes: list[str]) -> list[_Rerun]:
    from trajbus.consumers.engine import processors

    out = []
    sspec = processors.scheduler_spec(settings)
    out.append(_Rerun("scheduler", sspec.input_topics, sspec.input_pattern, sspec.factory,
                      sspec.global_state))
    wspec_fn = getattr(processors, "watchdog_spec", None)
    wcls = getattr(processors, "WatchdogProcessor", None)
    if wspec_fn is not None:
        w = wspec_fn(settings)
        out.append(_Rerun("watchdog", w.input_topics, w.input_pattern, w.factory,
                          w.global_state))
    elif wcls is not None:
        out.append(_Rerun("watchdog", Topics(settings).input_topics, None,
                          lambda: wcls(settings), False))
    else:
        notes.append("watchdog not re-run: trajbus.consumers.engine.processors has no "
                     "WatchdogProcessor yet; recorded watchdog alerts/decisions are listed "
                     "as 'unchecked'")
    return out


def _run_adapter(run: _Rerun, parts: dict[TopicPartition, list[InRecord]],
                 upto: dict[TopicPartition, int]) -> list[tuple[OutRecord, int]]:
    """Feed one processor kind the merged log exactly as the runner would: one adapter for
    every partition (global) or one per partition number (as ``Runner._slot`` does), only the
    records below ``upto`` (the group's committed offsets: what the live group processed)."""
    mine = {tp: recs for tp, recs in parts.items()
            if tp.topic in run.input_topics
            or (run.pattern is not None and re.match(run.pattern, tp.topic))}
    mine = {tp: [r for r in recs if r.offset < upto.get(tp, 0)] for tp, recs in mine.items()}
    cores: dict[int, Any] = {}
    outs: list[tuple[OutRecord, int]] = []
    for rec in merge_by_timestamp(mine, run.input_topics):
        slot = 0 if run.global_state else rec.partition
        core = cores.get(slot)
        if core is None:
            core = cores[slot] = run.factory()
        outs.extend((out, rec.timestamp_ms) for out in core.handle(rec))
    return outs


async def explain(settings: Settings, sandbox: str, *, timeout_s: float = 300.0) -> Explanation:
    """Re-run the scheduler (and the watchdog, when present) over the whole log, keep what they
    derive about ``sandbox`` and compare it by event id with ``Topics.decisions`` and
    ``Topics.alerts``. Reads every input of those processors (the scheduler is global: one
    sandbox's decisions depend on the fleet), so it costs a full read of the retained log."""
    await check_broker(settings.kafka)
    topics = Topics(settings)
    codec = default_codec()
    notes = ["replay order: partitions merged by record timestamp (each partition in offset "
             "order), the best available approximation of the live consumption order"]
    runs = _reruns(settings, notes)
    wanted = list(dict.fromkeys(t for r in runs for t in r.input_topics))
    pattern = "|".join(f"(?:{r.pattern})" for r in runs if r.pattern) or None
    parts, recorded_parts = await asyncio.gather(
        read_records(settings, wanted, pattern=pattern, timeout_s=timeout_s),
        read_records(settings, [topics.decisions, topics.alerts], timeout_s=timeout_s),
    )
    inputs_read: dict[str, int] = defaultdict(int)
    for tp, recs in parts.items():
        inputs_read[tp.topic] += len(recs)

    # every input event, by id, for resolving causes
    index: dict[str, TimelineEntry] = {}
    for tp in sorted(parts, key=lambda tp: (tp.topic, tp.partition)):
        for rec, d in _decode_all(parts[tp], codec):
            eid = d.header.get("event_id")
            if isinstance(eid, str) and eid not in index:
                index[eid] = entry_from_decoded(d, rec)

    reproduced: dict[str, DerivedRecord] = {}
    ran: set[str] = set()
    for run in runs:
        group = f"{settings.topics.prefix}.{run.name}"
        upto = await group_offsets(settings, group)
        if not upto:
            notes.append(f"{run.name}: not re-run, its consumer group {group} has committed "
                         "nothing (the processor has not run); its recorded outputs, if any, "
                         "are listed as 'unchecked'")
            continue
        ran.add(run.name)
        notes.append(f"{run.name}: re-ran over the input records up to the offsets group "
                     f"{group} has committed, i.e. what the live worker has processed")
        for out, log_time in _run_adapter(run, parts, upto):
            if out.topic not in (topics.decisions, topics.alerts):
                continue
            dr = DerivedRecord.from_decoded(codec.decode(out.value), log_time)
            if dr.record["header"]["sandbox"] == sandbox:
                reproduced.setdefault(dr.event_id, dr)

    recorded: dict[str, DerivedRecord] = {}
    for tp in sorted(recorded_parts, key=lambda tp: (tp.topic, tp.partition)):
        for rec, d in _decode_all(recorded_parts[tp], codec):
            if d.kind in ("SchedulingDecision", "WatchdogAlert") \
                    and d.header.get("sandbox") == sandbox:
                dr = DerivedRecord.from_decoded(d, rec.timestamp_ms)
                recorded.setdefault(dr.event_id, dr)

    skipped = ({r.name for r in runs} - ran) | ({"watchdog"} if len(runs) == 1 else set())
    items: list[ExplainedItem] = []
    divergences: list[Divergence] = []
    for eid in sorted(set(recorded) | set(reproduced),
                      key=lambda i: ((recorded.get(i) or reproduced[i]).time_ms, i)):
        rec_d, rep_d = recorded.get(eid), reproduced.get(eid)
        status: Status
        if rec_d is not None and rep_d is not None:
            status = "reproduced"
            if rec_d.comparable() != rep_d.comparable():
                status = "differs"
                divergences.append(Divergence(
                    "content_differs", eid, f"{rec_d.label} at {_iso(rec_d.time_ms)}",
                    "same event id, different content"))
        elif rec_d is not None:
            status = "recorded_only"
            if rec_d.producer_id.removeprefix("trajbus.") in skipped:
                status = "unchecked"
            else:
                divergences.append(Divergence(
                    "recorded_not_reproduced", eid,
                    f"{rec_d.label} at {_iso(rec_d.time_ms)} by {rec_d.producer_id}: "
                    f"{rec_d.reason}"))
        else:
            assert rep_d is not None
            status = "reproduced_only"
            divergences.append(Divergence(
                "reproduced_not_recorded", eid,
                f"{rep_d.label} at {_iso(rep_d.time_ms)}: {rep_d.reason}"))
        d = rec_d or rep_d
        assert d is not None
        causes, unresolved = _causes(d, index)
        items.append(ExplainedItem(d, status, tuple(causes), tuple(unresolved)))
    if not items and not any(e.sandbox == sandbox for e in index.values()):
        raise NotFoundError(f"no events of sandbox {sandbox!r} in the processors' inputs "
                            "and no decision or alert about it",
                            hint=existing("sandboxes", {e.sandbox for e in index.values()
                                                        if e.kind != "Tick"}))
    return Explanation(sandbox, causal_order(items), divergences, notes, sorted(ran),
                       dict(inputs_read))


def _causes(d: DerivedRecord, index: dict[str, TimelineEntry]
            ) -> tuple[list[TimelineEntry], list[str]]:
    found, missing = [], []
    for cid in dict.fromkeys(d.cause_event_ids):
        if cid in index:
            found.append(index[cid])
        else:
            missing.append(cid)
    if d.kind == "WatchdogAlert":  # alerts cite their evidence by seq range, not by id
        h = d.record["header"]
        lo, hi = d.record.get("first_seq", -1), d.record.get("last_seq", -1)
        found.extend(sorted(
            (e for e in index.values()
             if e.sandbox == h["sandbox"] and e.episode == h.get("episode")
             and e.seq in (lo, hi) and e.kind in ("ToolCall", "ToolResult")),
            key=lambda e: (e.seq, e.kind)))
    return found, missing


# -- republish -------------------------------------------------------------------------------
def debug_replay_task(task: str) -> str:
    """The task name a trainer subscribes to for a republished episode: ``debug-<task>``."""
    return f"debug-{task}"


@dataclass(frozen=True, slots=True)
class RepublishResult:
    topic: str
    sandbox: str
    episode: str
    segments: int
    events: int
    first_seq: int
    last_seq: int
    is_last: bool
    gaps: tuple[tuple[int, int], ...]


def _segment_plan(entries: list[TimelineEntry], max_events: int, max_bytes: int
                  ) -> list[tuple[list[TimelineEntry], tuple[int, int] | None]]:
    """Split seq-ordered entries at seq gaps and size limits: [(events, gap before)]."""
    plan: list[tuple[list[TimelineEntry], tuple[int, int] | None]] = []
    cur: list[TimelineEntry] = []
    cur_bytes = 0
    gap: tuple[int, int] | None = None
    prev = -1
    for e in entries:
        size = len(e.raw)
        missing = (prev + 1, e.seq - 1) if e.seq > prev + 1 else None
        if cur and (missing or len(cur) >= max_events or cur_bytes + size > max_bytes):
            plan.append((cur, gap))
            cur, cur_bytes, gap = [], 0, None
        if not cur:
            gap = missing
        cur.append(e)
        cur_bytes += size
        prev = e.seq
    if cur:
        plan.append((cur, gap))
    return plan


async def republish(
    settings: Settings, task: str, sandbox: str, episode: str, to_topic: str | None = None,
    source: Source = "kafka",
) -> RepublishResult:
    """Re-emit one episode as ``ReplaySegment`` records (events in seq order, deduplicated;
    split only at seq gaps, which become the segment's ``gap``, and at the replay size limits)
    to ``to_topic``, default ``Topics(settings).replay("debug-<task>")``: a trainer reads it
    with ``ReplayClient(["debug-<task>"], group)``. ``is_first`` is set when seq 0 is in the
    log, ``is_last``/``is_terminal`` from the EpisodeEnd. Segment event ids are uuid5 of
    (topic, sandbox, episode, segment index): republishing twice gives recognisable
    duplicates, which the ReplayClient drops.

    Caution: processors that subscribe to every ``<prefix>.replay.*`` topic (the watchdog and
    the scheduler's replay acknowledgements) also read the debug topic unless their pattern
    excludes ``debug-`` tasks."""
    from trajbus.bus.admin import ensure_topics
    from trajbus.bus.producer import producer_options
    from trajbus.bus.topics import TopicSpec

    topics = Topics(settings)
    topic = to_topic or topics.replay(debug_replay_task(task))
    codec = default_codec()
    entries = await read_sandbox_log(settings, sandbox, episode=episode, source=source,
                                     must_exist=True)
    tasks = {e.task for e in entries}
    if task not in tasks:
        raise UserError(f"episode {episode!r} of sandbox {sandbox!r} belongs to task "
                        f"{' and '.join(sorted(tasks))}, not {task!r}: nothing published",
                        hint=f"--task {sorted(tasks)[0]}")
    by_seq: dict[int, TimelineEntry] = {}
    for e in entries:
        by_seq.setdefault(e.seq, e)
    events = [by_seq[s] for s in sorted(by_seq)]
    if not events:
        raise ValueError(f"no events of sandbox {sandbox!r} episode {episode!r} in the "
                         f"{source} log")
    events = [e if e.raw else _with_raw(e, codec) for e in events]
    end = next((e for e in reversed(events) if e.kind == "EpisodeEnd"), None)
    is_last = end is not None and end.seq == events[-1].seq
    plan = _segment_plan(events, settings.replay.max_segment_events,
                         settings.replay.max_segment_bytes)
    if events[0].seq > 0:  # the log lost the episode's beginning (retention): say so
        first_evs, _ = plan[0]
        plan[0] = (first_evs, (0, events[0].seq - 1))
    values: list[bytes] = []
    for i, (evs, gap) in enumerate(plan):
        last = i == len(plan) - 1
        record = {
            "header": {
                "event_id": uuid.uuid5(_REPUBLISH_NS, f"{topic}|{sandbox}|{episode}|{i}").hex,
                "task": evs[0].task or task, "sandbox": sandbox, "episode": episode, "seq": i,
                "event_time_ms": evs[-1].time_ms, "producer_id": REPUBLISH_PRODUCER,
                "policy_version": None,
            },
            "first_seq": evs[0].seq, "last_seq": evs[-1].seq,
            "events": [e.raw for e in evs],
            "gap": None if gap is None else {"from_seq": gap[0], "to_seq": gap[1]},
            "is_first": evs[0].seq == 0,
            "is_last": last and is_last,
            "is_terminal": last and is_last and end is not None
            and end.record.get("outcome") == "TERMINAL",
        }
        values.append(codec.encode("ReplaySegment", record))
    await ensure_topics(settings, [TopicSpec(
        topic, settings.topics.partitions, f"operator republish of {task}", "sandbox/episode",
        max_message_bytes=settings.topics.max_message_bytes)])
    producer = AIOKafkaProducer(**producer_options(
        settings.kafka, client_id=f"{settings.kafka.client_id}-republish"))
    await producer.start()
    try:
        key = episode_record_key(sandbox, episode)
        futures = [await producer.send(topic, v, key=key) for v in values]
        await asyncio.gather(*futures)
    finally:
        await close_client(producer, "republish producer")
    return RepublishResult(
        topic=topic, sandbox=sandbox, episode=episode, segments=len(values), events=len(events),
        first_seq=events[0].seq, last_seq=events[-1].seq, is_last=is_last,
        gaps=tuple(g for _, g in plan if g is not None))


def _with_raw(e: TimelineEntry, codec: Codec) -> TimelineEntry:
    from dataclasses import replace

    return replace(e, raw=codec.encode(e.kind, e.record))


# -- status ----------------------------------------------------------------------------------
async def retained_records(settings: Settings, topics: Sequence[str]) -> dict[str, int]:
    """Records currently retained per existing topic, as a ``read_committed`` reader sees them
    (transaction markers and aborted records not counted; a partition of more than 20 000
    offsets is not read: its offset difference is counted instead)."""
    from trajbus.bus.inventory import count_records

    parts = await topic_partitions(settings, topics)
    tps = [TopicPartition(t, p) for t in parts for p in parts[t]]
    out = dict.fromkeys(parts, 0)
    if not tps:
        return out
    consumer = AIOKafkaConsumer(**connection_options(settings.kafka), enable_auto_commit=False,
                                isolation_level="read_committed")
    await consumer.start()
    try:
        begin = await consumer.beginning_offsets(tps)
        end = await consumer.end_offsets(tps)
    finally:
        await close_client(consumer, "consumer")
    counted = await count_records(settings, {tp: (begin[tp], end[tp]) for tp in tps})
    for tp in tps:
        n = counted.get(tp)
        out[tp.topic] += end[tp] - begin[tp] if n is None else n
    return out


async def fleet_status(settings: Settings) -> dict[str, Any]:
    """For ``trajbus status``: the cluster's live brokers and the partitions under-replicated,
    under min.insync.replicas or offline; per processor group, its live members (client id,
    host, assigned partitions; none: no worker runs it) and its lag (records not yet
    processed, transaction markers excluded) per input topic; dead letters retained; the
    replay topics with their sizes."""
    from trajbus.bus.inventory import describe_group
    from trajbus.consumers.engine import processors

    await check_broker(settings.kafka)
    topics = Topics(settings)
    existing_topics = set(await topic_partitions(settings))
    groups: dict[str, Any] = {}
    for name in ("reorder", "watchdog", "scheduler"):
        spec_fn = getattr(processors, f"{name}_spec", None)
        if spec_fn is None:
            groups[name] = {"available": False}
            continue
        spec = spec_fn(settings)
        inputs = [t for t in spec.input_topics if t in existing_topics]
        if spec.input_pattern:
            rx = re.compile(spec.input_pattern)
            inputs += sorted(t for t in existing_topics if rx.match(t) and t not in inputs)
        group = f"{settings.topics.prefix}.{spec.name}"
        lag = await group_lag(settings, group, inputs) if inputs else {}
        info = await describe_group(settings, group)
        groups[name] = {"available": True, "group": group, "lag": lag,
                        "total_lag": sum(lag.values()), "state": info.state,
                        "members": [{"client_id": m.client_id, "host": m.host,
                                     "partitions": m.assignment} for m in info.members]}
    from trajbus.bus.inventory import consumer_groups

    archivers: dict[str, Any] = {}
    raw = [t for t in topics.archive_topics if t in existing_topics]
    for group in await consumer_groups(settings, f"{settings.topics.prefix}.archiver."):
        lag = await group_lag(settings, group, raw) if raw else {}
        info = await describe_group(settings, group)
        archivers[group] = {"group": group, "lag": lag, "total_lag": sum(lag.values()),
                            "state": info.state,
                            "members": [{"client_id": m.client_id, "host": m.host,
                                         "partitions": m.assignment} for m in info.members]}
    replay_prefix = f"{topics.prefix}.replay."
    replay = sorted(t for t in existing_topics if t.startswith(replay_prefix))
    counts = await retained_records(settings, [topics.deadletter, *replay])
    from trajbus.bus.inventory import cluster_health

    return {
        "bootstrap_servers": settings.kafka.bootstrap_servers,
        "cluster": (await cluster_health(settings)).as_dict(),
        "prefix": settings.topics.prefix,
        "processors": groups,
        "archivers": archivers,
        "dead_letters": counts.get(topics.deadletter, 0),
        "deadletter_topic": topics.deadletter,
        "replay_topics": {t: {"task": t[len(replay_prefix):], "records": counts.get(t, 0)}
                          for t in replay},
    }


async def restore_scheduler(settings: Settings) -> Any:
    """A SchedulerCore rebuilt from the committed ``<prefix>.scheduler.state`` changelog (the
    latest record per key; tombstones delete), configured as the worker configures it."""
    from trajbus.consumers.engine.processors import SchedulerProcessor

    await check_broker(settings.kafka)
    parts = await read_records(settings, [f"{settings.topics.prefix}.scheduler.state"])
    latest: dict[str, bytes | None] = {}
    for tp in sorted(parts, key=lambda tp: tp.partition):
        for r in parts[tp]:
            latest[r.key.decode() if r.key else ""] = r.value or None
    core = SchedulerProcessor(settings).core
    core.restore_snapshot({k: v for k, v in latest.items() if v is not None})
    return core


async def watchdog_explain(settings: Settings, sandbox: str, episode: str | None = None,
                           *, from_log: bool = False) -> list[Any]:
    """The watchdog core's explanation (``WatchdogCore.explain``) for a sandbox's tracked
    streams. Default: the live state, restored from ``<prefix>.watchdog.state`` (streams of
    ended episodes are no longer tracked there). ``from_log``: a fresh core fed the sandbox's
    timeline from Kafka *without* its EpisodeEnd and DRAINING/RECYCLED events, so it explains
    finished episodes too ("why did the loop rule (not) fire during this episode")."""
    from trajbus.consumers.watchdog.core import WatchdogCore, state_key

    core = WatchdogCore(settings.watchdog, getattr(settings.watchdog, "per_task", None))
    if from_log:
        for e in await read_sandbox_log(settings, sandbox, episode=episode, must_exist=True):
            if e.kind == "EpisodeEnd" or (e.kind == "SandboxLifecycle"
                                          and e.record.get("state") in ("DRAINING", "RECYCLED")):
                continue
            core.handle(e.kind, e.record)
        return core.explain(sandbox, episode)
    await check_broker(settings.kafka)
    parts = await read_records(settings, [f"{settings.topics.prefix}.watchdog.state"])
    latest: dict[str, bytes | None] = {}
    mine = state_key(sandbox, "")
    for tp in sorted(parts, key=lambda tp: tp.partition):
        for r in parts[tp]:
            key = r.key.decode(errors="replace") if r.key else ""
            if key == sandbox or key.startswith(mine):
                latest[key] = r.value or None
    for key in sorted(latest):
        blob = latest[key]
        if blob is not None:
            core.restore(key, blob)
    return core.explain(sandbox, episode)


# -- watchdog history ------------------------------------------------------------------------
@dataclass(frozen=True)
class WatchdogMoment:
    """A moment of one stream's history: an alert firing, the episode's end, or the end of
    the log (a stream still tracked there: an episode truncated, e.g. terminated)."""

    what: str  # LOOP | LOOP_ENDED | STALL | episode end | end of the log
    time_ms: int  # the event time of the event that led to it
    seq: int
    explanation: Any  # the watchdog core's Explanation of the stream at that moment
    alert: dict[str, Any] | None = None  # the alert's fields (pattern, repeats, span, ...)
    decision: str | None = None  # the decision the alert requested (TERMINATE)
    evidence: tuple[TimelineEntry, ...] = ()  # the calls of the alert's window


@dataclass
class StreamHistory:
    """What the loop rule saw in one (sandbox, episode) stream, moment by moment."""

    task: str
    sandbox: str
    episode: str | None
    moments: list[WatchdogMoment]

    @property
    def verdict(self) -> str:
        loops = [m for m in self.moments if m.what == "LOOP"]
        if not loops:
            return "no loop"
        return ", ".join(f"LOOP fired at seq {m.seq}" for m in loops)

    def render(self) -> str:
        rules = self.moments[0].explanation.rules if self.moments else None
        lines = [f"sandbox {self.sandbox} episode {self.episode} (task {self.task}): "
                 f"{self.verdict}"]
        if rules is not None:
            from trajbus.bus.positions import duration

            lines.append(f"  the rule: fires at >= {rules.loop_min_repeats} repeats over >= "
                         f"{duration(rules.loop_min_span_ms)} with <= "
                         f"{rules.loop_max_distinct_results} result changes (cycles of up to "
                         f"{rules.max_cycle_length} calls){'; DRY RUN' if rules.dry_run else ''}")
        for m in self.moments:
            lines.extend(_render_moment(m))
        return "\n".join(lines)


def _render_moment(m: WatchdogMoment) -> list[str]:
    from trajbus.bus.positions import duration, iso

    head = f"  {iso(m.time_ms)} seq {m.seq:<5} "
    out: list[str] = []
    if m.alert is not None:
        a = m.alert
        if m.what in ("LOOP", "STALL"):
            calls = " -> ".join(p.split(":", 1)[0] for p in a.get("pattern") or [])
            what = (f"{m.what} fired: {calls or 'a call'} repeated {a.get('repeat_count')}x over "
                    f"{duration(a.get('span_ms') or 0)}, {a.get('distinct_results')} result "
                    "changes" if m.what == "LOOP" else f"STALL: {humanize(a.get('reason', ''))}")
            out.append(head + what + (f" -> {m.decision} requested" if m.decision else ""))
        else:
            out.append(head + f"{m.what}: {humanize(a.get('reason', ''))}")
        if m.evidence:
            out.append(f"      evidence: {len(m.evidence)} calls, seq {a.get('first_seq')}.."
                       f"{a.get('last_seq')}:")
            shown = list(m.evidence)
            if len(shown) > 5:
                shown = [*shown[:3], *shown[-2:]]
            for i, e in enumerate(shown):
                if len(m.evidence) > 5 and i == 3:
                    out.append(f"        ... {len(m.evidence) - 5} more ...")
                out.append(f"        #{e.seq:<5} {iso(e.time_ms)}  {humanize(e.summary)}")
    else:
        out.append(head + f"{m.what}: {m.explanation.verdict}")
    ex = m.explanation
    fired = m.what == "LOOP" and ex.loop_cycle_length
    for c in ex.candidates:
        if fired and c.cycle_length != ex.loop_cycle_length:
            continue  # at the moment it fired: the window that fired
        state = "MET" if not c.blockers else "; ".join(humanize(b) for b in c.blockers)
        if fired:
            state = "fired"
        pattern = ", ".join(shorten_ids(p) for p in c.pattern)
        out.append(f"      window of {c.cycle_length}-call cycles [{pattern}]: {c.repeat_count} "
                   f"repeats over {duration(c.span_ms)}, {c.result_changes} result changes, "
                   f"since seq {c.first_seq} ({c.since}) -> {state}")
    return out


async def watchdog_history(settings: Settings, sandbox: str, episode: str | None = None
                           ) -> list[StreamHistory]:
    """Re-run a fresh watchdog core over the sandbox's events (from Kafka, each episode in
    sequence order, as the watchdog reads replay) and record, per episode, the moment each
    alert fired (with the window that fired and the calls that are its evidence), the state
    just before the episode's end, and, for an episode still open at the end of the log (a
    truncated one), its last state. Sandbox-level DRAINING/RECYCLED events are left out: they
    end every stream of the sandbox, and the timeline lists them before the episodes."""
    from trajbus.consumers.watchdog.core import AlertOut, DecisionOut, WatchdogCore

    entries = await read_sandbox_log(settings, sandbox, episode=episode, must_exist=True)
    core = WatchdogCore(settings.watchdog, getattr(settings.watchdog, "per_task", None),
                        evict_idle_ms=None)
    histories: dict[str | None, StreamHistory] = {}
    by_episode: dict[str | None, list[TimelineEntry]] = defaultdict(list)
    for e in entries:
        by_episode[e.episode].append(e)

    def moment_of(e: TimelineEntry, what: str, **kw: Any) -> None:
        found = core.explain(sandbox, e.episode)
        if not found:
            return
        ex = found[0]
        h = histories.setdefault(e.episode, StreamHistory(ex.task, sandbox, e.episode, []))
        h.moments.append(WatchdogMoment(what, e.time_ms, e.seq, ex, **kw))

    for e in entries:
        if e.kind == "SandboxLifecycle" and e.record.get("state") in ("DRAINING", "RECYCLED"):
            continue
        if e.kind == "EpisodeEnd":
            moment_of(e, "episode end")
        outs = core.handle(e.kind, e.record)
        decision = next((o.decision for o in outs if isinstance(o, DecisionOut)), None)
        for o in outs:
            if not isinstance(o, AlertOut):
                continue
            alert = {"pattern": list(o.pattern), "repeat_count": o.repeat_count,
                     "span_ms": o.span_ms, "first_seq": o.first_seq, "last_seq": o.last_seq,
                     "distinct_results": o.distinct_results, "reason": o.reason}
            evidence = tuple(x for x in by_episode[o.episode]
                             if x.kind == "ToolCall" and o.first_seq <= x.seq <= o.last_seq)
            ex = core.explain(sandbox, o.episode)
            if not ex and o.episode in histories:  # the stream ended with this alert
                ex = [histories[o.episode].moments[-1].explanation]
            if not ex:
                continue
            h = histories.setdefault(o.episode, StreamHistory(ex[0].task, sandbox, o.episode,
                                                              []))
            h.moments.append(WatchdogMoment(o.alert, o.event_time_ms, o.seq, ex[0], alert,
                                            decision if o.alert == "LOOP" else None,
                                            evidence if o.alert == "LOOP" else ()))
    for ex in core.explain(sandbox, episode):  # still open at the end of the log
        last = by_episode[ex.episode][-1] if by_episode[ex.episode] else None
        h = histories.setdefault(ex.episode, StreamHistory(ex.task, sandbox, ex.episode, []))
        h.moments.append(WatchdogMoment("end of the log (episode not ended)",
                                        last.time_ms if last else ex.last_event_time_ms,
                                        ex.last_seq, ex))
    return [histories[k] for k in sorted(histories, key=lambda k: (
        min((m.time_ms for m in histories[k].moments), default=0), k or ""))]
