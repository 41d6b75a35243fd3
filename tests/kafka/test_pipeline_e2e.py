"""The whole pipeline on a simulated fleet, through a real broker and a worker process:
the trainer's view equals exactly what the emitters acknowledged, every planted loop (single
calls and cycles) is caught with one alert, look-alike non-loops are left alone, decisions
flow, and the archive answers a DuckDB query. This is `make demo`'s check, run in CI.

The demo's printed summary is not taken on trust: this test reads the output topics itself and
compares them with the simulator's manifest (what the fleet did, with every acknowledged
(seq, event id) and every planted loop):

- alerts: exactly one LOOP and one LOOP_ENDED per planted loop (pattern length 1 for a loop,
  2 for a cycle, starting where the planted repetition starts), nothing else;
- decisions: per sandbox the scheduler's PLACE, DRAIN, RECYCLE in that order (a clean
  drain-before-recycle, no QUEUE/RECLAIM/ANOMALY/RECYCLE_WITH_LOSS; for a looping sandbox its
  TERMINATE may start or join the drain), and the watchdog's one TERMINATE (suspicious, citing
  the LOOP alert) per planted loop;
- dead letters: none (the input is clean: nothing is planted to be rejected);
- archive: every acknowledged event, per episode and per sandbox-level stream, read back with
  SQL.
"""

from __future__ import annotations

import asyncio
import json
import re
import time
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

import pytest
from faults_support import read_all
from support import Worker, settings_for

from trajbus.archive.query import ArchiveReader
from trajbus.archive.storage import open_store
from trajbus.bus.settings import ArchiveSettings, Settings
from trajbus.bus.topics import Topics
from trajbus.pipeline_demo import run_pipeline
from trajbus.schemas.codec import default_codec

pytestmark = [pytest.mark.kafka, pytest.mark.timeout(420)]

SEED = 4242
LIFECYCLE = ["PLACE", "DRAIN", "RECYCLE"]  # a clean sandbox's scheduler decisions, in order


async def _outputs(settings: Settings) -> dict[str, list[dict[str, Any]]]:
    """Every record of the decisions, alerts and dead-letter topics, decoded, in offset order
    per partition (a sandbox's records share its partition). Ticks are left out."""
    topics = Topics(settings)
    names = {topics.decisions: "decisions", topics.alerts: "alerts",
             topics.deadletter: "dead_letters"}
    codec = default_codec()
    out: dict[str, list[dict[str, Any]]] = {v: [] for v in names.values()}
    recs = await read_all(settings, list(names))
    for r in sorted(recs, key=lambda r: (r.topic, r.partition, r.offset)):
        d = codec.decode(r.value or b"")
        if d.kind == "Tick":
            continue
        out[names[r.topic]].append({"kind": d.kind, **d.record})
    return out


def _settled(outputs: dict[str, list[dict[str, Any]]], sandboxes: set[str],
             loops: set[tuple[str, str]]) -> bool:
    """Every sandbox recycled and every planted loop ended, as far as the topics show."""
    recycled = {d["header"]["sandbox"] for d in outputs["decisions"]
                if d["decision"] in ("RECYCLE", "RECYCLE_WITH_LOSS")}
    ended = {(a["header"]["sandbox"], a["header"]["episode"]) for a in outputs["alerts"]
             if a["kind"] == "WatchdogAlert" and a["alert"] == "LOOP_ENDED"}
    return sandboxes <= recycled and loops <= ended


