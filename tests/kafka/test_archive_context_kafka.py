"""End to end through a real broker and a real worker process: a simulated fleet in which
agents loop (the watchdog terminates their episodes) and crash (episodes truncated by the
runtime, or never ended before the sandbox was recycled), plus a record nobody can read (dead
letters). After `archive run`, the archive alone answers how every episode ended, with the
decision that terminated it, and its decisions (with who decided), alerts and dead letters
are exactly those on the Kafka topics."""

from __future__ import annotations

import asyncio
import json
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import pytest
from aiokafka import AIOKafkaProducer
from faults_support import read_all
from support import Worker, settings_for

from trajbus.archive.archiver import run_archiver
from trajbus.archive.query import ArchiveReader
from trajbus.archive.storage import LocalStore
from trajbus.bus import producer as producer_mod
from trajbus.bus.admin import ensure_base_topics, register_schemas
from trajbus.bus.producer import close_producer
from trajbus.bus.settings import ArchiveSettings, Settings
from trajbus.bus.topics import Topics
from trajbus.producers.simulator import simulate
from trajbus.schemas.codec import default_codec

pytestmark = [pytest.mark.kafka, pytest.mark.timeout(420)]

TASKS = ["web-shop"]
SEED = 7
# every sandbox crashes in one of its episodes (half of them with a TRUNCATED EpisodeEnd,
# half without one: the sandbox is drained and recycled with the episode open); about half
# of the other episodes loop
FLEET: dict[str, Any] = dict(loop=0.5, cycle=0, nonloop=0, crash=1.0, migrate=0,
                             duplicate=0, blob=0, steps_min=3, steps_max=6)
codec = default_codec()


@pytest.fixture(autouse=True)
async def _close_shared_producer():
    yield
    if producer_mod._loop is asyncio.get_running_loop():
        await close_producer()


async def topic_records(settings: Settings) -> dict[str, dict[str, dict[str, Any]]]:
    """The decisions, alerts and dead letters on Kafka by event id (ticks left out)."""
    topics = Topics(settings)
    names = {topics.decisions: "decisions", topics.alerts: "alerts",
             topics.deadletter: "dead_letters"}
    out: dict[str, dict[str, dict[str, Any]]] = {v: {} for v in names.values()}
    for r in await read_all(settings, list(names)):
        d = codec.decode(r.value or b"")
        if d.kind != "Tick":
            out[names[r.topic]][d.header["event_id"]] = d.record
    return out


