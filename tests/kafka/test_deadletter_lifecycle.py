"""Dead letters complete (issue 37 item 2), against a real broker, as an operator runs the
commands (subprocesses configured by ``TRAJBUS_`` variables):

- ``redrive`` sends each source record once, however many stages dead-lettered it, refuses
  permanent failures saying why, and is idempotent (a second redrive sends nothing);
- ``resolve`` marks dead letters resolved with a note (durably, on the status topic);
  ``list --status`` and the counts show each status;
- the same dead letter written twice (a restarted stage) is read once;
- ``show`` shows both versions of a conflict with an event emitted long ago (found behind the
  reorder's dedupe window, its kept version looked up in the replay segments);
- a second archive destination does not dead-letter again what the first did."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from typing import Any

import pytest
from support import Worker, consume_until, env_for, produce, settings_for

from trajbus.bus.admin import ensure_base_topics
from trajbus.bus.deadletter import dead_letter_event
from trajbus.bus.settings import ArchiveSettings, Settings
from trajbus.bus.topics import Topics
from trajbus.consumers.operator.deadletters import REDRIVE_HEADER
from trajbus.consumers.operator.tools import read_records
from trajbus.schemas import models as m
from trajbus.schemas.codec import default_codec

pytestmark = [pytest.mark.kafka, pytest.mark.timeout(240)]
codec = default_codec()
NOISE = ("Traceback", "Unclosed AIOKafka", "Exception ignored")


def _cli(settings: Settings, *argv: str) -> Any:
    import subprocess
    import sys

    from support import REPO

    proc = subprocess.run([sys.executable, "-m", "trajbus", *argv], env=env_for(settings),
                          cwd=REPO, capture_output=True, text=True, timeout=120, check=False)
    assert not any(n in proc.stdout + proc.stderr for n in NOISE), proc.stderr
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc


def _lines(text: str) -> list[dict[str, Any]]:
    return [json.loads(x) for x in text.splitlines() if x.strip()]


def _call(sb: str, ep: str, seq: int, t: int, args: str = "a", event_id: str | None = None
          ) -> m.Event:
    h = m.Envelope(event_id=event_id or f"{sb}-{ep}-{seq}", task="web-shop", sandbox=sb,
                   episode=ep, seq=seq, event_time_ms=t + seq, producer_id="test")
    if seq == 0:
        return m.EpisodeStart(header=h)
    return m.ToolCall(header=h, call_id=f"c{seq}", tool="exec", args_hash=args * 64)


async def _redriven_records(settings: Settings) -> list[tuple[int, int]]:
    topic = Topics(settings).sandbox_events
    consumer_parts = await read_records(settings, [topic])
    # read_records drops headers: the redriven ones are those after the planted offsets
    return sorted((r.partition, r.offset) for recs in consumer_parts.values() for r in recs)


def _records_once_stable(settings: Settings, at_least: int) -> list[tuple[int, int]]:
    """The input's records once ``at_least`` are readable: a transactional write's records
    become readable (read_committed) only when its commit markers land, a moment after the
    writer's commit returned."""
    deadline = time.monotonic() + 15
    while True:
        got = asyncio.run(_redriven_records(settings))
        if len(got) >= at_least or time.monotonic() > deadline:
            return got
        time.sleep(0.2)


