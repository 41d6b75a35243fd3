"""Bounded reads of the live topics for the operators' tools: records of topics, a sandbox's
log (from Kafka or the archive), consumer groups' offsets and lag.

Bounded reads
-------------
Every read assigns all partitions of its topics (no consumer group, nothing committed), takes
the end offsets when it starts and stops there: a read sees a consistent prefix of the log and
always terminates, even while producers keep writing. Reads are ``read_committed``, so aborted
transactional outputs of the processors are never shown.
"""

from __future__ import annotations

import asyncio
import heapq
import importlib
import time
from collections.abc import Callable, Iterable, Sequence
from datetime import UTC, datetime
from typing import Any, Literal

from aiokafka import TopicPartition

from trajbus.bus.clients import new_admin, new_consumer
from trajbus.bus.closing import close_client
from trajbus.bus.errors import NotFoundError, existing
from trajbus.bus.kafka import check_broker
from trajbus.bus.settings import Settings
from trajbus.bus.topics import Topics
from trajbus.consumers.engine.runner import InRecord
from trajbus.consumers.operator.timeline import (
    TimelineEntry,
    entry_from_decoded,
    order_timeline,
    summarize,
)
from trajbus.schemas.codec import Codec, Decoded, DecodeError, default_codec

Source = Literal["kafka", "archive"]

async def _retrying(call: Callable[[], Any], what: str, timeout_s: float = 120.0) -> Any:
    """Admin calls answer "coordinator not available" for a while on a fresh cluster, and
    "loading" while a restarted coordinator loads the group's offsets: retried to a
    deadline."""
    from aiokafka.errors import KafkaError

    deadline = asyncio.get_running_loop().time() + timeout_s
    while True:
        try:
            return await call()
        except KafkaError as exc:
            if (not getattr(exc, "retriable", False)
                    or asyncio.get_running_loop().time() >= deadline):
                raise
            await asyncio.sleep(0.5)


async def topic_partitions(settings: Settings, topics: Sequence[str] | None = None,
                           pattern: str | None = None) -> dict[str, list[int]]:
    """Partitions of the existing topics among ``topics`` (all topics when None) plus those
    whose name fully matches ``pattern``. Uses the admin client: a bare consumer has no
    metadata for topics it is not subscribed to."""
    from trajbus.bus.inventory import partitions_of

    return await partitions_of(settings, topics, pattern)


async def group_offsets(settings: Settings, group: str) -> dict[TopicPartition, int]:
    """The committed offsets of a consumer group ({} when it has none)."""

    admin = new_admin(settings.kafka, "admin")
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
    consumer = new_consumer(settings.kafka, enable_auto_commit=False,
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
    consumer = new_consumer(
        k, enable_auto_commit=False, isolation_level="read_committed",
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