async def test_pipeline_delivers_exactly_what_was_acknowledged_and_catches_loops(
        kafka_broker, unique_name, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    settings = settings_for(kafka_broker.bootstrap, unique_name, partitions=3,
                            archive=ArchiveSettings(url=str(tmp_path / "archive"),
                                                    spool_dir=str(tmp_path / "spool")))
    code = await run_pipeline(settings, sandboxes=16, episodes=2, seed=SEED,
                              work_root=tmp_path / "work", settle_timeout_s=120)
    out = capsys.readouterr().out
    assert code == 0, out
    caught = re.search(r"watchdog: (\d+)/(\d+) planted loops caught, 0 false alarms", out)
    assert caught and caught.group(1) == caught.group(2) and int(caught.group(2)) >= 2, out
    assert "episodes exactly equal to what the emitters acknowledged" in out
    assert "sample query" in out
    assert re.search(r"decision context: \d+ decisions .*; the same as on their topics", out), out

    manifest = json.loads((tmp_path / "work" / str(SEED) / "manifest.json").read_text())
    episodes = manifest["episodes"]
    sandboxes = {e["sandbox"] for e in episodes} | set(manifest["sandbox_streams"])
    assert len(sandboxes) == 16
    loops = {(lp["sandbox"], lp["episode"]): lp for lp in manifest["loops"]}
    kinds = Counter(lp["kind"] for lp in loops.values())
    assert kinds["loop"] >= 1 and kinds["cycle"] >= 1, kinds  # the seed plants both kinds
    assert any(e["behaviour"] == "nonloop" for e in episodes)  # and look-alikes

    # The demo stops its worker as soon as the trainer has every episode; the drain
    # confirmations (RECYCLE) and the loops' ends may still be in flight then. If so, a worker
    # resuming from the committed state (as after any restart) finishes them; it must not
    # repeat anything already decided (checked below: exact counts).
    outputs = await _outputs(settings)
    resumed = False
    if not _settled(outputs, sandboxes, set(loops)):
        resumed = True
        worker = Worker(settings, "watchdog,scheduler", worker_id="demo",
                        log_path=tmp_path / "settle-worker.log").start()
        try:
            deadline = time.monotonic() + 120
            while not _settled(outputs := await _outputs(settings), sandboxes, set(loops)):
                assert worker.proc is not None and worker.proc.poll() is None, \
                    (tmp_path / "settle-worker.log").read_text()[-3000:]
                assert time.monotonic() < deadline, "decisions did not settle in 120 s"
                await asyncio.sleep(1)
        finally:
            await asyncio.to_thread(worker.stop)
        outputs = await _outputs(settings)
    context = f"(settled by a resumed worker: {resumed})"

    # -- dead letters: the input is clean, so none ----------------------------------------
    assert [(d["stage"], d["reason_code"], d["reason"][:200]) for d in outputs["dead_letters"]
            ] == [], context

    # -- alerts: one LOOP and one LOOP_ENDED per planted loop, nothing else ------------------
    alerts = [a for a in outputs["alerts"] if a["kind"] == "WatchdogAlert"]
    got_alerts = Counter((a["header"]["sandbox"], a["header"]["episode"], a["alert"])
                         for a in alerts)
    want_alerts = Counter({(s, ep, kind): 1 for (s, ep) in loops
                           for kind in ("LOOP", "LOOP_ENDED")})
    assert got_alerts == want_alerts, context
    loop_alert = {(a["header"]["sandbox"], a["header"]["episode"]): a for a in alerts
                  if a["alert"] == "LOOP"}
    for key, lp in loops.items():
        a = loop_alert[key]
        assert a["dry_run"] is False and a["distinct_results"] == 0, a
        assert len(a["pattern"]) == (1 if lp["kind"] == "loop" else 2), (lp, a)
        assert a["first_seq"] == lp["first_seq"] and a["last_seq"] <= lp["last_seq"], (lp, a)
        assert a["repeat_count"] >= 20 and a["span_ms"] >= 120_000, a

    # -- decisions -------------------------------------------------------------------------
    # The watchdog: one TERMINATE (suspicious, citing its LOOP alert) per planted loop.
    # The scheduler, per sandbox: PLACE, the start of the drain, RECYCLE (a clean drain-before-
    # recycle: no QUEUE/RECLAIM/ANOMALY/RECYCLE_WITH_LOSS). For a looping sandbox the LOOP
    # alert may reach the scheduler before the sandbox reports DRAINING (then its TERMINATE
    # starts the drain) or while it drains (one TERMINATE after the DRAIN); after the RECYCLE
    # it is ignored. Either way at most one scheduler TERMINATE, citing a LOOP alert.
    by_sandbox: dict[str, dict[str, list[dict[str, Any]]]] = defaultdict(
        lambda: {"trajbus.scheduler": [], "trajbus.watchdog": []})
    for d in outputs["decisions"]:
        assert d["kind"] == "SchedulingDecision", d
        by_sandbox[d["header"]["sandbox"]][d["header"]["producer_id"]].append(d)
    assert set(by_sandbox) == sandboxes, (sorted(set(by_sandbox) ^ sandboxes), context)
    loop_alert_ids = {a["header"]["event_id"]: key for key, a in loop_alert.items()}
    for sandbox in sorted(sandboxes):
        by_producer = by_sandbox[sandbox]
        assert set(by_producer) == {"trajbus.scheduler", "trajbus.watchdog"}, by_producer
        planted = sorted(ep for s, ep in loops if s == sandbox)
        watchdog = by_producer["trajbus.watchdog"]
        assert sorted(d["header"]["episode"] for d in watchdog) == planted, (sandbox, context)
        for d in watchdog:
            alert = loop_alert[(sandbox, d["header"]["episode"])]
            assert d["decision"] == "TERMINATE" and d["suspicious"] is True, d
            assert alert["header"]["event_id"] in d["cause_event_ids"], (d, alert)
        scheduler = [d["decision"] for d in by_producer["trajbus.scheduler"]]
        allowed = [LIFECYCLE]
        if planted:
            allowed += [["PLACE", "TERMINATE", "RECYCLE"],
                        ["PLACE", "DRAIN", "TERMINATE", "RECYCLE"]]
        assert scheduler in allowed, (sandbox, [(d["decision"], d["reason"])
                                                for d in by_producer["trajbus.scheduler"]],
                                      context)
        for d in by_producer["trajbus.scheduler"]:
            if d["decision"] == "TERMINATE":
                assert d["suspicious"] is True, d
                cited = [loop_alert_ids.get(c) for c in d["cause_event_ids"]]
                assert any(k is not None and k[0] == sandbox for k in cited), d

    # -- the runtime's answer: a looping sandbox acknowledges the scheduler's TERMINATE ------
    # (the simulated runtime waits a bounded time for it before draining; under heavy load
    # the TERMINATE may come later, then there is no ack and alerts says so)
    acks = manifest["terminate_acks"]
    sched_terminate = {s: d["header"]["event_id"] for s, p in by_sandbox.items()
                       for d in p["trajbus.scheduler"] if d["decision"] == "TERMINATE"}
    assert set(acks) <= {s for s, _ in loops}, acks
    assert all(acks[s] == sched_terminate.get(s) for s in acks), (acks, sched_terminate)
    assert loops and acks, "no looping sandbox acknowledged its TERMINATE"
    from trajbus.consumers.operator.alerts import happenings

    shown = {h.sandbox: h for h in await happenings(settings, 0, ["TERMINATE"])}
    assert set(shown) == {s for s, _ in loops}, (sorted(shown), sorted(loops))
    for sandbox, h in shown.items():  # one line per termination, its provenance right
        if sandbox in sched_terminate:
            assert h.source == "scheduler" and h.requested_by == ("watchdog",), h
            assert h.status == ("done" if sandbox in acks else "not acknowledged"), h
        else:  # the scheduler ignored the alert: the sandbox was recycled already
            assert h.source == "watchdog" and h.status == "requested", h

    # -- archive: every acknowledged event, read back with SQL ------------------------------
    con = ArchiveReader(open_store(str(tmp_path / "archive"))).connect()
    archived: dict[tuple[str, str | None], set[tuple[int, str]]] = defaultdict(set)
    for sandbox, episode, seq, event_id in con.execute(
            "SELECT sandbox, episode, seq, event_id FROM events").fetchall():
        archived[(sandbox, episode)].add((seq, event_id))
    want: dict[tuple[str, str | None], set[tuple[int, str]]] = {
        (e["sandbox"], e["episode"]): {(seq, eid) for seq, eid in e["acked"]} for e in episodes}
    want.update({(s, None): {(seq, eid) for seq, eid in pairs}
                 for s, pairs in manifest["sandbox_streams"].items()})
    assert set(archived) == set(want)
    wrong = {k: (len(archived[k]), len(v)) for k, v in want.items() if archived[k] != v}
    assert wrong == {}, wrong

    # -- archive: the decision context, and how every episode ended ------------------------
    # (archived again: the demo's archive run may have preceded the settling decisions)
    from trajbus.archive.archiver import run_archiver

    await run_archiver(settings, until_idle=True)
    reader = ArchiveReader(open_store(str(tmp_path / "archive")))
    con = reader.connect()
    assert {eid: (d, by) for eid, d, by in con.execute(
        "SELECT decision_id, decision, decided_by FROM decisions").fetchall()} == {
        d["header"]["event_id"]: (d["decision"], d["header"]["producer_id"].removeprefix(
            "trajbus.")) for d in outputs["decisions"]}, context
    assert sorted(con.execute("SELECT alert_id FROM alerts").fetchall()) == sorted(
        (a["header"]["event_id"],) for a in outputs["alerts"] if a["kind"] == "WatchdogAlert")
    assert con.execute("SELECT count(*) FROM dead_letters").fetchone() == (0,)
    # the TERMINATEs about an episode: the watchdog's naming it, the scheduler's citing its
    # LOOP alert (one per sandbox: a sandbox's second looping episode has the watchdog's only)
    about: dict[tuple[str, str], set[str]] = defaultdict(set)
    for d in outputs["decisions"]:
        if d["decision"] == "TERMINATE":
            for key in [(d["header"]["sandbox"], d["header"]["episode"]),
                        *(loop_alert_ids[c] for c in d["cause_event_ids"]
                          if c in loop_alert_ids)]:
                about[key].add(d["header"]["event_id"])
    endings = {(r["sandbox"], r["episode"]): r for r in reader.episodes().to_pylist()}
    for e in episodes:
        key = (e["sandbox"], e["episode"])
        r = endings[key]
        if key in loops:
            assert r["ending"] == "terminated", (e, r)
            assert r["terminate_decision_id"] in about[key], (e, r)
            if acks.get(e["sandbox"]) in about[key]:  # the one the runtime acted on
                assert r["terminate_decision_id"] == acks[e["sandbox"]], (e, r)
                assert (r["terminate_decided_by"], r["terminate_ack"]) == ("scheduler", "DONE")
        elif e["behaviour"] == "crash":
            assert r["ending"] == "truncated", (e, r)
        else:
            assert (r["ending"], r["truncated_by"]) == ("complete", None), (e, r)
