"""Valid events near the size limit travel whole (issue 9, "near the limit" row).

A TraceChunk whose inline data fills the input topic's ``max.message.bytes`` (less a little
room for its header) is a valid event: the reorder worker wraps it into a ReplaySegment, which
is larger than the input limit, so derived topics accept the input limit + 1 MiB and the
worker's producer the same. The trainer must receive the chunk's bytes exactly, in order, once,
whether it arrived in order or before its episode's start (held in the reorder buffer).
"""

from __future__ import annotations

import hashlib
import os
import time
from pathlib import Path

import pytest
from aiokafka import AIOKafkaProducer
from faults_support import read_all, start_worker
from support import settings_for

from trajbus.bus.admin import ensure_base_topics
from trajbus.bus.topics import Topics
from trajbus.consumers.replay.client import ReplayClient
from trajbus.schemas import models as m

pytestmark = [pytest.mark.kafka, pytest.mark.timeout(180)]


def _episode(sandbox: str, episode: str, big: bytes, t0: int) -> list[bytes]:
    def h(seq: int) -> m.Envelope:
        return m.Envelope(event_id=f"{episode}-{seq}", task="task-a", sandbox=sandbox,
                          episode=episode, seq=seq, event_time_ms=t0 + seq, producer_id="t")

    small = b"tail of the trace\n"
    return [
        m.EpisodeStart(header=h(0)).encode(),
        m.TraceChunk(header=h(1), file_offset=0, length=len(big),
                     sha256=hashlib.sha256(big).hexdigest(), data=big).encode(),
        m.TraceChunk(header=h(2), file_offset=len(big), length=len(small),
                     sha256=hashlib.sha256(small).hexdigest(), data=small).encode(),
        m.EpisodeEnd(header=h(3), outcome=m.EpisodeOutcome.TERMINAL).encode(),
    ]


async def test_a_trace_chunk_filling_the_input_limit_reaches_the_trainer_whole(
        kafka_broker, unique_name, tmp_path: Path) -> None:
    settings = settings_for(kafka_broker.bootstrap, unique_name)
    await ensure_base_topics(settings, ["task-a"])
    topics = Topics(settings)
    limit = settings.topics.max_message_bytes
    big = os.urandom(limit - 16 * 1024)  # incompressible; header and framing fit in 16 KiB
    t0 = int(time.time() * 1000)
    in_order = _episode("sb-big-0", "ep-in-order", big, t0)
    early = _episode("sb-big-1", "ep-chunk-first", big[::-1], t0)
    assert len(in_order[1]) > limit - 17 * 1024
    producer = AIOKafkaProducer(bootstrap_servers=kafka_broker.bootstrap,
                                max_request_size=limit + 64 * 1024, enable_idempotence=True)
    await producer.start()
    try:
        # the in-order episode: all four on one partition in sequence order
        for ev, topic in zip(in_order, ["events", "chunks", "chunks", "events"], strict=True):
            await (await producer.send(getattr(topics, "sandbox_events" if topic == "events"
                                               else "trace_chunks"), ev, key=b"sb-big-0"))
        # the other: its big chunk arrives before its EpisodeStart
        await (await producer.send(topics.trace_chunks, early[1], key=b"sb-big-1"))
        await (await producer.send(topics.trace_chunks, early[2], key=b"sb-big-1"))
        await (await producer.send(topics.sandbox_events, early[0], key=b"sb-big-1"))
        await (await producer.send(topics.sandbox_events, early[3], key=b"sb-big-1"))
    finally:
        await producer.stop()

    worker = start_worker(settings, "reorder", "w0", tmp_path / "worker.log")
    got: dict[str, list[tuple[int, str, bytes | None]]] = {}
    finished: dict[str, int] = {}
    try:
        async with ReplayClient(["task-a"], f"{unique_name}-trainer", settings) as client:
            deadline = time.monotonic() + 90
            while len(finished) < 2 and time.monotonic() < deadline:
                assert worker.proc.poll() is None, (tmp_path / "worker.log").read_text()[-3000:]
                async for seg in client.segments(idle_timeout=1.0):
                    for ev in seg.events:
                        h = ev.record["header"]
                        got.setdefault(seg.episode, []).append(
                            (h["seq"], ev.kind, ev.record.get("data")))
                    if seg.is_last:
                        finished[seg.episode] = finished.get(seg.episode, 0) + 1
                    await client.ack(seg)
        assert worker.proc.poll() is None, (tmp_path / "worker.log").read_text()[-3000:]
    finally:
        worker.stop()

    assert finished == {"ep-in-order": 1, "ep-chunk-first": 1}, (tmp_path / "worker.log"
                                                                 ).read_text()[-3000:]
    summary = {ep: [(seq, kind) for seq, kind, _ in evs] for ep, evs in got.items()}
    for episode, chunk in (("ep-in-order", big), ("ep-chunk-first", big[::-1])):
        events = got[episode]
        assert summary[episode] == [(0, "EpisodeStart"), (1, "TraceChunk"), (2, "TraceChunk"),
                                    (3, "EpisodeEnd")], summary
        assert events[1][2] == chunk  # whole, byte for byte
    assert await read_all(settings, [topics.deadletter]) == []
