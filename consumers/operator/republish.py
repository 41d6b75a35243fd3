"""``replay republish``: re-emit one episode as ``ReplaySegment`` records to a debug replay
topic a trainer's ``ReplayClient`` can read (the only operator tool that writes)."""

from __future__ import annotations

import asyncio
import uuid
from dataclasses import dataclass

from trajbus.bus.clients import new_producer
from trajbus.bus.closing import close_client
from trajbus.bus.errors import UserError
from trajbus.bus.settings import Settings
from trajbus.bus.topics import Topics, episode_record_key
from trajbus.consumers.operator.reads import Source, read_sandbox_log
from trajbus.consumers.operator.timeline import TimelineEntry
from trajbus.schemas.codec import Codec, default_codec

_REPUBLISH_NS = uuid.uuid5(uuid.NAMESPACE_URL, "https://trajbus/operator/republish")
REPUBLISH_PRODUCER = "trajbus.operator.republish"

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
    producer = new_producer(
        settings.kafka, client_id=f"{settings.kafka.client_id}-republish")
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
