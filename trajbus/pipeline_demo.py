"""The whole pipeline, end to end, for `trajbus demo` (and the end-to-end test).

fleet simulator -> Kafka -> worker process (reorder, watchdog, scheduler) -> replay topics ->
trainer (ReplayClient);  Kafka -> archiver -> Parquet (.trajbus/archive) -> DuckDB.

The summary is a check, not a report: it compares every episode the trainer received with the
(seq, event id) pairs the emitters had acknowledged, the watchdog's alerts with the episodes
the simulator made loop, and exits non-zero on any difference.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from aiokafka import AIOKafkaConsumer

from trajbus.bus.kafka import connection_options
from trajbus.bus.settings import Settings
from trajbus.bus.topics import Topics
from trajbus.schemas.codec import DecodeError, default_codec

TASKS = ["swe-bench", "web-shop", "math-proofs"]


@dataclass
class View:
    """What the downstream consumers saw, updated live."""

    episodes: dict[tuple[str, str], list[tuple[int, str]]] = field(default_factory=dict)
    open: dict[tuple[str, str], list[tuple[int, str]]] = field(default_factory=dict)
    truncated: set[tuple[str, str]] = field(default_factory=set)
    gappy: set[tuple[str, str]] = field(default_factory=set)
    kinds: Counter[str] = field(default_factory=Counter)
    first_segment_s: float | None = None
    alerts: Counter[str] = field(default_factory=Counter)
    loop_alerts: set[tuple[str, str | None]] = field(default_factory=set)
    decisions: Counter[str] = field(default_factory=Counter)
    dead_letters: Counter[str] = field(default_factory=Counter)
    sample: tuple[str, str] | None = None  # one finished episode, for the waterfall


async def run_pipeline(settings: Settings, sandboxes: int, episodes: int, seed: int, *,
                       work_root: Path = Path(".trajbus/demo"),
                       settle_timeout_s: float = 90) -> int:
    """Run the pipeline once and check it. Returns 0 when every check passed."""
    from trajbus.bus.admin import ensure_base_topics, register_schemas
    from trajbus.bus.producer import close_producer
    from trajbus.producers.simulator import simulate

    work = work_root / str(seed)
    work.mkdir(parents=True, exist_ok=True)
    topics = Topics(settings)
    await ensure_base_topics(settings, TASKS)
    await register_schemas(settings)
    _say(f"seed {seed}: {sandboxes} sandboxes x {episodes} episodes over tasks "
         f"{', '.join(TASKS)}; work dir {work}")

    worker_log = work / "worker.log"
    worker = _start_worker(settings, worker_log)
    _say(f"worker process pid {worker.pid} (reorder, watchdog, scheduler); log {worker_log}")
    view = View()
    started = time.monotonic()
    stop = asyncio.Event()
    watchers = [
        asyncio.create_task(_trainer(settings, seed, view, started, stop)),
        asyncio.create_task(_watch(settings, [topics.alerts, topics.decisions,
                                              topics.deadletter], view, stop)),
    ]
    live = asyncio.create_task(_live(view, started, stop))
    try:
        manifest = await simulate(
            settings, sandboxes=sandboxes, episodes=episodes, seed=seed,
            manifest_path=work / "manifest.json", state_root=work / "sandboxes",
            start_ms=int(time.time() * 1000), shuffle_window=4, tasks=TASKS,
            node_report_every_s=0.5,
        )
        await close_producer()
        expected = {(e.task, e.sandbox, e.episode): e for e in manifest.episodes}
        _say(f"fleet done: {manifest.events_acked} events acknowledged, "
             f"{manifest.duplicates_sent} duplicates re-sent, {len(manifest.loops)} looping "
             f"episodes planted")
        # The trainer has everything when every acknowledged episode arrived (recycled
        # sandboxes' unfinished episodes arrive truncated after the recycle grace).
        deadline = time.monotonic() + settle_timeout_s
        while time.monotonic() < deadline:
            if all((s, ep) in view.episodes for (_, s, ep) in expected) and \
                    len(view.loop_alerts) >= len(manifest.loops):
                break
            await asyncio.sleep(0.5)
    finally:
        stop.set()
        for t in [*watchers, live]:
            t.cancel()
        await asyncio.gather(*watchers, live, return_exceptions=True)
        worker.terminate()
        try:
            worker.wait(timeout=30)
        except subprocess.TimeoutExpired:
            worker.kill()
    print(file=sys.stderr)

    archive_summary = await _archive(settings)
    waterfall = await _waterfall(settings, view, work)
    return _summary(expected, manifest, view, archive_summary, waterfall,
                    time.monotonic() - started)


def _start_worker(settings: Settings, log_path: Path) -> subprocess.Popen[bytes]:
    env = dict(os.environ)
    env["TRAJBUS_KAFKA__BOOTSTRAP_SERVERS"] = settings.kafka.bootstrap_servers
    env["TRAJBUS_TOPICS__PREFIX"] = settings.topics.prefix
    env["TRAJBUS_TOPICS__PARTITIONS"] = str(settings.topics.partitions)
    out = open(log_path, "ab")
    return subprocess.Popen(
        [sys.executable, "-m", "trajbus", "worker", "--worker-id", "demo", "-v"],
        env=env, stdout=out, stderr=out)


async def _trainer(settings: Settings, seed: int, view: View, started: float,
                   stop: asyncio.Event) -> None:
    from trajbus.consumers.replay_client import ReplayClient

    async with ReplayClient(TASKS, f"demo-trainer-{seed}", settings) as client:
        prefix = f"sb-{seed}-"
        async for seg in client.segments():
            key = (seg.sandbox, seg.episode)
            if seg.sandbox.startswith(prefix):
                if view.first_segment_s is None:
                    view.first_segment_s = time.monotonic() - started
                events = view.open.setdefault(key, [])
                for ev in seg.events:
                    h = ev.record["header"]
                    events.append((h["seq"], h["event_id"]))
                    view.kinds[ev.kind] += 1
                if seg.gap:
                    view.gappy.add(key)
                if seg.is_last:
                    view.episodes[key] = view.open.pop(key)
                    if not seg.is_terminal:
                        view.truncated.add(key)
                    elif view.sample is None and len(events) > 8:
                        view.sample = key
            await client.ack(seg)
            if stop.is_set():
                return


async def _watch(settings: Settings, topics: list[str], view: View, stop: asyncio.Event) -> None:
    codec = default_codec()
    # Read from the beginning and keep this run's records (by log time): "latest" would miss
    # what the worker wrote before this consumer was assigned its partitions.
    since_ms = int(time.time() * 1000)
    consumer = AIOKafkaConsumer(*topics, **connection_options(settings.kafka),
                                auto_offset_reset="earliest", isolation_level="read_committed",
                                enable_auto_commit=False, group_id=None)
    await consumer.start()
    try:
        while not stop.is_set():
            batch = await consumer.getmany(timeout_ms=300)
            for msgs in batch.values():
                for msg in msgs:
                    if msg.timestamp < since_ms:
                        continue
                    try:
                        d = codec.decode(msg.value)
                    except DecodeError:
                        continue
                    r = d.record
                    if d.kind == "WatchdogAlert":
                        view.alerts[r["alert"]] += 1
                        if r["alert"] == "LOOP":
                            view.loop_alerts.add((r["header"]["sandbox"], r["header"]["episode"]))
                    elif d.kind == "SchedulingDecision":
                        view.decisions[r["decision"]] += 1
                    elif d.kind == "DeadLetter":
                        view.dead_letters[f"{r['stage']}:{r['reason_code']}"] += 1
    finally:
        await consumer.stop()


async def _live(view: View, started: float, stop: asyncio.Event) -> None:
    while not stop.is_set():
        await asyncio.sleep(1)
        decisions = " ".join(f"{k.lower()}={v}" for k, v in sorted(view.decisions.items()))
        line = (f"\r[demo] {time.monotonic() - started:5.1f}s  trainer: "
                f"{len(view.episodes)} episodes, {sum(view.kinds.values())} events | "
                f"alerts: {sum(view.alerts.values())} | decisions: {decisions or '-'} | "
                f"dead letters: {sum(view.dead_letters.values())}")
        print(line[:160].ljust(160), end="", file=sys.stderr, flush=True)


async def _archive(settings: Settings) -> dict[str, Any]:
    from trajbus.archive.archiver import run_archiver

    _say("archiving the raw topics to Parquet (until caught up)...")
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
    except Exception as exc:  # the summary says what failed; the check below still runs
        summary["error"] = f"{type(exc).__name__}: {exc}"
    return summary


async def _waterfall(settings: Settings, view: View, work: Path) -> Path | None:
    """A step-time waterfall report of one finished episode (operators' tool)."""
    if view.sample is None:
        return None
    sandbox, episode = view.sample
    try:
        from trajbus.consumers import operator, waterfall

        entries = await operator.read_sandbox_log(settings, sandbox, episode)
        out = work / f"waterfall-{sandbox}-{episode}.html"
        out.write_text(waterfall.render_html(entries))
        return out
    except Exception as exc:  # a report problem must not fail the pipeline check
        _say(f"waterfall report skipped: {type(exc).__name__}: {exc}")
        return None


def _summary(expected: dict[tuple[str, str, str], Any], manifest: Any, view: View,
             archive: dict[str, Any], waterfall: Path | None, elapsed: float) -> int:
    problems: list[str] = []
    exact = truncated_ok = 0
    for (_task, sandbox, episode), rec in sorted(expected.items()):
        got = view.episodes.get((sandbox, episode))
        want = sorted((seq, eid) for seq, eid in rec.acked)
        if got is None:
            problems.append(f"{sandbox}/{episode}: never reached the trainer")
        elif got == want:
            exact += 1
            if (sandbox, episode) in view.truncated:
                truncated_ok += 1
        else:
            missing = sorted(set(want) - set(got))[:3]
            extra = sorted(set(got) - set(want))[:3]
            problems.append(f"{sandbox}/{episode}: {len(got)} events vs {len(want)} "
                            f"acknowledged (missing {missing}, unexpected {extra})")
    planted = {(e.sandbox, e.episode) for e in manifest.loops}
    caught = {(s, ep) for s, ep in view.loop_alerts if ep is not None}
    missed = planted - caught
    false_alarms = caught - planted
    for s, ep in sorted(missed):
        problems.append(f"looping episode {s}/{ep} was not caught")
    for s, ep in sorted(false_alarms):
        behaviour = next((e.behaviour for e in manifest.episodes
                          if (e.sandbox, e.episode) == (s, ep)), "?")
        problems.append(f"false loop alert on {s}/{ep} ({behaviour})")

    print("\n=== trajbus demo summary ===")
    print(f"elapsed: {elapsed:.1f}s; first replay segment reached the trainer after "
          f"{view.first_segment_s or float('nan'):.2f}s")
    print(f"trainer view: {exact}/{len(expected)} episodes exactly equal to what the emitters "
          f"acknowledged (in order, no duplicates); {len(view.truncated)} truncated "
          f"(crashed/recycled), {len(view.gappy)} with gap markers")
    print("events by kind at the trainer: " +
          ", ".join(f"{k}={v}" for k, v in view.kinds.most_common()))
    nonloops = sum(1 for e in manifest.episodes if e.behaviour == "nonloop")
    print(f"watchdog: {len(caught & planted)}/{len(planted)} planted loops caught, "
          f"{len(false_alarms)} false alarms ({nonloops} look-alike non-loops left alone); "
          f"alerts {dict(view.alerts)}")
    print(f"scheduler decisions: {dict(view.decisions)}")
    print(f"dead letters: {dict(view.dead_letters) or 'none'}")
    stats = archive.get("stats")
    print(f"archive: {archive.get('url')} ({archive.get('seconds', 0):.1f}s; {stats})")
    if "rows" in archive:
        print(f"  sample query: trajbus archive sql \"{archive['query']}\"")
        for row in archive["rows"]:
            print("   ", " | ".join(str(c) for c in row))
    elif "error" in archive:
        problems.append(f"archive query failed: {archive['error']}")
    if waterfall:
        print(f"step-time waterfall of one episode: {waterfall}")
    if problems:
        print(f"\nPROBLEMS ({len(problems)}):")
        for p in problems[:30]:
            print(f"  - {p}")
        return 1
    print("\nOK: every acknowledged event reached the trainer once, in order; every planted "
          "loop was caught and nothing else was flagged.")
    return 0


def _say(msg: str) -> None:
    print(f"[demo] {msg}", file=sys.stderr, flush=True)
