"""The decision context in the archive: decisions (with who decided), alerts and dead letters
are archived beside the events with the same exactly-once machinery, and every episode's
outcome (complete / truncated by what / terminated by which decision / in progress) is
answered by the archive alone. Store-level tests (no broker); the end-to-end run against a
real broker is tests/kafka/test_archive_context_kafka.py."""

from __future__ import annotations

import json
import uuid
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from test_archive_store import T0

from trajbus.archive import layout
from trajbus.archive.archiver import ArchiveShell
from trajbus.archive.context import (
    ContextFacts,
    Cut,
    SandboxFacts,
    Terminate,
    context_facts,
    decided_by,
    episode_ending,
)
from trajbus.archive.maintenance import compact, retention
from trajbus.archive.query import ArchiveReader
from trajbus.archive.storage import LocalStore, ObjectStore, open_store
from trajbus.archive.synth import ContextFleet, context_fleet
from trajbus.bus.settings import ArchiveSettings
from trajbus.schemas.models import Event

pytestmark = pytest.mark.timeout(120)

EVENTS, DECISIONS, ALERTS, DEAD = ("trajbus.sandbox.events", "trajbus.scheduler.decisions",
                                   "trajbus.watchdog.alerts", "trajbus.deadletter")
AREAS = {DECISIONS: "decisions", ALERTS: "alerts", DEAD: "dead_letters"}


# -- the pure rules ------------------------------------------------------------------------
def facts(**sb: Any) -> ContextFacts:
    return ContextFacts({("t", "s"): SandboxFacts(**sb)}, {"alert-1": ("s", "e1")})


def test_decided_by_is_the_producer_without_the_trajbus_prefix() -> None:
    assert decided_by("trajbus.watchdog") == "watchdog"
    assert decided_by("trajbus.scheduler") == "scheduler"
    assert decided_by("custom-scheduler") == "custom-scheduler"
    assert decided_by(None) == "unknown"


def test_an_episode_named_by_a_terminate_is_terminated_even_if_it_ended_normally() -> None:
    wd = Terminate("d-wd", 100, "watchdog", "e1", ())
    f = facts(terminates=[wd], gone=True)
    e = episode_ending(f, "t", "s", "e1", has_end=True, outcome="TERMINAL")
    assert (e.ending, e.terminate_decision_id, e.terminate_decided_by) == \
        ("terminated", "d-wd", "watchdog")
    # another episode of the sandbox is not terminated by it
    assert episode_ending(f, "t", "s", "e2", True, "TERMINAL").ending == "complete"


def test_the_schedulers_terminate_matches_through_the_alert_and_the_acked_one_wins() -> None:
    wd = Terminate("d-wd", 100, "watchdog", "e1", ())
    sched = Terminate("d-sched", 105, "scheduler", None, ("alert-1",))
    other = Terminate("d-other", 90, "scheduler", None, ("alert-unrelated",))
    e = episode_ending(facts(terminates=[wd, sched, other], acks={"d-sched": "DONE"}),
                       "t", "s", "e1", True, "TERMINAL")
    assert (e.ending, e.terminate_decision_id, e.terminate_decided_by, e.terminate_ack) == \
        ("terminated", "d-sched", "scheduler", "DONE")
    # without an ack: the earliest matching decision
    e = episode_ending(facts(terminates=[sched, wd]), "t", "s", "e1", True, "TERMINAL")
    assert (e.terminate_decision_id, e.terminate_ack) == ("d-wd", None)


@pytest.mark.parametrize("sandbox,has_end,outcome,expected", [
    ({}, True, "TERMINAL", ("complete", None)),
    ({}, True, "TRUNCATED", ("truncated", "runtime")),
    ({}, False, None, ("in_progress", None)),
    ({"gone": True}, False, None, ("truncated", "recycle")),
    ({"gone": True}, True, "TERMINAL", ("complete", None)),
    ({"cuts": [Cut(5, "reclaim", (), "d")]}, False, None, ("truncated", "reclaim")),
    ({"cuts": [Cut(5, "drain", ("probe-1",), "d")], "gone": True}, False, None,
     ("truncated", "drain")),
    # the DRAIN answering the sandbox's own DRAINING report: it went away on its own
    ({"cuts": [Cut(5, "drain", ("life-7",), "d")], "own_ids": {"life-7"}, "gone": True},
     False, None, ("truncated", "recycle")),
    # the first cut counts: a TERMINATE during a self-started drain does not
    ({"cuts": [Cut(9, "terminate", ("a",), "t"), Cut(5, "drain", ("life-7",), "d")],
      "own_ids": {"life-7"}, "gone": True}, False, None, ("truncated", "recycle")),
    ({"cuts": [Cut(5, "terminate", ("a",), "t")], "gone": True}, False, None,
     ("truncated", "terminate")),
])
def test_endings_without_a_terminate(sandbox: dict[str, Any], has_end: bool,
                                     outcome: str | None, expected: tuple[str, str | None]
                                     ) -> None:
    e = episode_ending(facts(**sandbox), "t", "s", "e1", has_end, outcome)
    assert (e.ending, e.truncated_by) == expected


