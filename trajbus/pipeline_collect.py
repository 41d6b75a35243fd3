"""What the demo reads once the fleet is done, for the check: the replay topics read raw
(:class:`ReplayTopics`: every event and gap marker, the confirmations the scheduler judges by,
the sandbox-level streams, partitions an open transaction holds back), the archive written by
:func:`~trajbus.archive.archiver.run_archiver` and queried back (:func:`archive_run`, with the
decision context as on its topics) and one episode's step-time waterfall.

Guarantee: a read that fails is recorded in what it returns (``error``), never raised: the
check reports it as a problem and judges the rest.
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from aiokafka import TopicPartition

from trajbus.bus.clients import new_consumer
from trajbus.bus.closing import close_client
from trajbus.bus.settings import Settings
from trajbus.bus.topics import Topics
from trajbus.pipeline_view import TASKS, View, say
from trajbus.schemas.codec import DecodeError, default_codec


@dataclass
class ReplayTopics:
    """The replay topics read raw (read_committed, no client-side dedupe)."""

    seqs: dict[tuple[str, str], Counter[tuple[int, str]]] = field(default_factory=dict)
    gaps: dict[tuple[str, str], list[tuple[int, int]]] = field(default_factory=dict)
    # (last_seq, record timestamp) of each gap-free segment: what the scheduler takes as
    # downstream's confirmation, stamped with the log time it judges by
    confirmations: dict[tuple[str, str], list[tuple[int, int]]] = field(default_factory=dict)
    # sandbox-level stream on the raw input topic: seq -> (kind, earliest record timestamp)
    sandbox_stream: dict[str, dict[int, tuple[str, int]]] = field(default_factory=dict)
    # episodes whose last segment (is_last) is on the replay topic
    closed: set[tuple[str, str]] = field(default_factory=set)
    # replay partitions whose last stable offset is behind their end (an open transaction
    # hides the records after it from every read_committed reader): tp -> (stable, end)
    unstable: dict[str, tuple[int, int]] = field(default_factory=dict)
    error: str | None = None

    def confirmed_at(self, sandbox: str, episode: str, seq: int) -> int | None:
        """The log time at which downstream first confirmed ``episode`` up to ``seq``."""
        times = [ts for last, ts in self.confirmations.get((sandbox, episode), [])
                 if last >= seq]
        return min(times) if times else None

    def drained_at(self, sandbox: str) -> int | None:
        """The log time at which the scheduler could first act on the sandbox's Drained
        report: its own stream is put back in seq order first, so the report waits for every
        earlier seq of the stream."""
        stream = self.sandbox_stream.get(sandbox, {})
        drained = [seq for seq, (kind, _ts) in stream.items() if kind == "Drained"]
        if not drained:
            return None
        return max(ts for seq, (_kind, ts) in stream.items() if seq <= min(drained))


async def replay_topics(settings: Settings) -> ReplayTopics:
    from trajbus.consumers.operator.tools import read_records

    codec = default_codec()
    out = ReplayTopics()
    topics = Topics(settings)
    try:
        parts = await read_records(settings, [topics.replay(t) for t in TASKS]
                                   + [topics.sandbox_events])
    except Exception as exc:  # reported as a problem: the check cannot pass unread
        out.error = f"{type(exc).__name__}: {exc}"
        return out
    for tp, records in parts.items():
        for rec in records:
            if tp.topic == topics.sandbox_events:
                try:
                    event = codec.decode(rec.value)
                except DecodeError:
                    continue
                head = event.record["header"]
                if head["episode"] is None:
                    stream = out.sandbox_stream.setdefault(head["sandbox"], {})
                    earlier = stream.get(head["seq"])
                    if earlier is None or rec.timestamp_ms < earlier[1]:
                        stream[head["seq"]] = (event.kind, rec.timestamp_ms)
                continue
            d = codec.decode(rec.value)
            if d.kind != "ReplaySegment":
                continue
            seg = d.record
            key = (seg["header"]["sandbox"], seg["header"]["episode"])
            if seg["is_last"]:
                out.closed.add(key)
            if seg["gap"] is None and seg["events"]:
                out.confirmations.setdefault(key, []).append((seg["last_seq"], rec.timestamp_ms))
            seen = out.seqs.setdefault(key, Counter())
            for raw in seg["events"]:
                h = codec.decode(raw).record["header"]
                seen[(h["seq"], h["event_id"])] += 1
            if seg["gap"] is not None:
                out.gaps.setdefault(key, []).append((seg["gap"]["from_seq"],
                                                     seg["gap"]["to_seq"]))
    try:
        out.unstable = await unstable_partitions(settings, [topics.replay(t) for t in TASKS])
    except Exception as exc:  # a diagnosis only: the checks above stand without it
        out.unstable = {f"(not measured: {type(exc).__name__}: {exc})": (-1, -1)}
    return out


async def unstable_partitions(settings: Settings, topics: list[str]
                               ) -> dict[str, tuple[int, int]]:
    """Partitions of ``topics`` whose last stable offset (the end for read_committed) is
    behind their high watermark (the end for read_uncommitted)."""
    from trajbus.consumers.operator.tools import topic_partitions

    parts = await topic_partitions(settings, topics)
    tps = [TopicPartition(t, p) for t in sorted(parts) for p in parts[t]]
    if not tps:
        return {}
    ends: dict[str, dict[Any, int]] = {}
    for isolation in ("read_committed", "read_uncommitted"):
        consumer = new_consumer(settings.kafka,
                                enable_auto_commit=False, isolation_level=isolation)
        await consumer.start()
        try:
            ends[isolation] = await consumer.end_offsets(tps)
        finally:
            await close_client(consumer, "demo consumer")
    stable, end = ends["read_committed"], ends["read_uncommitted"]
    return {f"{tp.topic}[{tp.partition}]": (stable[tp], end[tp])
            for tp in sorted(end) if stable.get(tp, end[tp]) < end[tp]}


async def archive_run(settings: Settings) -> dict[str, Any]:
    from trajbus.archive.archiver import run_archiver

    say("archiving the raw topics to Parquet (until caught up)...")
    t0 = time.monotonic()
    stats = await run_archiver(settings, until_idle=True)
    took = time.monotonic() - t0
    summary: dict[str, Any] = {"stats": stats, "seconds": took, "url": settings.archive.url}
    try:
        from trajbus.archive.query import ArchiveReader
        from trajbus.archive.storage import open_store

        reader = ArchiveReader(open_store(settings.archive.url,
                                          settings.archive.s3_endpoint_url))
        con = reader.connect()
        summary["query"] = ("SELECT task, kind, count(*) AS events FROM events "
                            "GROUP BY ALL ORDER BY task, events DESC LIMIT 12")
        summary["rows"] = con.execute(summary["query"]).fetchall()
        summary["events"] = con.execute(
            "SELECT sandbox, episode, seq, event_id, count(*) FROM events "
            "WHERE sandbox <> '_tick' GROUP BY ALL").fetchall()
        summary["context"] = {
            view: {r[0]: r[1] for r in con.execute(
                f"SELECT event_id, {what} FROM {view}").fetchall()}
            for view, what in (("decisions", "decided_by"), ("alerts", "alert"),
                               ("dead_letters", "stage"))}
        summary["endings"] = Counter(
            (r[0], r[1]) for r in con.execute(
                "SELECT ending, truncated_by FROM episodes").fetchall())
        summary["topics"] = await context_on_topics(settings)
    except Exception as exc:  # the summary says what failed; the check below still runs
        summary["error"] = f"{type(exc).__name__}: {exc}"
    return summary


async def context_on_topics(settings: Settings) -> dict[str, set[str]]:
    """The event ids on the decisions, alerts and dead-letter topics (ticks left out): what the
    archive's decision context must equal."""
    from trajbus.consumers.operator.tools import read_records
    from trajbus.schemas.codec import DecodeError, default_codec

    topics = Topics(settings)
    names = {topics.decisions: "decisions", topics.alerts: "alerts",
             topics.deadletter: "dead_letters"}
    codec = default_codec()
    out: dict[str, set[str]] = {v: set() for v in names.values()}
    for tp, recs in (await read_records(settings, list(names))).items():
        for rec in recs:
            try:
                d = codec.decode(rec.value or b"")
            except DecodeError:
                continue
            if d.kind != "Tick":
                out[names[tp.topic]].add(str(d.header["event_id"]))
    return out


async def waterfall_report(settings: Settings, view: View, work: Path) -> Path | None:
    """A step-time waterfall report of one finished episode (operators' tool)."""
    if view.sample is None:
        return None
    sandbox, episode = view.sample
    try:
        from trajbus.consumers.operator import tools, waterfall

        entries = await tools.read_sandbox_log(settings, sandbox, episode)
        out = work / f"waterfall-{sandbox}-{episode}.html"
        out.write_text(waterfall.render_html(entries))
        return out
    except Exception as exc:  # a report problem must not fail the pipeline check
        say(f"waterfall report skipped: {type(exc).__name__}: {exc}")
        return None
