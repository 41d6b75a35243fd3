"""Operators' tools against a real broker: the sandbox timeline, `explain` reproducing a
scheduler worker's recorded decisions (and catching a planted one), republishing an episode
into a trainer's ReplayClient, and the CLI wiring."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
from aiokafka import TopicPartition
from support import Worker, consume_until, env_for, make_episodes, produce, settings_for

from trajbus.bus.admin import ensure_topics
from trajbus.bus.settings import SchedulerSettings, Settings
from trajbus.bus.topics import Topics
from trajbus.consumers.operator.tools import (
    debug_replay_task,
    explain,
    group_offsets,
    read_sandbox_log,
    republish,
    restore_scheduler,
    watchdog_explain,
)
from trajbus.consumers.replay.client import ReplayClient
from trajbus.schemas import models as m
from trajbus.schemas.codec import default_codec

pytestmark = [pytest.mark.kafka, pytest.mark.timeout(180)]


def _hdr(sandbox: str, seq: int, t: int, episode: str | None = None, task: str = "web",
         event_id: str | None = None) -> m.Envelope:
    return m.Envelope(event_id=event_id or f"{sandbox}-{episode}-{seq}", task=task,
                      sandbox=sandbox, episode=episode, seq=seq, event_time_ms=t,
                      producer_id="test")


def _sandbox_story(sandbox: str, t0: int) -> tuple[list[m.Event], list[m.Event]]:
    """(sandbox events, trace chunks) of one sandbox: lifecycle + one episode."""
    ep = "ep-1"
    events: list[m.Event] = [
        m.SandboxLifecycle(header=_hdr(sandbox, 0, t0), state=m.LifecycleState.PROVISIONING,
                           node="n1", tenant="acme"),
        m.SandboxLifecycle(header=_hdr(sandbox, 1, t0 + 100), state=m.LifecycleState.ACTIVE,
                           previous_state=m.LifecycleState.PROVISIONING, node="n1"),
        m.EpisodeStart(header=_hdr(sandbox, 0, t0 + 200, ep), tenant="acme"),
        m.ToolCall(header=_hdr(sandbox, 1, t0 + 300, ep), call_id="c1", tool="exec",
                   args_hash="a" * 64, args_summary="ls -la"),
        m.ToolResult(header=_hdr(sandbox, 2, t0 + 900, ep), call_id="c1", tool="exec",
                     status=m.ToolStatus.OK, result_hash="b" * 64, duration_ms=600,
                     result_summary="12 files"),
        m.EpisodeEnd(header=_hdr(sandbox, 4, t0 + 1500, ep), outcome=m.EpisodeOutcome.TERMINAL,
                     reward=1.0),
        m.Heartbeat(header=_hdr(sandbox, 2, t0 + 1600)),
    ]
    chunks: list[m.Event] = [
        m.TraceChunk(header=_hdr(sandbox, 3, t0 + 1000, ep), file_offset=0, length=11,
                     sha256="f" * 64, data=b"hello trace", content_type="text/plain"),
    ]
    return events, chunks


async def test_timeline_from_kafka_and_from_the_archive_is_the_produced_events_in_order(
        kafka_broker: object, unique_name: str, tmp_path: Path) -> None:
    settings = settings_for(kafka_broker.bootstrap, unique_name)  # type: ignore[attr-defined]
    topics = Topics(settings)
    await ensure_topics(settings, topics.specs)
    t0 = int(time.time() * 1000)
    events, chunks = _sandbox_story("sb-a", t0)
    other, _ = _sandbox_story("sb-b", t0)
    # out of order, with an exact duplicate, interleaved with another sandbox
    sandbox_items = [(e.header.sandbox, e.encode()) for e in
                     [events[3], events[0], other[0], events[5], events[2], events[1],
                      events[4], events[4], other[1], events[6]]]
    await produce(settings, topics.sandbox_events, sandbox_items)
    await produce(settings, topics.trace_chunks, [("sb-a", c.encode()) for c in chunks])

    timeline = await read_sandbox_log(settings, "sb-a")
    expected = [events[0], events[1], events[6],  # sandbox-level, by time
                events[2], events[3], events[4], chunks[0], events[5]]  # the episode, by seq
    assert [e.event_id for e in timeline] == [e.header.event_id for e in expected]
    assert [e.record for e in timeline] == [default_codec().decode(e.encode()).record
                                           for e in expected]
    summaries = [e.summary for e in timeline]
    assert summaries[0] == "lifecycle PROVISIONING on n1 (tenant acme)"
    assert summaries[4] == "call c1: exec(ls -la)"
    assert summaries[5] == "result c1: exec OK in 600 ms: 12 files"
    assert summaries[6] == f"trace 11 bytes at offset 0 (sha {'f' * 12})"
    assert timeline[6].text() == "hello trace"
    assert "hello trace" in timeline[6].line(expand=True)
    json.dumps([e.to_dict(expand=True) for e in timeline])  # JSON-ready

    only_ep = await read_sandbox_log(settings, "sb-a", episode="ep-1",
                                     from_ms=t0 + 250, to_ms=t0 + 1000)
    assert [e.seq for e in only_ep] == [1, 2, 3]

    (why,) = await watchdog_explain(settings, "sb-a", from_log=True)
    assert (why.episode, why.calls_seen, why.verdict) == ("ep-1", 1, "no loop")

    # The same timeline from the Parquet archive (after the archiver caught up).
    from trajbus.archive.archiver import run_archiver
    from trajbus.bus.settings import ArchiveSettings

    archived = settings.model_copy(update={"archive": ArchiveSettings(
        url=str(tmp_path / "archive"), spool_dir=str(tmp_path / "spool"))})
    await run_archiver(archived, until_idle=True)
    from_archive = await read_sandbox_log(archived, "sb-a", source="archive")
    assert [(e.event_id, e.kind, e.episode, e.seq, e.summary) for e in from_archive] == \
        [(e.event_id, e.kind, e.episode, e.seq, e.summary) for e in timeline]


def _decisions(values: list[bytes], sandbox: str) -> list[dict[str, object]]:
    codec = default_codec()
    out = []
    for v in values:
        d = codec.decode(v)
        if d.kind == "SchedulingDecision" and d.header["sandbox"] == sandbox:
            out.append(d.record)
    return out


async def _wait_processed(settings: Settings, group: str, tp: TopicPartition, offset: int,
                          timeout: float = 60) -> None:
    """Until ``group`` has committed ``tp`` at or beyond ``offset``."""
    deadline = time.monotonic() + timeout
    while (await group_offsets(settings, group)).get(tp, -1) < offset:
        if time.monotonic() > deadline:
            raise TimeoutError(f"{group} did not process {tp} up to {offset}")
        await asyncio.sleep(0.2)  # polling a condition, not waiting for time to pass


async def test_explain_reproduces_a_scheduler_run_and_flags_a_planted_decision(
        kafka_broker: object, unique_name: str) -> None:
    sched = SchedulerSettings(lease_ttl_ms=3000, heartbeat_interval_ms=1000,
                              drain_grace_ms=1000, node_stale_ms=600_000, tick_interval_ms=500)
    settings = settings_for(kafka_broker.bootstrap, unique_name,  # type: ignore[attr-defined]
                            scheduler=sched)
    env = {"TRAJBUS_SCHEDULER__LEASE_TTL_MS": "3000",
           "TRAJBUS_SCHEDULER__HEARTBEAT_INTERVAL_MS": "1000",
           "TRAJBUS_SCHEDULER__DRAIN_GRACE_MS": "1000",
           "TRAJBUS_SCHEDULER__NODE_STALE_MS": "600000"}
    topics = Topics(settings)
    await ensure_topics(settings, topics.specs)
    sb = "sb-lost"
    now = int(time.time() * 1000)
    node = m.NodeReport(header=_hdr("_node", 0, now, event_id="node-0"), node="n1",
                        cpu_total=16, cpu_free=16, memory_total_mb=65536,
                        memory_free_mb=65536)
    await produce(settings, topics.nodes, [("n1", node.encode())])
    worker = Worker(settings, "scheduler", until_idle=8, extra_env=env).start()
    try:
        # The scheduler merges its input topics by record timestamp, so the live order is
        # the order written here (and the order `explain` re-creates). The short lease runs
        # from the request's log time: wait until the worker is up (it processed the node
        # report) before the story starts.
        await _wait_processed(settings, f"{unique_name}.scheduler",
                              TopicPartition(topics.nodes, 0), 1)
        request = m.SandboxRequest(header=_hdr(sb, 0, int(time.time() * 1000),
                                               event_id="req-0"),
                                   request_id="r1", tenant="acme", cpu=2, memory_mb=1024,
                                   ttl_ms=3000)
        await produce(settings, topics.control, [("acme", request.encode())])
        await consume_until(settings, topics.decisions,
                            lambda vs: any(d["decision"] == "PLACE" for d in _decisions(vs, sb)))
        t = int(time.time() * 1000)
        story = [
            m.SandboxLifecycle(header=_hdr(sb, 0, t, event_id="lc-0"),
                               state=m.LifecycleState.PROVISIONING, node="n1", tenant="acme"),
            m.SandboxLifecycle(header=_hdr(sb, 1, t + 10, event_id="lc-1"),
                               state=m.LifecycleState.ACTIVE,
                               previous_state=m.LifecycleState.PROVISIONING, node="n1"),
            m.Heartbeat(header=_hdr(sb, 2, t + 20, event_id="hb-0"), lease_ttl_ms=3000),
        ]  # ... and then silence: two missed heartbeats -> RECLAIM, grace -> RECYCLE
        await produce(settings, topics.sandbox_events, [(sb, e.encode()) for e in story])
        values = await consume_until(
            settings, topics.decisions,
            lambda vs: any(str(d["decision"]).startswith("RECYCLE") for d in _decisions(vs, sb)))
        assert worker.wait(timeout=60) == 0
    finally:
        worker.stop()
    recorded = _decisions(values, sb)
    kinds = [d["decision"] for d in recorded]
    assert kinds[0] == "PLACE" and "RECLAIM" in kinds

    result = await explain(settings, sb)
    assert result.consistent, result.render()
    assert [i.derived.label for i in result.items] == kinds
    assert {i.status for i in result.items} == {"reproduced"}
    reclaim = next(i for i in result.items if i.derived.label == "RECLAIM")
    assert "hb-0" in [c.event_id for c in reclaim.causes]  # the last heartbeat it saw
    place = result.items[0]
    assert "req-0" in [c.event_id for c in place.causes]
    assert any("watchdog" in n for n in result.notes) or "watchdog" in result.processors

    print(result.render())
    core = await restore_scheduler(settings)  # what `trajbus scheduler status` shows
    st = core.status()
    assert st["sandboxes_by_state"]["RECYCLED"] == 1 and st["nodes_by_headroom"][0]["node"] == "n1"

    planted = m.SchedulingDecision(
        header=_hdr(sb, 99, t + 50, task="web", event_id=uuid.uuid4().hex),
        decision=m.DecisionKind.TERMINATE, reason="planted by the test")
    await produce(settings, topics.decisions, [(sb, planted.encode())])
    result = await explain(settings, sb)
    assert not result.consistent
    assert [(d.kind, d.event_id) for d in result.divergences] == [
        ("recorded_not_reproduced", planted.header.event_id)]
    assert "planted by the test" in result.render()
    json.dumps(result.to_dict())


async def test_republished_episode_reaches_a_replay_client(
        kafka_broker: object, unique_name: str) -> None:
    settings = settings_for(kafka_broker.bootstrap, unique_name)  # type: ignore[attr-defined]
    topics = Topics(settings)
    await ensure_topics(settings, topics.specs)
    eps = make_episodes(3, seed=5, task="swe", steps=8)
    ep = eps[1]
    items = [(e.sandbox, v) for e in eps for v in reversed(e.events)]  # arrival out of order
    await produce(settings, topics.sandbox_events, items + items[:3])  # and some duplicates

    r = await republish(settings, "swe", ep.sandbox, ep.episode)
    assert r.topic == topics.replay("debug-swe") and r.events == ep.n and r.is_last
    assert (r.first_seq, r.last_seq, r.gaps) == (0, ep.n - 1, ())

    async with ReplayClient([debug_replay_task("swe")], f"{unique_name}-trainer",
                            settings) as client:
        got = []
        async for episode in client.episodes(idle_timeout=3):
            got.append(episode)
            await client.ack(episode)
    assert len(got) == 1
    assert (got[0].sandbox, got[0].episode, got[0].is_terminal) == (ep.sandbox, ep.episode,
                                                                    True)
    codec = default_codec()
    assert [e.record for e in got[0].events] == [codec.decode(v).record for v in ep.events]


def test_cli_help_and_events_command(kafka_broker: object, unique_name: str) -> None:
    """The commands parse, document themselves and run against the broker (in a subprocess,
    as an operator would, with a parser carrying just these commands)."""
    settings = settings_for(kafka_broker.bootstrap, unique_name)  # type: ignore[attr-defined]
    script = (
        "import argparse, sys\n"
        "from trajbus.consumers.operator import cli as operator_cli\n"
        "p = argparse.ArgumentParser(prog='trajbus')\n"
        "sub = p.add_subparsers()\n"
        "operator_cli.register(sub)\n"
        "r = sub.add_parser('replay')\n"
        "operator_cli.register_replay(r.add_subparsers())\n"
        "a = p.parse_args(sys.argv[1:])\n"
        "sys.exit(a.func(a))\n"
    )

    def run(*argv: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-c", script, *argv], env=env_for(settings),
                              capture_output=True, text=True, timeout=90, check=False)

    for argv in (["replay", "events", "--help"], ["replay", "explain", "--help"],
                 ["replay", "republish", "--help"], ["replay", "waterfall", "--help"],
                 ["status", "--help"], ["scheduler", "status", "--help"],
                 ["watchdog", "explain", "--help"]):
        proc = run(*argv)
        assert proc.returncode == 0 and "usage:" in proc.stdout, (argv, proc.stderr)
    assert "debug-TASK" in run("replay", "republish", "--help").stdout

    async def setup() -> None:
        await ensure_topics(settings, Topics(settings).specs)
        events, _ = _sandbox_story("sb-cli", int(time.time() * 1000))
        await produce(settings, Topics(settings).sandbox_events,
                      [("sb-cli", e.encode()) for e in events])

    asyncio.run(setup())
    proc = run("replay", "events", "--sandbox", "sb-cli", "--json")
    assert proc.returncode == 0, proc.stderr
    lines = [json.loads(x) for x in proc.stdout.splitlines()]
    assert [x["kind"] for x in lines] == ["SandboxLifecycle", "SandboxLifecycle", "Heartbeat",
                                          "EpisodeStart", "ToolCall", "ToolResult",
                                          "EpisodeEnd"]
    proc = run("status", "--json")
    assert proc.returncode == 0, proc.stderr
    st = json.loads(proc.stdout)
    assert st["dead_letters"] == 0 and "scheduler" in st["processors"]
    proc = run("scheduler", "status", "--json")
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["sandboxes_by_state"]["ACTIVE"] == 0
