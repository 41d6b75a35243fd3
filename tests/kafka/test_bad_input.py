"""Bad input written straight into the input topics (issue 9, bad-input corpus).

Every bad record lands in the dead-letter topic with its stage, a stable reason code and the
original bytes; the worker keeps running; the valid events interleaved with the garbage reach
the trainer exactly (none missing, none twice, in order); the metrics count the dead letters.
"""

from __future__ import annotations

import os
import random
from collections import defaultdict
from pathlib import Path

import pytest
from aiokafka import AIOKafkaProducer
from aiokafka.errors import KafkaError, MessageSizeTooLargeError
from faults_support import (
    diff_views,
    read_all,
    scrape,
    start_worker,
    trainer_view,
    wait_caught_up,
)
from support import consume_until, make_episodes, produce, settings_for

from trajbus.bus.admin import ensure_base_topics
from trajbus.bus.settings import ReplaySettings
from trajbus.bus.topics import Topics
from trajbus.consumers.engine.processors import ReorderProcessor
from trajbus.consumers.engine.runner import InRecord
from trajbus.infra.broker import free_port
from trajbus.schemas import models as m
from trajbus.schemas.codec import default_codec

pytestmark = [pytest.mark.kafka, pytest.mark.timeout(240)]
codec = default_codec()


def _h(sandbox: str = "sb-bad", episode: str | None = "ep-bad", seq: int = 1,
       event_id: str | None = None) -> m.Envelope:
    return m.Envelope(event_id=event_id or f"{sandbox}-{episode}-{seq}", task="task-a",
                      sandbox=sandbox, episode=episode, seq=seq, event_time_ms=1_000,
                      producer_id="fuzz")


def _call(**h: object) -> m.ToolCall:
    return m.ToolCall(header=_h(**h), call_id="c", tool="bash", args_hash="a" * 64)  # type: ignore[arg-type]


def _with_header(event: m.Event, **fields: object) -> bytes:
    """Valid Avro whose header the pydantic model would refuse: encode with the codec."""
    d = codec.decode(event.encode())
    d.record["header"].update(fields)
    return codec.encode(d.kind, d.record)


