"""Operators' discovery and reading commands against a real broker (issue 16, items 1-4):
``trajbus consume`` on every kind of topic, ``trajbus deadletters`` (counts, list, show with
the original decoded, re-drive after a fix, idempotently), ``trajbus alerts --since``,
``watchdog explain --from-log`` at the moment the loop fired, ``replay explain`` cause before
effect, and ``trajbus status`` (live group members, lag without transaction markers) and
``scheduler status`` in human units. Every command runs as an operator runs it: a
subprocess configured by ``TRAJBUS_`` variables."""

from __future__ import annotations

import asyncio
import json
import re
import subprocess
import sys
import time
from datetime import UTC, datetime, timedelta

import pytest
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition
from replay_support import publish_replay
from support import (
    REPO,
    Worker,
    consume_until,
    env_for,
    make_episodes,
    produce,
    settings_for,
)

from trajbus.bus.admin import ensure_base_topics
from trajbus.bus.settings import Settings
from trajbus.bus.topics import Topics
from trajbus.consumers.operator.tools import (
    DerivedRecord,
    ExplainedItem,
    Explanation,
    causal_order,
    group_offsets,
    read_records,
    watchdog_history,
)
from trajbus.schemas import models as m
from trajbus.schemas.codec import default_codec

pytestmark = [pytest.mark.kafka, pytest.mark.timeout(240)]

NOISE = ("Traceback", "Unclosed AIOKafka", "Exception ignored")


def _cli(settings: Settings, *argv: str, **env: str) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run([sys.executable, "-m", "trajbus", *argv],
                          env=env_for(settings, **env), cwd=REPO, capture_output=True,
                          text=True, timeout=120, check=False)
    assert not any(n in proc.stdout + proc.stderr for n in NOISE), proc.stderr
    return proc


def _json_lines(text: str) -> list[dict[str, object]]:
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def _hdr(sandbox: str, seq: int, t: int, episode: str | None = None, task: str = "web-shop",
         event_id: str | None = None) -> m.Envelope:
    return m.Envelope(event_id=event_id or f"{sandbox}-{episode}-{seq}", task=task,
                      sandbox=sandbox, episode=episode, seq=seq, event_time_ms=t,
                      producer_id="test")


async def _produce_at(settings: Settings, topic: str, items: list[tuple[str, bytes, int]]
                      ) -> None:
    """(key, value, record timestamp) to a CreateTime topic."""
    producer = AIOKafkaProducer(bootstrap_servers=settings.kafka.bootstrap_servers)
    await producer.start()
    try:
        for key, value, ts in items:
            await producer.send_and_wait(topic, value, key=key.encode(), timestamp_ms=ts)
    finally:
        await producer.stop()