def test_facts_from_rows_see_recycles_cuts_terminates_and_acks() -> None:
    def row(kind: str, **kw: Any) -> dict[str, Any]:
        p = kw.pop("payload", None)
        return {"task": "t", "sandbox": "s", "episode": None, "kind": kind,
                "payload_json": json.dumps(p) if p else None, **kw}

    stream = [row("SandboxLifecycle", state="ACTIVE", event_id="l1"),
              row("DecisionAck", outcome="DONE", payload={"decision_event_id": "d2"})]
    decisions = [row("SchedulingDecision", event_id="d1", event_time_ms=9,
                     producer_id="trajbus.scheduler", payload={"decision": "RECLAIM"}),
                 row("SchedulingDecision", event_id="d2", event_time_ms=3, episode="e1",
                     producer_id="trajbus.watchdog",
                     payload={"decision": "TERMINATE", "cause_event_ids": []})]
    alerts = [row("WatchdogAlert", event_id="a1", episode="e1")]
    f = context_facts(stream, decisions, alerts)
    sb = f.of("t", "s")
    assert sb is not None and not sb.gone
    # the watchdog's TERMINATE asks; the scheduler's RECLAIM cut the sandbox
    assert (sb.cut_by(), sb.own_ids, sb.acks) == ("reclaim", {"l1"}, {"d2": "DONE"})
    assert [d.decision_id for d in sb.terminates] == ["d2"]
    assert f.alert_episode == {"a1": ("s", "e1")}
    assert context_facts([row("SandboxLifecycle", state="RECYCLED")], [], []).of("t", "s") \
        .gone  # type: ignore[union-attr]


# -- the archive ---------------------------------------------------------------------------
def recs(topic: str, events: list[Event], start: int = 0) -> list[Any]:
    return [SimpleNamespace(topic=topic, partition=0, offset=start + i,
                            key=e.header.sandbox.encode(), value=e.encode(),
                            timestamp=e.header.event_time_ms)
            for i, e in enumerate(events)]


def shell(store: ObjectStore, tmp_path: Path, **cfg: Any) -> ArchiveShell:
    settings = ArchiveSettings(url="unused", spool_dir=str(tmp_path / f"spool-{uuid.uuid4()}"),
                               **cfg)
    return ArchiveShell(store, settings, areas=AREAS)


def archive(store: ObjectStore, tmp_path: Path, f: ContextFleet, twice: bool = False,
            **cfg: Any) -> list[Any]:
    """Archive the fleet (``twice``: every record re-sent once more, at later offsets) and
    commit; returns the records refused."""
    sh = shell(store, tmp_path, **cfg)
    rejected: list[Any] = []
    batches = []
    for topic, evs in ((EVENTS, f.events), (DECISIONS, f.decisions), (ALERTS, f.alerts),
                       (DEAD, f.dead_letters)):
        records = recs(topic, evs) + (recs(topic, evs, len(evs)) if twice else [])
        step = sh.process(records)
        rejected += step.rejected
        batches += step.batches
    batches += sh.flush_all().batches
    sh.committed(batches)
    sh.close()
    return rejected


@pytest.fixture(params=["local", "s3"])
def context_store(request: pytest.FixtureRequest, tmp_path: Path) -> ObjectStore:
    """An empty archive on local disk, and one on a loopback S3 server (the views and the
    context read S3 through pyarrow's S3 filesystem, not DuckDB's own reader)."""
    if request.param == "local":
        return LocalStore(tmp_path / "archive")
    import boto3

    endpoint = request.getfixturevalue("s3_server")
    bucket = f"ctx-{uuid.uuid4().hex[:8]}"
    boto3.client("s3", endpoint_url=endpoint).create_bucket(Bucket=bucket)
    return open_store(f"s3://{bucket}/trajbus/archive", endpoint)