def test_redrive_once_per_source_refuses_permanent_is_idempotent_and_resolve_lists(
        kafka_broker: Any, unique_name: str) -> None:
    settings = settings_for(kafka_broker.bootstrap, unique_name)
    topics = Topics(settings)
    t = int(time.time() * 1000)
    good = _call("sb-a", "ep-1", 1, t)
    other = _call("sb-b", "ep-1", 1, t)

    async def setup() -> dict[str, tuple[int, int]]:
        from aiokafka import AIOKafkaProducer

        await ensure_base_topics(settings, ["web-shop"])
        producer = AIOKafkaProducer(bootstrap_servers=settings.kafka.bootstrap_servers)
        await producer.start()
        pos: dict[str, tuple[int, int]] = {}
        try:
            for name, key, value in (("good", b"sb-a", good.encode()),
                                     ("other", b"sb-b", other.encode()),
                                     ("junk", b"sb-j", b"this is not avro at all")):
                md = await producer.send_and_wait(topics.sandbox_events, value, key=key)
                pos[name] = (md.partition, md.offset)
            # the dead letters the stages wrote: one source record refused by three stages
            # (a transient reason), another by one, the junk (permanent) by one; the reorder
            # wrote its dead letter for "other" twice (a restart before its commit)
            letters = [("reorder", "internal_error", "good", good.encode(), b"sb-a"),
                       ("scheduler", "internal_error", "good", good.encode(), b"sb-a"),
                       ("archiver", "internal_error", "good", good.encode(), b"sb-a"),
                       ("reorder", "too_many_open_episodes", "other", other.encode(), b"sb-b"),
                       ("reorder", "too_many_open_episodes", "other", other.encode(), b"sb-b"),
                       ("reorder", "bad_magic", "junk", b"this is not avro at all", b"sb-j")]
            for stage, code, name, value, key in letters:
                p, o = pos[name]
                dl = dead_letter_event(stage=stage, reason_code=code, reason=f"test {code}",
                                       source_topic=topics.sandbox_events, source_partition=p,
                                       source_offset=o, key=key, value=value,
                                       producer_id="test", sandbox=key.decode(),
                                       task="web-shop", event_time_ms=t)
                await producer.send_and_wait(topics.deadletter, dl.encode(), key=key)
        finally:
            await producer.stop()
        return pos

    asyncio.run(setup())
    before = asyncio.run(_redriven_records(settings))

    counts = json.loads(_cli(settings, "deadletters", "--json").stdout)
    assert counts["total"] == 5  # the reorder's copy of the same dead letter is read once
    assert counts["by_status"] == {"open": 5, "redriven": 0, "resolved": 0}

    dry = _cli(settings, "deadletters", "redrive", "--all", "--dry-run").stdout
    assert dry.count("would re-drive") == 2 and dry.count("the same source record") == 2

    first = _cli(settings, "deadletters", "redrive", "--all")
    assert first.stdout.count("re-drove") == 2, first.stdout  # good once, other once
    assert first.stdout.count("the same source record") == 2
    refused = [x for x in first.stdout.splitlines() if x.startswith("refused")]
    assert len(refused) == 1 and "reorder/bad_magic" in refused[0]
    assert "permanent failure" in refused[0]
    assert "2 source record(s) re-driven for 4 dead letter(s); 1 refused" in first.stderr

    after = _records_once_stable(settings, len(before) + 2)
    assert len(after) == len(before) + 2

    async def headers() -> list[bytes]:
        from aiokafka import AIOKafkaConsumer

        c = AIOKafkaConsumer(topics.sandbox_events, auto_offset_reset="earliest",
                             bootstrap_servers=settings.kafka.bootstrap_servers,
                             isolation_level="read_committed", enable_auto_commit=False)
        await c.start()
        try:
            out: list[bytes] = []
            deadline = time.monotonic() + 30
            seen = 0
            while seen < len(after) and time.monotonic() < deadline:
                for recs in (await c.getmany(timeout_ms=500)).values():
                    for r in recs:
                        seen += 1
                        out += [v for k, v in r.headers if k == REDRIVE_HEADER]
            return out
        finally:
            await c.stop()

    assert len(asyncio.run(headers())) == 2

    again = _cli(settings, "deadletters", "redrive", "--all")
    assert "re-drove" not in again.stdout, again.stdout
    assert again.stdout.count("skipped") == 4 and again.stdout.count("refused") == 1
    assert asyncio.run(_redriven_records(settings)) == after  # nothing sent twice

    redriven = _lines(_cli(settings, "deadletters", "list", "--status", "redriven",
                           "--json").stdout)
    assert len(redriven) == 4 and {d["status"] for d in redriven} == {"redriven"}
    (junk,) = _lines(_cli(settings, "deadletters", "list", "--status", "open", "--json").stdout)
    assert junk["reason_code"] == "bad_magic" and junk["permanence"] == "permanent"

    resolved = _cli(settings, "deadletters", "resolve", str(junk["id"])[:8], "--note",
                    "junk from a test, nothing to recover")
    assert "resolved " + str(junk["id"])[:12] in resolved.stdout
    assert _cli(settings, "deadletters", "list", "--status", "open", "--json").stdout == ""
    (res,) = _lines(_cli(settings, "deadletters", "list", "--status", "resolved",
                         "--json").stdout)
    assert res["id"] == junk["id"]
    assert res["status_detail"]["note"] == "junk from a test, nothing to recover"
    shown = _cli(settings, "deadletters", "show", str(junk["id"])).stdout
    assert "resolved" in shown and "nothing to recover" in shown and "permanent" in shown
    counts = json.loads(_cli(settings, "deadletters", "--json").stdout)
    assert counts["by_status"] == {"open": 0, "redriven": 4, "resolved": 1}
    last = _cli(settings, "deadletters", "redrive", "--all")
    assert last.stdout.count("skipped") == 5 and "re-drove" not in last.stdout