# -- item 1: consume ---------------------------------------------------------------------------
def test_consume_decodes_every_kind_of_topic_with_positions_filters_and_time(
        kafka_broker: object, unique_name: str) -> None:
    settings = settings_for(kafka_broker.bootstrap, unique_name)  # type: ignore[attr-defined]
    topics = Topics(settings)
    eps = make_episodes(2, seed=31, task="web-shop")
    now = datetime.now(UTC)
    old, recent = (int((now - timedelta(hours=h)).timestamp() * 1000) for h in (2, 0.1))
    alert = m.WatchdogAlert(header=_hdr("sb-1", 9, old, "ep-1", event_id="a-old"),
                            alert=m.AlertKind.LOOP, repeat_count=20, span_ms=150_000,
                            pattern=["exec:" + "ab" * 32], reason="looping")
    terminate = m.SchedulingDecision(header=_hdr("sb-1", 1, recent, "ep-1", event_id="d-new"),
                                     decision=m.DecisionKind.TERMINATE,
                                     reason="watchdog loop over 150000 ms", suspicious=True)
    place = m.SchedulingDecision(header=_hdr("sb-2", 0, old, event_id="d-old"),
                                 decision=m.DecisionKind.PLACE, reason="best fit on n1")
    dead = m.DeadLetter(header=_hdr("sb-1", 5, recent, "ep-1", event_id="dl-1"),
                        reason_code="invalid_seq", reason="seq -1", stage="reorder",
                        source_topic=topics.sandbox_events, original_value=b"\x00bad")

    async def setup() -> None:
        await ensure_base_topics(settings)
        await produce(settings, topics.sandbox_events,
                      [(e.sandbox, v) for e in eps for v in e.events]
                      + [("sb-x", b"not avro at all")])
        await publish_replay(settings, "web-shop", eps)
        await _produce_at(settings, topics.alerts, [("sb-1", alert.encode(), old)])
        await _produce_at(settings, topics.decisions, [("sb-2", place.encode(), old),
                                                       ("sb-1", terminate.encode(), recent)])
        await _produce_at(settings, topics.deadletter, [("sb-1", dead.encode(), recent)])
        await _produce_at(settings, topics.late, [("sb-1/ep-1", eps[0].events[1], recent)])

    asyncio.run(setup())
    n_raw = sum(e.n for e in eps) + 1

    # raw: every record, decoded, with its position; the undecodable one says why
    proc = _cli(settings, "consume", "events", "--json")
    assert proc.returncode == 0, proc.stderr
    rows = _json_lines(proc.stdout)
    assert len(rows) == n_raw
    assert {(r["topic"], r["kind"]) for r in rows} >= {(topics.sandbox_events, "ToolCall"),
                                                       (topics.sandbox_events, "undecodable")}
    bad = next(r for r in rows if r["kind"] == "undecodable")
    assert bad["error"] and bad["key"] == "sb-x" and isinstance(bad["offset"], int)

    # filters and --count
    ep = eps[0]
    proc = _cli(settings, "consume", topics.sandbox_events, "--sandbox", ep.sandbox,
                "--episode", ep.episode, "--kind", "toolcall", "--json")
    got = _json_lines(proc.stdout)
    assert got and all(r["kind"] == "ToolCall" and r["record"]["header"]["episode"] == ep.episode
                       for r in got)
    assert len(_cli(settings, "consume", "events", "-n", "3").stdout.splitlines()) == 3

    # each derived topic, by its short name, decoded
    for name, kind in (("web-shop", "ReplaySegment"), ("alerts", "WatchdogAlert"),
                       ("decisions", "SchedulingDecision"), ("deadletter", "DeadLetter"),
                       ("late", "ToolCall")):
        proc = _cli(settings, "consume", name, "--json")
        assert proc.returncode == 0, proc.stderr
        assert {r["kind"] for r in _json_lines(proc.stdout)} == {kind}, name
    segs = _cli(settings, "consume", "replay.web-shop").stdout
    assert segs.count("FIRST LAST") == 2

    # time: --from a relative time uses the record timestamps; labels filter decisions
    proc = _cli(settings, "consume", "decisions", "--from", "-1h")
    assert [line.split()[2] for line in proc.stdout.splitlines()] == ["TERMINATE"]
    assert "2m 30s" in proc.stdout  # 150000 ms, in human units
    proc = _cli(settings, "consume", "decisions", "--kind", "PLACE", "--json")
    assert [r["record"]["header"]["event_id"] for r in _json_lines(proc.stdout)] == ["d-old"]
    assert _cli(settings, "consume", "alerts", "--from", "end").stdout == ""

    # --follow prints what arrives after the end, here until -n 1
    follower = subprocess.Popen([sys.executable, "-m", "trajbus", "consume", "alerts", "--from",
                                 "end", "--follow", "-n", "1", "--json"],
                                env=env_for(settings), cwd=REPO, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        out = ""
        while not out:  # produce until the follower (which started at the end) sees one
            assert time.monotonic() < deadline, "the follower printed nothing"
            fresh = m.WatchdogAlert(header=_hdr("sb-9", 1, recent, "ep-9",
                                                event_id=f"a-{time.monotonic()}"),
                                    alert=m.AlertKind.STALL, reason="open call")
            asyncio.run(_produce_at(settings, topics.alerts, [("sb-9", fresh.encode(),
                                                               int(time.time() * 1000))]))
            try:
                out, err = follower.communicate(timeout=5)
            except subprocess.TimeoutExpired:
                continue
        assert follower.returncode == 0, err
        assert _json_lines(out)[0]["record"]["alert"] == "STALL"
    finally:
        if follower.poll() is None:
            follower.kill()
            follower.wait(timeout=10)

    # unknown topic: what exists
    proc = _cli(settings, "consume", "evnets")
    assert proc.returncode == 1 and "existing topics:" in proc.stderr \
        and topics.sandbox_events in proc.stderr


# -- item 2: dead letters ----------------------------------------------------------------------
def test_deadletters_counts_list_show_and_an_idempotent_redrive_after_the_fix(
        kafka_broker: object, unique_name: str) -> None:
    settings = settings_for(kafka_broker.bootstrap, unique_name)  # type: ignore[attr-defined]
    topics = Topics(settings)
    t = int(time.time() * 1000)
    sb = "sb-busy"

    def ev(kind: type[m.Event], ep: str, seq: int, **kw: object) -> m.Event:
        return kind(header=_hdr(sb, seq, t + seq, ep), **kw)

    def call(ep: str, seq: int, args: str = "a") -> m.Event:
        return ev(m.ToolCall, ep, seq, call_id=f"c{seq}", tool="exec", args_hash=args * 64)

    # ep-2 runs while ep-1 is open: with one open episode allowed, its events are refused
    ep1 = [ev(m.EpisodeStart, "ep-1", 0), call("ep-1", 1)]
    ep2 = [ev(m.EpisodeStart, "ep-2", 0), call("ep-2", 1), call("ep-2", 2),
           ev(m.EpisodeEnd, "ep-2", 3, outcome=m.EpisodeOutcome.TERMINAL)]
    ep1_end = [ev(m.EpisodeEnd, "ep-1", 2, outcome=m.EpisodeOutcome.TERMINAL)]
    # ep-3: seq 2 waits for seq 1 when a conflicting copy of seq 2 arrives
    ep3 = [ev(m.EpisodeStart, "ep-3", 0), call("ep-3", 2, "b"), call("ep-3", 2, "c"),
           call("ep-3", 1), ev(m.EpisodeEnd, "ep-3", 3, outcome=m.EpisodeOutcome.TERMINAL)]
    ep3[2] = ep3[2].model_copy(update={"header": _hdr(sb, 2, t + 2, "ep-3", event_id="dup")})

    async def setup() -> None:
        await ensure_base_topics(settings, ["web-shop"])
        await produce(settings, topics.sandbox_events, [(sb, e.encode()) for e in
                                                        ep1 + ep2 + ep1_end + ep3])

    asyncio.run(setup())
    worker = Worker(settings, "reorder", extra_env={
        "TRAJBUS_REPLAY__MAX_OPEN_EPISODES_PER_SANDBOX": "1"}).start()
    try:
        codec = default_codec()
        asyncio.run(consume_until(settings, topics.deadletter, lambda vs: len(vs) >= 5))

        proc = _cli(settings, "deadletters")
        assert proc.returncode == 0, proc.stderr
        assert re.search(r"reorder\s+too_many_open_episodes\s+4\b", proc.stdout), proc.stdout
        assert re.search(r"reorder\s+conflicting_duplicate\s+1\b", proc.stdout), proc.stdout
        counts = json.loads(_cli(settings, "deadletters", "--json").stdout)
        assert counts["total"] == 5

        listed = _json_lines(_cli(settings, "deadletters", "list", "--reason",
                                  "too_many_open_episodes", "--json").stdout)
        assert [(d["source"]["topic"], d["episode"]) for d in listed] == [
            (topics.sandbox_events, "ep-2")] * 4

        conflict = _json_lines(_cli(settings, "deadletters", "list", "--reason",
                                    "conflicting_duplicate", "--json").stdout)[0]
        shown = _cli(settings, "deadletters", "show", str(conflict["id"])[:8])
        assert shown.returncode == 0, shown.stderr
        assert "original: " in shown.stdout and "call c2: exec(args " in shown.stdout
        assert "kept version (conflicting duplicate)" in shown.stdout
        whole = json.loads(_cli(settings, "deadletters", "show", str(conflict["id"]),
                                "--json").stdout)
        assert whole["original"]["record"]["args_hash"] == "c" * 64
        assert whole["conflicting"]["record"]["args_hash"] == "b" * 64
        missing = _cli(settings, "deadletters", "show", "ffffffff")
        assert missing.returncode == 1 and "latest:" in missing.stderr

        # the fix: ep-1 has ended, so ep-2 is admitted now. Re-drive it, twice.
        assert _cli(settings, "deadletters", "redrive").returncode == 1  # nothing selected
        dry = _cli(settings, "deadletters", "redrive", "--reason", "too_many_open_episodes",
                   "--dry-run")
        assert dry.stdout.count("would re-drive") == 4
        proc = _cli(settings, "deadletters", "redrive", "--reason", "too_many_open_episodes")
        assert proc.returncode == 0 and proc.stdout.count("re-drove") == 4, proc.stderr
        again = _cli(settings, "deadletters", "redrive", "--reason", "too_many_open_episodes")
        assert again.returncode == 0 and "re-drove" not in again.stdout, again.stdout
        assert again.stdout.count("skipped") == 4  # already re-driven: not sent twice

        def ep2_events(values: list[bytes]) -> list[int]:
            seqs = []
            for v in values:
                seg = codec.decode(v).record
                if seg["header"]["episode"] == "ep-2":
                    seqs += [codec.decode(e).header["seq"] for e in seg["events"]]
            return seqs

        replay = topics.replay("web-shop")
        asyncio.run(consume_until(settings, replay, lambda vs: len(ep2_events(vs)) >= 4))
        asyncio.run(_caught_up(settings, f"{unique_name}.reorder", topics.sandbox_events))
        parts = asyncio.run(read_records(settings, [replay]))  # all of it, to its end
        values = [r.value for recs in parts.values() for r in recs]
        assert sorted(ep2_events(values)) == [0, 1, 2, 3]  # once each
        assert json.loads(_cli(settings, "deadletters", "--json").stdout)["total"] == 5
    finally:
        worker.stop()


async def _caught_up(settings: Settings, group: str, topic: str, timeout: float = 60) -> None:
    """Until ``group`` has committed every partition of ``topic`` up to its end."""
    consumer = AIOKafkaConsumer(bootstrap_servers=settings.kafka.bootstrap_servers)
    await consumer.start()
    try:
        tps = [TopicPartition(topic, p) for p in consumer.partitions_for_topic(topic) or []]
        if not tps:
            await consumer.topics()
            tps = [TopicPartition(topic, p) for p in consumer.partitions_for_topic(topic) or []]
        end = await consumer.end_offsets(tps)
    finally:
        await consumer.stop()
    deadline = time.monotonic() + timeout
    while True:
        done = await group_offsets(settings, group)
        if all(done.get(tp, 0) >= end[tp] for tp in tps):
            return
        assert time.monotonic() < deadline, f"{group} did not catch up with {topic}"
        await asyncio.sleep(0.2)  # polling a condition


# -- item 3: alerts, watchdog explain, replay explain -------------------------------------
def test_alerts_since_lists_what_happened_recently_with_why(
        kafka_broker: object, unique_name: str) -> None:
    settings = settings_for(kafka_broker.bootstrap, unique_name)  # type: ignore[attr-defined]
    topics = Topics(settings)
    now = int(time.time() * 1000)
    two_hours_ago, ten_min_ago = now - 7_200_000, now - 600_000

    def alert(sb: str, kind: m.AlertKind, ts: int) -> tuple[str, bytes, int]:
        a = m.WatchdogAlert(header=_hdr(sb, 40, ts, "ep-1", event_id=f"{sb}-{kind}"),
                            alert=kind, pattern=["browser_click:" + "7" * 64],
                            repeat_count=20, span_ms=139_782, first_seq=2, last_seq=40,
                            reason="1-call cycle repeated 20 times")
        return sb, a.encode(), ts

    def decision(sb: str, kind: m.DecisionKind, ts: int, reason: str
                 ) -> tuple[str, bytes, int]:
        d = m.SchedulingDecision(header=_hdr(sb, 1, ts, task="swe-bench",
                                             event_id=f"{sb}-{kind}"),
                                 decision=kind, reason=reason)
        return sb, d.encode(), ts

    async def setup() -> None:
        await ensure_base_topics(settings)
        await _produce_at(settings, topics.alerts, [
            alert("sb-old", m.AlertKind.LOOP, two_hours_ago),
            alert("sb-loop", m.AlertKind.LOOP, ten_min_ago)])
        await _produce_at(settings, topics.decisions, [
            decision("sb-old", m.DecisionKind.TERMINATE, two_hours_ago, "old"),
            decision("sb-loop", m.DecisionKind.TERMINATE, ten_min_ago, "watchdog loop"),
            decision("sb-gone", m.DecisionKind.RECLAIM, ten_min_ago, "2 missed heartbeats"),
            decision("sb-odd", m.DecisionKind.ANOMALY, ten_min_ago, "RECYCLED before DRAINING"),
            decision("sb-lost", m.DecisionKind.RECYCLE_WITH_LOSS, ten_min_ago,
                     "drain grace of 30000 ms passed with 3 events unflushed"),
            decision("sb-new", m.DecisionKind.PLACE, ten_min_ago, "best fit on n1")])

    asyncio.run(setup())
    proc = _cli(settings, "alerts", "--since", "1h")
    assert proc.returncode == 0, proc.stderr
    head, *lines = proc.stdout.splitlines()
    assert "1 loops, 0 loops ended, 0 stalls, 1 terminations (1 not acknowledged), " \
           "1 anomalies, 1 reclaims, 1 recycles with loss" in head
    assert len(lines) == 5 and not any("sb-old" in x or "PLACE" in x for x in lines)
    loop = next(line for line in lines if " LOOP " in line)
    assert "sb-loop/ep-1" in loop and "web-shop" in loop and "ago" in loop
    assert "browser_click repeated 20x over 2m 19s" in loop and "7" * 16 not in loop
    lost = next(line for line in lines if "RECYCLE_WITH_LOSS" in line)
    assert "sb-lost" in lost and "swe-bench" in lost and "30.0 s" in lost
    rows = _json_lines(_cli(settings, "alerts", "--since", "1h", "--json").stdout)
    assert sorted((r["what"], r["sandbox"]) for r in rows) == [
        ("ANOMALY", "sb-odd"), ("LOOP", "sb-loop"), ("RECLAIM", "sb-gone"),
        ("RECYCLE_WITH_LOSS", "sb-lost"), ("TERMINATE", "sb-loop")]

    rows = _json_lines(_cli(settings, "alerts", "--since", "3h", "--kind", "terminate",
                            "--json").stdout)
    assert [(r["sandbox"], r["what"]) for r in rows] == [("sb-old", "TERMINATE"),
                                                        ("sb-loop", "TERMINATE")]
    assert _cli(settings, "alerts", "--kind", "NOPE").returncode == 1


def test_alerts_show_each_termination_once_with_who_asked_who_acted_and_the_runtime(
        kafka_broker: object, unique_name: str) -> None:
    """The watchdog's TERMINATE asks, the scheduler's carries it out, the runtime answers with
    a DecisionAck: ``alerts`` shows one termination per sandbox, with each processor named by
    the record's producer, and whether the runtime did it."""
    settings = settings_for(kafka_broker.bootstrap, unique_name)  # type: ignore[attr-defined]
    topics = Topics(settings)
    t = int(time.time() * 1000) - 600_000

    def terminate(sb: str, by: str, ts: int, eid: str, episode: str | None = None
                  ) -> tuple[str, bytes, int]:
        h = _hdr(sb, 1, ts, episode, event_id=eid).model_copy(
            update={"producer_id": f"trajbus.{by}"})
        d = m.SchedulingDecision(header=h, decision=m.DecisionKind.TERMINATE,
                                 reason=f"{by} loop", suspicious=True)
        return sb, d.encode(), ts

    async def setup() -> None:
        await ensure_base_topics(settings)
        await _produce_at(settings, topics.decisions, [
            # sb-a: two loops in two episodes, acted on once, done by the runtime
            terminate("sb-a", "watchdog", t, "req-a1", "ep-1"),
            terminate("sb-a", "scheduler", t + 50, "dec-a"),
            terminate("sb-a", "watchdog", t + 900, "req-a2", "ep-2"),
            # sb-b: acted on, the runtime failed; sb-c: acted on, no answer yet
            terminate("sb-b", "watchdog", t + 1000, "req-b", "ep-1"),
            terminate("sb-b", "scheduler", t + 1050, "dec-b"),
            terminate("sb-c", "watchdog", t + 2000, "req-c", "ep-1"),
            terminate("sb-c", "scheduler", t + 2050, "dec-c"),
            # sb-d: requested, no scheduler acted (none running?)
            terminate("sb-d", "watchdog", t + 3000, "req-d", "ep-1")])
        await produce(settings, topics.sandbox_events, [
            ("sb-a", m.DecisionAck(header=_hdr("sb-a", 7, t + 2050), decision_event_id="dec-a",
                                   decision="TERMINATE", outcome=m.AckOutcome.DONE,
                                   detail="processes killed").encode()),
            ("sb-b", m.DecisionAck(header=_hdr("sb-b", 7, t + 3000), decision_event_id="dec-b",
                                   decision="TERMINATE", outcome=m.AckOutcome.FAILED,
                                   detail="kill refused").encode())])

    asyncio.run(setup())
    rows = _json_lines(_cli(settings, "alerts", "--since", "1h", "--kind", "TERMINATE",
                            "--json").stdout)
    got = {r["sandbox"]: (r["by"], r["requested_by"], r["request_ids"], r["status"])
           for r in rows}
    assert len(rows) == 4, rows
    assert got == {
        "sb-a": ("scheduler", ["watchdog"], ["req-a1", "req-a2"], "done"),
        "sb-b": ("scheduler", ["watchdog"], ["req-b"], "failed"),
        "sb-c": ("scheduler", ["watchdog"], ["req-c"], "not acknowledged"),
        "sb-d": ("watchdog", [], [], "requested"),
    }
    a = next(r for r in rows if r["sandbox"] == "sb-a")
    assert a["id"] == "dec-a" and a["episode"] == "ep-1" and a["ack_time_ms"] is not None
    proc = _cli(settings, "alerts", "--since", "1h", "--kind", "TERMINATE")
    head, *lines = proc.stdout.splitlines()
    assert "4 terminations (1 done, 1 failed, 1 not acknowledged, 1 requested)" in head
    line_a = next(x for x in lines if "sb-a" in x)
    assert "requested by watchdog, by scheduler, runtime: done after" in line_a
    assert "processes killed" in line_a


async def test_watchdog_explain_from_the_log_shows_the_moment_the_loop_fired(
        kafka_broker: object, unique_name: str) -> None:
    settings = settings_for(kafka_broker.bootstrap, unique_name)  # type: ignore[attr-defined]
    topics = Topics(settings)
    await ensure_base_topics(settings)
    sb, ep, t0 = "sb-stuck", "ep-1", int(time.time() * 1000) - 600_000
    events: list[m.Event] = [m.EpisodeStart(header=_hdr(sb, 0, t0, ep))]
    for i in range(25):  # the same click every 10 s, same result: a loop at the 20th
        events.append(m.ToolCall(header=_hdr(sb, 1 + 2 * i, t0 + 10_000 * i, ep),
                                 call_id=f"c{i}", tool="browser_click",
                                 args_hash="7" * 64, args_summary="#submit"))
        events.append(m.ToolResult(header=_hdr(sb, 2 + 2 * i, t0 + 10_000 * i + 500, ep),
                                   call_id=f"c{i}", tool="browser_click",
                                   status=m.ToolStatus.OK, result_hash="8" * 64))
    events.append(m.EpisodeEnd(header=_hdr(sb, 51, t0 + 260_000, ep),
                               outcome=m.EpisodeOutcome.TRUNCATED))
    await produce(settings, topics.sandbox_events, [(sb, e.encode()) for e in events])

    (story,) = await watchdog_history(settings, sb)
    loop = next(mo for mo in story.moments if mo.what == "LOOP")
    assert loop.decision == "TERMINATE"
    assert [e.seq for e in loop.evidence] == [1 + 2 * i for i in range(20)]  # 20 repeats
    assert loop.alert is not None and loop.alert["span_ms"] >= 120_000
    assert loop.explanation.loop_active  # the state at that moment, not the final one
    assert [mo.what for mo in story.moments][-2:] == ["episode end", "LOOP_ENDED"]
    assert story.verdict == f"LOOP fired at seq {loop.seq}"

    proc = _cli(settings, "watchdog", "explain", "--sandbox", sb, "--from-log")
    assert proc.returncode == 0, proc.stderr
    assert f"seq {loop.seq}" in proc.stdout and "LOOP fired: browser_click repeated 20x" \
        in proc.stdout and "-> TERMINATE requested" in proc.stdout
    assert "evidence: 20 calls" in proc.stdout and "-> fired" in proc.stdout
    assert not re.search(r"[0-9a-f]{16}", proc.stdout)  # no 64-hex hashes


def _derived(label: str, eid: str, written: int, causes: list[str]) -> DerivedRecord:
    record = {"header": {"event_id": eid, "sandbox": "sb", "event_time_ms": written,
                         "producer_id": "trajbus.scheduler"},
              "cause_event_ids": causes}
    return DerivedRecord(eid, "SchedulingDecision", label, written, f"{label} because",
                         "trajbus.scheduler", record, log_time_ms=written)


def test_replay_explain_lists_causes_before_effects_with_human_times_and_short_ids() -> None:
    loop_id, term_id, drain_id = ("a" * 32, "b" * 32, "c" * 32)
    # the watchdog's TERMINATE cites its LOOP alert; written in the same millisecond, and
    # the drain cites the terminate: whatever the order they come in, causes come first
    items = [ExplainedItem(_derived("DRAIN", drain_id, 1_000, [term_id]), "reproduced", ()),
             ExplainedItem(_derived("TERMINATE", term_id, 1_000, [loop_id]), "reproduced", ()),
             ExplainedItem(_derived("LOOP", loop_id, 1_000, []), "reproduced", ())]
    ordered = causal_order(items)
    assert [it.derived.label for it in ordered] == ["LOOP", "TERMINATE", "DRAIN"]
    text = Explanation("sb", ordered, [], [], ["scheduler"], {}).render()
    assert "00:00:01.000  LOOP by scheduler [reproduced]  id aaaaaaaa" in text
    assert "b" * 9 not in text and "1970-01-01" in text


# -- item 4: status ----------------------------------------------------------------------------
def test_status_shows_live_members_and_lag_without_transaction_markers(
        kafka_broker: object, unique_name: str) -> None:
    settings = settings_for(kafka_broker.bootstrap, unique_name)  # type: ignore[attr-defined]
    topics = Topics(settings)
    eps = make_episodes(4, seed=41, task="web-shop")
    node = m.NodeReport(header=_hdr("_node", 0, int(time.time() * 1000), event_id="n1-0"),
                        node="n1", cpu_total=16, cpu_free=12.5, memory_total_mb=65536,
                        memory_free_mb=32768)

    async def setup() -> None:
        await ensure_base_topics(settings, ["web-shop"])
        await produce(settings, topics.sandbox_events,
                      [(e.sandbox, v) for e in eps for v in e.events])
        await produce(settings, topics.nodes, [("n1", node.encode())])

    asyncio.run(setup())
    worker = Worker(settings, "reorder,watchdog,scheduler", worker_id="w7").start()
    try:
        replay = topics.replay("web-shop")
        asyncio.run(consume_until(settings, replay, lambda vs: len(vs) >= 4))
        asyncio.run(_caught_up(settings, f"{unique_name}.watchdog", replay))
        st = json.loads(_cli(settings, "status", "--json").stdout)
        for name in ("reorder", "watchdog", "scheduler"):
            (member,) = st["processors"][name]["members"]
            assert member["client_id"] == f"{unique_name}.{name}-w7"
        assert sorted(st["processors"]["reorder"]["members"][0]["partitions"]) == sorted(
            topics.input_topics)
        text = _cli(settings, "status").stdout
        assert "1 live member" in text and "reorder-w7 on " in text
    finally:
        assert worker.stop() == 0

    # the worker is gone: no live member, and nothing left to process
    st = json.loads(_cli(settings, "status", "--json").stdout)
    assert all(st["processors"][n]["members"] == [] for n in ("reorder", "watchdog"))
    assert st["processors"]["watchdog"]["lag"][replay] == 0
    text = _cli(settings, "status").stdout
    assert "NO LIVE MEMBER: no worker runs it" in text

    sched = _cli(settings, "scheduler", "status")
    assert sched.returncode == 0, sched.stderr
    assert "free: 12.5 of 16 CPUs, 32.0 GiB of 64.0 GiB" in sched.stdout
    assert not re.search(r"\b1\d{12}\b", sched.stdout)  # no raw epoch milliseconds


def test_lag_counts_records_not_the_transaction_markers_between_them(
        kafka_broker: object, unique_name: str) -> None:
    """A processor reading a transactional topic commits the offset after the last record it
    processed; the commit marker that follows occupies an offset too. Lag is records."""
    from aiokafka.structs import OffsetAndMetadata

    settings = settings_for(kafka_broker.bootstrap, unique_name)  # type: ignore[attr-defined]
    topics = Topics(settings)
    replay = topics.replay("web-shop")
    tp = TopicPartition(replay, 0)
    segment = make_episodes(1, seed=51, task="web-shop")[0].events[0]

    async def write_and_commit(upto: int) -> None:
        await ensure_base_topics(settings, ["web-shop"])
        producer = AIOKafkaProducer(bootstrap_servers=settings.kafka.bootstrap_servers,
                                    transactional_id=f"{unique_name}-txn")
        await producer.start()
        try:
            for n in (3, 2):  # offsets 0-2, marker 3; 4-5, marker 6
                async with producer.transaction():
                    for _ in range(n):
                        await producer.send(replay, segment, partition=0)
        finally:
            await producer.stop()
        group = AIOKafkaConsumer(bootstrap_servers=settings.kafka.bootstrap_servers,
                                 group_id=f"{unique_name}.watchdog", enable_auto_commit=False)
        await group.start()
        try:
            group.assign([tp])
            await group.commit({tp: OffsetAndMetadata(upto, "")})
        finally:
            await group.stop()

    asyncio.run(write_and_commit(6))  # processed every record: offset 6 is a marker
    st = json.loads(_cli(settings, "status", "--json").stdout)
    assert st["processors"]["watchdog"]["lag"][replay] == 0
    asyncio.run(write_and_commit(3))  # processed the first transaction only
    st = json.loads(_cli(settings, "status", "--json").stdout)
    # the second write added 5 more records (offsets 7-9, 11-12): 2 + 5 unprocessed records
    assert st["processors"]["watchdog"]["lag"][replay] == 7


def test_the_readme_operator_section_shows_valid_commands_of_each_kind() -> None:
    """Every ``$ trajbus ...`` line shown in the operators' section parses as a command (the
    outputs next to them are real; this keeps the command lines in step with the CLI)."""
    import shlex

    from readme_support import readme_section

    from trajbus.cli import build_parser, join_relative_times

    section, _ = readme_section("For operators")
    shown = [line[2:] for line in section.splitlines() if line.startswith("$ trajbus ")]
    parser = build_parser()
    for line in shown:
        args = parser.parse_args(join_relative_times(shlex.split(line)[1:]))
        assert getattr(args, "func", None) is not None, line
    commands = " | ".join(shown)
    for command in ("trajbus status", "trajbus alerts --since", "trajbus replay explain",
                    "trajbus watchdog explain", "trajbus consume", "trajbus deadletters",
                    "trajbus deadletters show", "trajbus deadletters redrive"):
        assert command in commands, command