def corpus(valid_first: bytes) -> list[tuple[str, str, bytes, str]]:
    """(topic kind, key, bytes, expected reason_code) for each bad record."""
    valid = _call(seq=1).encode()
    chunk = m.TraceChunk(header=_h(seq=1), file_offset=0, length=3, sha256="0" * 64,
                         data=b"abc").encode()
    rnd = random.Random(99)
    d = codec.decode(valid_first)
    d.record["header"]["producer_id"] = "impostor"  # same (sandbox, episode, seq), new bytes
    conflicting = codec.encode(d.kind, d.record)
    key = d.record["header"]["sandbox"]
    return [
        ("events", "k-rand", bytes([0x00]) + rnd.randbytes(300), "bad_magic"),
        ("chunks", "k-rand2", b"\xc3" + rnd.randbytes(64), "bad_magic"),
        ("events", "k-empty", b"", "bad_magic"),
        ("events", "k-trunc", valid[: len(valid) // 2], "corrupt_body"),
        ("chunks", "k-trunc2", chunk[:-2], "corrupt_body"),
        ("events", "k-fp", b"\xc3\x01" + rnd.randbytes(8) + valid[10:], "unknown_schema"),
        ("events", "k-neg", _with_header(_call(seq=1), seq=-5), "invalid_seq"),
        ("events", key, conflicting, "conflicting_duplicate"),
        ("events", "k-nosb", _with_header(_call(seq=1), sandbox=""), "missing_sandbox"),
        ("events", "k-noep", _with_header(_call(seq=1), episode=None), "missing_episode"),
        ("events", "k-emptyep", _with_header(_call(seq=1), episode=""), "missing_episode"),
        ("events", "k-noid", _with_header(_call(episode="ep-noid", seq=0), event_id=""),
         "invalid_id"),
        ("events", "k-notask", _with_header(_call(episode="ep-nt", seq=0), task=""),
         "invalid_id"),
        ("events", "k-dotdot", _with_header(m.EpisodeStart(header=_h(episode="ep-dd", seq=0)),
                                            task="../x"), "invalid_id"),
        ("events", "k-slash", m.EpisodeStart(header=_h(sandbox="a/b", episode="ep-sl", seq=0)
                                             ).encode(), "invalid_id"),
        ("events", "k-start3", m.EpisodeStart(header=_h(episode="ep-s3", seq=3)).encode(),
         "bad_start_seq"),
    ]


async def test_bad_input_corpus_is_dead_lettered_and_valid_events_still_delivered(
        kafka_broker, unique_name, tmp_path: Path) -> None:
    settings = settings_for(kafka_broker.bootstrap, unique_name)
    await ensure_base_topics(settings, ["task-a"])
    topics = Topics(settings)
    eps = make_episodes(20, seed=5)
    bad = corpus(eps[0].events[1])
    topic_of = {"events": topics.sandbox_events, "chunks": topics.trace_chunks}
    # interleave: the garbage sits between valid events; the conflicting copy comes last
    valid = [(e.sandbox, v) for e in eps for v in e.events]
    stream: list[tuple[str, str, bytes]] = [(topics.sandbox_events, k, v) for k, v in valid]
    rnd = random.Random(5)
    for kind, key, value, reason in bad:
        if reason == "conflicting_duplicate":
            continue
        stream.insert(rnd.randrange(len(stream) + 1), (topic_of[kind], key, value))
    stream += [(topic_of[k], key, v) for k, key, v, r in bad if r == "conflicting_duplicate"]
    port = free_port()
    worker = start_worker(settings, "reorder", "w0", tmp_path / "worker.log", metrics_port=port)
    try:
        for topic, key, value in stream:  # in order, through one idempotent producer
            await produce(settings, topic, [(key, value)])
        expected = {(e.sandbox, e.episode): [(i, f"{e.episode}-{i}") for i in range(e.n)]
                    for e in eps}
        view = await trainer_view(settings, ["task-a"], f"{unique_name}-trainer",
                                  lambda v: v.complete(expected), timeout=90)
        await wait_caught_up(settings, f"{unique_name}.reorder", topics.input_topics)
        metrics = scrape(port, "trajbus_dead_letters_total")
        assert worker.proc.poll() is None, "the worker died on bad input"
    finally:
        worker.stop()
    assert diff_views(expected, view) == []

    letters: dict[bytes, list[tuple[str, str, str]]] = defaultdict(list)
    for r in await read_all(settings, [topics.deadletter]):
        dl = codec.decode(r.value).record
        letters[dl["original_value"]].append((dl["stage"], dl["reason_code"], dl["source_topic"]))
    for kind, _key, value, reason in bad:
        assert letters.get(value) == [("reorder", reason, topic_of[kind])], (reason, letters.get(
            value))
    assert sum(len(v) for v in letters.values()) == len(bad)
    by_reason: dict[str, float] = defaultdict(float)
    for labels, value in metrics.items():
        if 'stage="reorder"' in labels:
            by_reason[labels.split('reason="')[1].split('"')[0]] += value
    for reason in {r for *_, r in bad}:
        assert by_reason[reason] == sum(1 for *_, r in bad if r == reason), (reason, metrics)


async def test_recycled_sandbox_and_episode_flood_do_not_reach_the_trainer_as_valid(
        kafka_broker, unique_name, tmp_path: Path) -> None:
    """Events of a sandbox first seen after its RECYCLED grace go to the late topic (not to
    the trainer); one sandbox opening thousands of episodes neither crashes the worker nor
    delays the other sandboxes' episodes: the first ``max_open_episodes_per_sandbox`` (64)
    are passed on, every further one is a dead letter with its bytes."""
    settings = settings_for(kafka_broker.bootstrap, unique_name,
                            replay=ReplaySettings(gap_timeout_ms=1500))
    await ensure_base_topics(settings, ["task-a"])
    topics = Topics(settings)
    replay = topics.replay("task-a")
    worker = start_worker(settings, "reorder", "w0", tmp_path / "worker.log")
    sb = "sb-recycled"
    try:
        life = [m.SandboxLifecycle(header=m.Envelope(event_id=f"{sb}-l{i}", task="task-a",
                                                     sandbox=sb, seq=i, producer_id="t"),
                                   state=s).encode()
                for i, s in enumerate(["ACTIVE", "DRAINING", "RECYCLED"])]
        opened = m.EpisodeStart(header=_h(sandbox=sb, episode="ep-open", seq=0)).encode()
        await produce(settings, topics.sandbox_events, [(sb, opened), *[(sb, v) for v in life]])
        # the open episode is closed truncated once the grace has passed
        await consume_until(settings, replay, lambda vs: any(
            codec.decode(v).record["is_last"] and codec.decode(v).record["header"]["episode"]
            == "ep-open" for v in vs), timeout=60)
        ghost = [m.EpisodeStart(header=_h(sandbox=sb, episode="ep-ghost", seq=0)).encode(),
                 _call(sandbox=sb, episode="ep-ghost", seq=1).encode()]
        flood = [("sb-flood", m.EpisodeStart(header=_h(sandbox="sb-flood", episode=f"f-{i}",
                                                          seq=0)).encode()) for i in range(3000)]
        eps = make_episodes(10, seed=6)
        await produce(settings, topics.sandbox_events, [(sb, v) for v in ghost] + flood +
                      [(e.sandbox, v) for e in eps for v in e.events])
        expected = {(e.sandbox, e.episode): [(i, f"{e.episode}-{i}") for i in range(e.n)]
                    for e in eps}
        view = await trainer_view(settings, ["task-a"], f"{unique_name}-trainer",
                                  lambda v: v.complete(expected), timeout=90)
        await wait_caught_up(settings, f"{unique_name}.reorder", topics.input_topics)
        assert worker.proc.poll() is None
    finally:
        worker.stop()
    flood_keys = {k for k in view.events if k[0] == "sb-flood"}
    assert [p for p in diff_views(expected, view) if not p.startswith(
        ("('sb-flood'", "('sb-recycled', 'ep-open')"))] == []
    assert view.finished[(sb, "ep-open")] == 1 and view.terminal[(sb, "ep-open")] is False
    assert ("sb-recycled", "ep-ghost") not in view.events
    late = [r.value for r in await read_all(settings, [topics.late])]
    assert sorted(late) == sorted(ghost)
    # the flood: 64 episodes admitted (first segments), the rest dead-lettered, none silent
    limit = settings.replay.max_open_episodes_per_sandbox
    assert limit == 64
    assert flood_keys == {("sb-flood", f"f-{i}") for i in range(limit)}
    letters = [codec.decode(r.value).record for r in await read_all(settings,
                                                                     [topics.deadletter])]
    assert [(d["reason_code"], d["original_value"]) for d in letters] == [
        ("too_many_open_episodes", v) for _, v in flood[limit:]]


@pytest.mark.parametrize("margin", [
    4096,
    200,  # the largest record the topic accepts still fits, whole, in its dead letter
])
async def test_oversize_records_are_refused_at_the_edge_or_dead_lettered(
        kafka_broker, unique_name, tmp_path: Path, margin: int) -> None:
    settings = settings_for(kafka_broker.bootstrap, unique_name)
    await ensure_base_topics(settings, ["task-a"])
    topics = Topics(settings)
    limit = settings.topics.max_message_bytes  # trace_chunks' max.message.bytes
    # 1) the producer refuses a record above its max_request_size before sending
    from trajbus.bus.producer import close_producer, get_producer

    p = await get_producer(settings.kafka)
    with pytest.raises(MessageSizeTooLargeError):
        await p.send(topics.trace_chunks, os.urandom(settings.kafka.max_request_size + 1))
    await close_producer()
    # 2) the broker refuses a record above the topic's max.message.bytes
    big = AIOKafkaProducer(bootstrap_servers=kafka_broker.bootstrap,
                           max_request_size=2 * limit, request_timeout_ms=20_000)
    await big.start()
    try:
        with pytest.raises(KafkaError):
            await (await big.send(topics.trace_chunks, b"\x00" * (limit + 1024), key=b"k"))
        # 3) the largest garbage the topic accepts: dead-lettered with its bytes
        near = bytes([0]) + os.urandom(limit - margin)
        await (await big.send(topics.trace_chunks, near, key=b"k-near"))
    finally:
        await big.stop()
    eps = make_episodes(5, seed=7)
    await produce(settings, topics.sandbox_events, [(e.sandbox, v) for e in eps for v in e.events])
    worker = start_worker(settings, "reorder", "w0", tmp_path / "worker.log")
    try:
        expected = {(e.sandbox, e.episode): [(i, f"{e.episode}-{i}") for i in range(e.n)]
                    for e in eps}
        view = await trainer_view(settings, ["task-a"], f"{unique_name}-trainer",
                                  lambda v: v.complete(expected) or worker.proc.poll()
                                  is not None, timeout=60)
        assert worker.proc.poll() is None, (tmp_path / "worker.log").read_text()[-2000:]
    finally:
        worker.stop()
    assert diff_views(expected, view) == []
    letters = [codec.decode(r.value).record for r in await read_all(settings,
                                                                     [topics.deadletter])]
    assert [(d["reason_code"], d["original_value"] == near) for d in letters] == [
        ("bad_magic", True)]


def test_episode_ending_before_it_starts_is_dead_lettered() -> None:
    from trajbus.bus.settings import Settings

    p = ReorderProcessor(Settings())
    raw = m.EpisodeEnd(header=_h(episode="ep-end0", seq=0),
                       outcome=m.EpisodeOutcome.TERMINAL).encode()
    outs = p.handle(InRecord("x.sandbox.events", 0, 0, b"k", raw, 1_000))
    kinds = [(codec.decode(o.value).kind, codec.decode(o.value).record.get("reason_code"))
             for o in outs]
    assert kinds == [("DeadLetter", "bad_start_seq")]