def test_show_gives_both_versions_of_a_conflict_far_behind_the_reorder_window(
        kafka_broker: Any, unique_name: str) -> None:
    settings = settings_for(kafka_broker.bootstrap, unique_name)
    topics = Topics(settings)
    t = int(time.time() * 1000)
    sb = "sb-far"
    events = [_call(sb, "ep-1", s, t) for s in range(100)]
    conflict = _call(sb, "ep-1", 1, t, args="f", event_id=events[1].header.event_id)
    recent = _call(sb, "ep-1", 95, t, args="e", event_id=events[95].header.event_id)

    async def setup() -> None:
        await ensure_base_topics(settings, ["web-shop"])
        await produce(settings, topics.sandbox_events, [(sb, e.encode()) for e in events])

    asyncio.run(setup())
    worker = Worker(settings, "reorder").start()
    try:
        def seqs(values: list[bytes]) -> int:
            return sum(len(codec.decode(v).record["events"]) for v in values)

        asyncio.run(consume_until(settings, topics.replay("web-shop"),
                                  lambda vs: seqs(vs) >= 100))
        asyncio.run(produce(settings, topics.sandbox_events, [(sb, recent.encode()),
                                                              (sb, conflict.encode())]))
        asyncio.run(consume_until(settings, topics.deadletter, lambda vs: len(vs) >= 2))
    finally:
        worker.stop()
    dls = _lines(_cli(settings, "deadletters", "list", "--json").stdout)
    assert {d["reason_code"] for d in dls} == {"conflicting_duplicate"}
    far = [d for d in dls if "99 seqs back" in str(d["reason"])]
    assert len(dls) == 2 and len(far) == 1  # 99 back: beyond the dedupe window of 64
    for d, mine in ((far[0], "f"), (next(d for d in dls if d not in far), "e")):
        shown = _cli(settings, "deadletters", "show", str(d["id"])[:8]).stdout
        assert "original: " in shown and "kept version (conflicting duplicate): " in shown
        whole = json.loads(_cli(settings, "deadletters", "show", str(d["id"]), "--json").stdout)
        assert whole["original"]["record"]["args_hash"] == mine * 64
        assert whole["conflicting"]["record"]["args_hash"] == "a" * 64


async def test_a_second_archive_destination_does_not_dead_letter_again(
        kafka_broker: Any, unique_name: str, tmp_path: Path) -> None:
    from trajbus.archive.archiver import run_archiver
    from trajbus.archive.storage import LocalStore
    from trajbus.bus.producer import close_producer

    settings = settings_for(kafka_broker.bootstrap, unique_name)
    settings.archive = ArchiveSettings(url=str(tmp_path / "a"), spool_dir=str(tmp_path / "sp"))
    topics = Topics(settings)
    await ensure_base_topics(settings, ["web-shop"])
    t = int(time.time() * 1000)
    await produce(settings, topics.sandbox_events,
                  [("sb-1", _call("sb-1", "ep-1", 0, t).encode()),
                   ("sb-j", b"this is not avro at all")])
    try:
        first = await run_archiver(settings, store=LocalStore(tmp_path / "a"), until_idle=True,
                                   topics=[topics.sandbox_events])
        second = await run_archiver(settings, store=LocalStore(tmp_path / "b"),
                                    until_idle=True, topics=[topics.sandbox_events])
    finally:
        await close_producer()
    parts = await read_records(settings, [topics.deadletter])
    assert sum(len(v) for v in parts.values()) == 1  # the junk, dead-lettered once
    assert (first.dead_letters, first.dead_letters_known) == (1, 0)
    assert (second.dead_letters, second.dead_letters_known) == (0, 1)


def test_a_record_one_stage_refused_for_good_is_not_redriven_for_another(
        kafka_broker: Any, unique_name: str) -> None:
    """The operators' drill (2026-12-05): a heartbeat with a path in its sandbox id was
    dead-lettered by the reorder as ``invalid_id`` (permanent) and by the scheduler as
    ``unknown_sandbox`` (transient); redrive sent it back, where the reorder refused it again.
    A record whose dead letter of any stage is permanent is not re-driven, even when only the
    other stage's dead letter is selected."""
    settings = settings_for(kafka_broker.bootstrap, unique_name)
    topics = Topics(settings)
    t = int(time.time() * 1000)
    hb = m.Heartbeat(header=m.Envelope(event_id="hb-bad-id", task="web-shop",
                                       sandbox="sb/../../etc", seq=0, event_time_ms=t,
                                       producer_id="test"))

    async def setup() -> None:
        from aiokafka import AIOKafkaProducer

        await ensure_base_topics(settings, ["web-shop"])
        producer = AIOKafkaProducer(bootstrap_servers=settings.kafka.bootstrap_servers)
        await producer.start()
        try:
            md = await producer.send_and_wait(topics.sandbox_events, hb.encode(), key=b"sb-x")
            for stage, code in (("reorder", "invalid_id"), ("scheduler", "unknown_sandbox")):
                dl = dead_letter_event(stage=stage, reason_code=code, reason=f"test {code}",
                                       source_topic=topics.sandbox_events,
                                       source_partition=md.partition, source_offset=md.offset,
                                       key=b"sb-x", value=hb.encode(), producer_id="test",
                                       sandbox="sb-x", task="web-shop", event_time_ms=t)
                await producer.send_and_wait(topics.deadletter, dl.encode(), key=b"sb-x")
        finally:
            await producer.stop()

    asyncio.run(setup())
    before = asyncio.run(_redriven_records(settings))
    only_scheduler = _cli(settings, "deadletters", "redrive", "--stage", "scheduler")
    assert "re-drove" not in only_scheduler.stdout, only_scheduler.stdout
    assert "reorder stage's dead letter of the same record" in only_scheduler.stdout
    every = _cli(settings, "deadletters", "redrive", "--all")
    assert "re-drove" not in every.stdout, every.stdout
    assert sum(x.startswith("refused") for x in every.stdout.splitlines()) == 2, every.stdout
    assert asyncio.run(_redriven_records(settings)) == before  # nothing sent