def test_context_topics_land_in_their_own_areas_once_each(tmp_path: Path,
                                                          context_store: ObjectStore) -> None:
    store = context_store
    f = context_fleet(t0_ms=T0)
    assert archive(store, tmp_path, f, twice=True) == []
    keys = [o.key for o in store.list("")]
    for area in layout.CONTEXT_AREAS:
        assert any(k.startswith(f"{area}/date=2024-05-01/hour=10/task=") for k in keys), area
        assert any(k.startswith(f"{layout.index_area(area)}/date=2024-05-01/") for k in keys)
    assert not any(k.startswith("conflicts/") for k in keys)  # re-sent copies dropped
    con = ArchiveReader(store).connect()

    def q(sql: str) -> list[tuple[Any, ...]]:
        return con.execute(sql).fetchall()

    assert q("SELECT count(*) FROM events") == [(len(f.events),)]
    assert q("SELECT count(*) FROM decisions") == [(len(f.decisions),)]
    assert q("SELECT count(*) FROM alerts") == [(1,)]
    # two dead letters with the same source offset (different topics) are two rows
    assert q("SELECT source_topic, reason_code FROM dead_letters ORDER BY source_topic") == [
        ("trajbus.sandbox.events", "seq_after_end"), ("trajbus.trace.chunks", "seq_after_end")]
    assert sorted(q("SELECT decision, decided_by, episode FROM decisions "
                    "WHERE decision = 'TERMINATE'")) == [
        ("TERMINATE", "scheduler", None), ("TERMINATE", "watchdog", "00000")]
    # a tenant's decision (its subject is not a sandbox id) and the fleet's task
    assert q("SELECT task, sandbox, tenant FROM decisions WHERE decision = 'DEMOTE'") == [
        ("_fleet", "tenant:acme", "acme")]
    sched = f.endings[("sb-loop", "00000")][2]
    assert q("SELECT sandbox, decision_id, ack, decided_by FROM decision_acks") == [
        ("sb-loop", sched, "DONE", "scheduler")]
    assert q("SELECT state FROM lifecycle WHERE sandbox = 'sb-crash' AND kind = "
             "'SandboxLifecycle' ORDER BY seq") == [
        ("PROVISIONING",), ("ACTIVE",), ("DRAINING",), ("RECYCLED",)]
    assert q("SELECT final_seqs FROM lifecycle WHERE sandbox = 'sb-crash' AND kind = "
             "'Drained'")[0][0] == [{"episode": "00001", "final_seq": 4}]
    got = {(s, e): (end, by, d) for s, e, end, by, d in q(
        "SELECT sandbox, episode, ending, truncated_by, terminate_decision_id FROM episodes")}
    assert got == f.endings


def test_context_of_an_episode_answers_outcome_decisions_alerts_and_dead_letters(
        tmp_path: Path, context_store: ObjectStore) -> None:
    store = context_store
    f = context_fleet(t0_ms=T0)
    archive(store, tmp_path, f)
    reader = ArchiveReader(store)
    ctx = reader.context(task="web-shop", sandbox="sb-loop", episode="00000")
    assert ctx.outcome is not None and ctx.outcome["ending"] == "terminated"
    assert ctx.outcome["terminate_ack"] == "DONE"
    assert sorted(zip(ctx.decisions.column("decided_by").to_pylist(),
                      [json.loads(p)["decision"] for p in
                       ctx.decisions.column("payload_json").to_pylist()], strict=True)) == [
        ("scheduler", "PLACE"), ("scheduler", "RECYCLE"), ("scheduler", "TERMINATE"),
        ("watchdog", "TERMINATE")]
    assert ctx.alerts.num_rows == 1 and ctx.dead_letters.num_rows == 0
    assert ctx.acks.num_rows == 1
    assert ctx.lifecycle.column("state").to_pylist()[-1] == "RECYCLED"
    crash = reader.context("web-shop", "sb-crash", "00001")
    assert crash.outcome is not None
    assert (crash.outcome["ending"], crash.outcome["truncated_by"]) == ("truncated", "recycle")
    assert crash.dead_letters.num_rows == 2
    summary = crash.summary()
    assert [d["decision"] for d in summary["decisions"]] == ["PLACE", "DRAIN", "RECYCLE_WITH_LOSS"]
    json.dumps(summary)  # JSON-ready
    # the dead letters name episode 00001: not part of 00000's context
    assert reader.context("web-shop", "sb-crash", "00000").dead_letters.num_rows == 0


def test_an_unreadable_dead_letter_record_is_skipped_not_dead_lettered_again(
        tmp_path: Path) -> None:
    store = LocalStore(tmp_path / "archive")
    sh = shell(store, tmp_path)
    garbage = [SimpleNamespace(topic=t, partition=0, offset=0, key=None, value=b"not avro",
                               timestamp=T0) for t in (DEAD, DECISIONS)]
    step = sh.process(garbage)
    assert step.unreadable_dead_letters == 1
    assert [(r.topic, r.reason_code) for r in step.rejected] == [(DECISIONS, "bad_magic")]
    sh.close()