async def test_the_archive_alone_answers_outcomes_decisions_alerts_and_dead_letters(
        kafka_broker: Any, unique_name: str, tmp_path: Path) -> None:
    settings = settings_for(kafka_broker.bootstrap, unique_name,
                            archive=ArchiveSettings(url=str(tmp_path / "archive"),
                                                    spool_dir=str(tmp_path / "spool")))
    topics = Topics(settings)
    await ensure_base_topics(settings, TASKS)
    await register_schemas(settings)
    p = AIOKafkaProducer(bootstrap_servers=kafka_broker.bootstrap, enable_idempotence=True)
    await p.start()
    try:  # a record no stage can read: every stage dead-letters it
        await p.send_and_wait(topics.sandbox_events, b"\x00not avro", key=b"junk")
    finally:
        await p.stop()
    worker = Worker(settings, "reorder,watchdog,scheduler", "w0",
                    log_path=tmp_path / "worker.log").start()
    try:
        manifest = await simulate(settings, sandboxes=6, episodes=3, seed=SEED,
                                  state_root=tmp_path / "sim", tasks=TASKS,
                                  start_ms=int(time.time() * 1000),
                                  first_decision_timeout_s=90, placement_timeout_s=120,
                                  terminate_wait_s=30, **FLEET)
        await close_producer()
        sandboxes = {e.sandbox for e in manifest.episodes}
        loops = {(e.sandbox, e.episode) for e in manifest.loops}
        deadline = time.monotonic() + 150
        while True:  # settled: every sandbox recycled, every loop's TERMINATE decided
            kafka = await topic_records(settings)
            recycled = {d["header"]["sandbox"] for d in kafka["decisions"].values()
                        if d["decision"] in ("RECYCLE", "RECYCLE_WITH_LOSS")}
            terminated = {(d["header"]["sandbox"], d["header"]["episode"])
                          for d in kafka["decisions"].values() if d["decision"] == "TERMINATE"}
            if sandboxes <= recycled and loops <= terminated:
                break
            assert worker.proc is not None and worker.proc.poll() is None, \
                (tmp_path / "worker.log").read_text()[-3000:]
            assert time.monotonic() < deadline, (sorted(sandboxes - recycled),
                                                 sorted(loops - terminated))
            await asyncio.sleep(1)
    finally:
        await asyncio.to_thread(worker.stop)

    # the run holds what this test is about
    crashed = [e for e in manifest.episodes if e.behaviour == "crash"]
    assert loops, "the seed plants loops"
    assert any(e.outcome is None for e in crashed), "a crash without an EpisodeEnd"
    assert any(e.outcome == "TRUNCATED" for e in crashed), "a crash the runtime reported"

    # archive: the archiver refuses the junk too (one more dead letter); a second run
    # archives that one, as the next scheduled run would
    store = LocalStore(tmp_path / "archive")
    first = await run_archiver(settings, store=store, until_idle=True)
    assert first.dead_letters == 1
    second = await run_archiver(settings, store=store, until_idle=True)
    assert second.dead_letters == 0
    kafka = await topic_records(settings)
    reader = ArchiveReader(store)
    con = reader.connect()

    # -- decisions, alerts, dead letters: exactly the topics' --------------------------------
    archived = {eid: (d, by, sb, ep) for eid, d, by, sb, ep in con.execute(
        "SELECT decision_id, decision, decided_by, sandbox, episode FROM decisions").fetchall()}
    assert archived == {eid: (d["decision"], d["header"]["producer_id"].removeprefix(
        "trajbus."), d["header"]["sandbox"], d["header"]["episode"])
        for eid, d in kafka["decisions"].items()}
    assert {by for _, by, _, _ in archived.values()} == {"scheduler", "watchdog"}
    assert con.execute("SELECT count(*), count(DISTINCT decision_id) FROM decisions"
                       ).fetchone() == (len(kafka["decisions"]),) * 2
    alerts = {eid: (a, sb, ep) for eid, a, sb, ep in con.execute(
        "SELECT alert_id, alert, sandbox, episode FROM alerts").fetchall()}
    assert alerts == {eid: (a["alert"], a["header"]["sandbox"], a["header"]["episode"])
                      for eid, a in kafka["alerts"].items()}
    assert {(sb, ep) for a, sb, ep in alerts.values() if a == "LOOP"} == loops
    dead = {eid: (st, rc, src, off) for eid, st, rc, src, off in con.execute(
        "SELECT dead_letter_id, stage, reason_code, source_topic, source_offset "
        "FROM dead_letters").fetchall()}
    assert dead == {eid: (d["stage"], d["reason_code"], d["source_topic"], d["source_offset"])
                    for eid, d in kafka["dead_letters"].items()}
    assert {st for st, _, src, _ in dead.values() if src == topics.sandbox_events} >= \
        {"reorder", "archiver"}

    # -- how every episode ended, from the archive alone -------------------------------------
    terminates: dict[tuple[str, str], set[str]] = defaultdict(set)
    loop_alert = {eid: (a["header"]["sandbox"], a["header"]["episode"])
                  for eid, a in kafka["alerts"].items() if a["alert"] == "LOOP"}
    scheduler_cut: dict[str, str] = {}
    for eid, d in kafka["decisions"].items():
        if d["decision"] != "TERMINATE":
            continue
        for key in [(d["header"]["sandbox"], d["header"]["episode"]),
                    *(loop_alert[c] for c in d["cause_event_ids"] if c in loop_alert)]:
            terminates[key].add(eid)
        if d["header"]["producer_id"] == "trajbus.scheduler":
            scheduler_cut[d["header"]["sandbox"]] = eid
    rows = {(r["sandbox"], r["episode"]): r for r in reader.episodes().to_pylist()}
    assert set(rows) == {(e.sandbox, e.episode) for e in manifest.episodes}
    for e in manifest.episodes:
        r = rows[(e.sandbox, e.episode)]
        got = (r["ending"], r["truncated_by"])
        if (e.sandbox, e.episode) in loops:
            assert got == ("terminated", None), (e, r)
            assert r["terminate_decision_id"] in terminates[(e.sandbox, e.episode)], (e, r)
            acked = manifest.terminate_acks.get(e.sandbox)
            if acked in terminates[(e.sandbox, e.episode)]:  # the runtime acted on this one
                assert r["terminate_decision_id"] == acked
                assert (r["terminate_decided_by"], r["terminate_ack"]) == ("scheduler", "DONE")
        elif e.behaviour == "crash" and e.outcome == "TRUNCATED":
            assert got == ("truncated", "runtime"), (e, r)
        elif e.behaviour == "crash":  # never ended: its sandbox went away with it open
            # (a looping sandbox's scheduler TERMINATE came before its recycle)
            want = "terminate" if e.sandbox in scheduler_cut else "recycle"
            assert got == ("truncated", want), (e, r)
        else:
            assert got == ("complete", None), (e, r)
    assert not [k for k, r in rows.items() if r["ending"] == "in_progress"]

    # -- one episode's context ---------------------------------------------------------------
    sb, ep = sorted(loops)[0]
    ctx = reader.context("web-shop", sb, ep)
    assert ctx.outcome is not None and ctx.outcome["ending"] == "terminated"
    summary = ctx.summary()
    assert {(d["decision"], d["decided_by"]) for d in summary["decisions"]} >= {
        ("PLACE", "scheduler"), ("TERMINATE", "watchdog")}
    assert [a["alert"] for a in summary["alerts"]].count("LOOP") == 1
    json.dumps(summary)