def test_a_dead_letter_with_an_invalid_task_is_archived_under_unknown(tmp_path: Path) -> None:
    from trajbus.bus.deadletter import dead_letter_event

    store = LocalStore(tmp_path / "archive")
    dl = dead_letter_event(stage="reorder", reason_code="invalid_event", reason="bad task",
                           source_topic=EVENTS, source_partition=0, source_offset=1, key=None,
                           value=b"x", producer_id="trajbus.reorder", task="bad/../task",
                           event_time_ms=T0)
    sh = shell(store, tmp_path)
    step = sh.process(recs(DEAD, [dl]))
    assert step.rejected == []
    sh.committed(step.batches + sh.flush_all().batches)
    sh.close()
    rows = ArchiveReader(store).area("dead_letters").to_pylist()
    assert [r["task"] for r in rows] == ["_unknown"]
    assert json.loads(rows[0]["payload_json"])["$header"]["task"] == "bad/../task"


def test_compaction_and_retention_cover_the_context_areas(tmp_path: Path) -> None:
    store = LocalStore(tmp_path / "archive")
    f = context_fleet(t0_ms=T0)
    # tiny batches: several objects per area and hour
    sh = shell(store, tmp_path, target_object_bytes=600)
    batches = []
    for topic, evs in ((EVENTS, f.events), (DECISIONS, f.decisions), (ALERTS, f.alerts),
                       (DEAD, f.dead_letters)):
        step = sh.process(recs(topic, evs))
        batches += step.batches
    batches += sh.flush_all().batches
    sh.committed(batches)
    sh.close()
    reader = ArchiveReader(store)
    before = {v: reader.connect().execute(f"SELECT count(*) FROM {v}").fetchall()
              for v in ("events", "decisions", "alerts", "dead_letters")}
    endings_before = reader.episodes().select(["sandbox", "episode", "ending"]).to_pylist()
    n_decision_objects = len([o for o in store.list("decisions/")])
    assert n_decision_objects > 1
    rep = compact(store, min_age_ms=0, grace_ms=0)
    assert any(k.startswith("decisions/") for k in rep.outputs)
    assert any(k.startswith("dead_letters/") for k in rep.inputs)
    assert len([o for o in store.list("decisions/")]) < n_decision_objects
    live = {o.key for o in store.list("decisions/")}
    indexed = {layout.parse_object_key(o.key).data_key  # type: ignore[union-attr]
               for o in store.list("decisions_index/")}
    assert indexed == live  # the inputs' index files went with them
    after = {v: reader.connect().execute(f"SELECT count(*) FROM {v}").fetchall()
             for v in before}
    assert after == before
    assert reader.episodes().select(["sandbox", "episode", "ending"]).to_pylist() == \
        endings_before
    doomed = retention(store, days=1, now_ms=T0 + 10 * 86_400_000)
    assert {k.split("/", 1)[0] for k in doomed} >= {"decisions", "decisions_index", "alerts",
                                                    "dead_letters", "events", "index"}
    assert not any(store.list("decisions/")) and not any(store.list("decisions_index/"))


def test_the_flush_rule_applies_to_the_context_and_freshness_counts_events_only(
        tmp_path: Path) -> None:
    """A decision is written once it is flush_after_ms old in the log's time, as an event is;
    the freshness the archiver reports is that of the fleet's events (a dead letter is stamped
    when it was refused, which says nothing about how fresh the archive is)."""
    store = LocalStore(tmp_path / "archive")
    f = context_fleet(t0_ms=T0)
    sh = shell(store, tmp_path, flush_after_ms=30_000)
    context = recs(DECISIONS, f.decisions[:1]) + recs(DEAD, f.dead_letters[:1])
    for r in context:
        r.timestamp = T0  # appended to the log together
    step = sh.process(context)
    assert step.batches == []
    later = SimpleNamespace(topic=EVENTS, partition=0, offset=0, key=b"sb-run",
                            value=f.events[0].encode(), timestamp=T0 + 31_000)
    step = sh.process([later])
    assert {b.topic for b in step.batches} == {DECISIONS, DEAD}
    assert sorted(o.key.split("/", 1)[0] for b in step.batches for o in b.objects) == \
        ["dead_letters", "decisions"]
    assert sh.newest_written_ms == 0  # no event written yet
    step = sh.flush_all()
    assert sh.newest_written_ms == f.events[0].header.event_time_ms
    sh.close()
