"""The whole pipeline, end to end, for `trajbus demo` (and the end-to-end test).

fleet simulator -> Kafka -> worker process (reorder, watchdog, scheduler) -> replay topics ->
trainer (ReplayClient);  Kafka -> archiver -> Parquet (.trajbus/archive) -> DuckDB.

The summary is a check, not a report. It fails (non-zero) unless:

- every episode the trainer received equals the (seq, event id) pairs the emitters had
  acknowledged, in order, once;
- the replay topics themselves (read raw, before any client-side deduplication) hold every
  acknowledged event exactly once, and carry gap markers only where an acknowledged seq is
  really missing (a crash);
- the watchdog alerted on exactly the episodes the simulator made loop;
- every sandbox's lifecycle completed: a DRAIN (or the TERMINATE that starts a looping
  sandbox's drain) and then one RECYCLE decision each (RECYCLE_WITH_LOSS only for a sandbox
  the simulator crashed on purpose, or where the log shows injected faults held downstream's
  confirmation back past the drain grace window: see :func:`_unexplained_loss`);
- there are no dead letters and no ANOMALY decisions (the simulated fleet is clean: the faults
  it plants -- crashes, migrations, re-sent duplicates, out-of-order delivery -- must all be
  absorbed);
- the archive holds every acknowledged event (episodes and sandbox-level streams) once.

:func:`run_pipeline` uses the settings it is given (topic prefix, archive location): callers
isolate runs by giving each its own prefix (``trajbus demo`` does, per run). ``faults`` adds
what the soak (``make soak``) needs: the worker SIGKILLed and restarted mid-run, the broker
restarted mid-run.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from aiokafka import TopicPartition

from trajbus.bus.clients import new_consumer
from trajbus.bus.closing import close_client
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
    by_sandbox: dict[str, list[str]] = field(default_factory=dict)  # decisions, in order
    # details of each RECYCLE_WITH_LOSS, by sandbox (what was lost, when the grace window ended)
    loss_details: dict[str, dict[str, str]] = field(default_factory=dict)
    anomalies: list[str] = field(default_factory=list)
    dead_letters: Counter[str] = field(default_factory=Counter)
    dead_letter_examples: list[str] = field(default_factory=list)
    sample: tuple[str, str] | None = None  # one finished episode, for the waterfall
    # the readers (trainer, watcher) that stopped before the run ended, and why
    reader_failures: list[str] = field(default_factory=list)


@dataclass
class Faults:
    """Faults injected during a run (the soak). Times count from the fleet's start."""

    kill_worker_after_s: float | None = None  # SIGKILL the worker, then start it again
    restart_broker_after_s: float | None = None
    # stops and restarts it (or, on a cluster, injects a node fault); may say what it did
    restart_broker: Callable[[], Awaitable[str | None]] | None = None
    log: list[str] = field(default_factory=list)  # what was injected, when
    # A worker (re)started while the broker is down exits at once by design (fail fast at
    # start-up); the run supervises it as a deployment would, restarting it after such an
    # exit. Any other exit is a failure of the run.
    unexpected_exits: list[str] = field(default_factory=list)
    longest_outage_s: float = 0.0  # the longest broker restart injected


async def run_pipeline(settings: Settings, sandboxes: int, episodes: int, seed: int, *,
                       work_root: Path = Path(".trajbus/demo"),
                       settle_timeout_s: float = 90, faults: Faults | None = None,
                       run_id: str | None = None) -> int:
    """Run the pipeline once and check it (module docstring). Returns 0 when every check
    passed. Its files (the emitters' journals, the manifest, the worker's log) go to
    ``work_root/<run_id>`` (default: the seed): a run must not find another run's journals,
    so callers that repeat a seed give each run its own ``run_id``."""
    from trajbus.bus.admin import ensure_base_topics, register_schemas
    from trajbus.bus.producer import close_producer
    from trajbus.producers.simulator import simulate

    work = work_root / (run_id or str(seed))
    work.mkdir(parents=True, exist_ok=True)
    topics = Topics(settings)
    await ensure_base_topics(settings, TASKS)
    await register_schemas(settings)
    _say(f"seed {seed}: {sandboxes} sandboxes x {episodes} episodes over tasks "
         f"{', '.join(TASKS)}; work dir {work}")

    worker_log = work / "worker.log"
    workers = [_start_worker(settings, worker_log)]
    _say(f"worker process pid {workers[0].pid} (reorder, watchdog, scheduler); log {worker_log}")
    view = View()
    started = time.monotonic()
    stop = asyncio.Event()
    watchers = [
        asyncio.create_task(_trainer(settings, seed, view, started, stop)),
        asyncio.create_task(_watch(settings, [topics.alerts, topics.decisions,
                                              topics.deadletter], view, stop)),
    ]
    live = asyncio.create_task(_live(view, started, stop))
    chaos = asyncio.create_task(_inject(settings, faults, workers, worker_log)) \
        if faults is not None else None
    supervisor = asyncio.create_task(_supervise(settings, faults, workers, worker_log, stop)) \
        if faults is not None else None
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
        if chaos is not None:
            await chaos  # every planned fault happened before the run is judged
        sandbox_ids = {e.sandbox for e in manifest.episodes} | set(manifest.sandbox_streams)
        deadline = time.monotonic() + settle_timeout_s
        while time.monotonic() < deadline:
            if all((s, ep) in view.episodes for (_, s, ep) in expected) and \
                    len(view.loop_alerts) >= len(manifest.loops) and \
                    all(_recycled(view.by_sandbox.get(sb, [])) for sb in sandbox_ids):
                break
            if any(t.done() for t in watchers):
                break  # a reader stopped: what it missed is judged (and why, said) below
            await asyncio.sleep(0.5)
    finally:
        stop.set()
        _note_reader_failures(view, watchers)
        extra = [t for t in (chaos, supervisor) if t is not None]
        for t in [*watchers, live, *extra]:
            t.cancel()
        await asyncio.gather(*watchers, live, *extra, return_exceptions=True)
        for worker in workers:
            worker.terminate()
            try:
                worker.wait(timeout=30)
            except subprocess.TimeoutExpired:
                worker.kill()
    print(file=sys.stderr)

    replay = await _replay_topics(settings)
    archive_summary = await _archive(settings)
    waterfall = await _waterfall(settings, view, work)
    return _summary(expected, manifest, view, replay, archive_summary, waterfall,
                    time.monotonic() - started, faults,
                    drain_window_s=settings.scheduler.drain_grace_ms / 1000)


def _note_reader_failures(view: View, readers: list[asyncio.Task[None]]) -> None:
    """A reader (the trainer, the watcher) that ended before the run stopped it is a problem
    of the run, with its error: never a silent reason for "never reached the trainer"."""
    for name, task in zip(("trainer", "watcher"), readers, strict=True):
        if not task.done() or task.cancelled():
            continue
        exc = task.exception()
        why = "ended early" if exc is None else f"failed: {type(exc).__name__}: {exc}"
        view.reader_failures.append(f"the {name}'s consumer {why}")


def _never_reached(sandbox: str, episode: str, acked: int, view: View,
                   replay: ReplayTopics) -> str:
    """The problem of an episode that never reached the trainer, with where it stopped: on the
    replay topic itself (the worker did not write it, or an open transaction hides it) or
    between the topic and the trainer."""
    key = (sandbox, episode)
    last = "with" if key in replay.closed else "without"
    return (f"{sandbox}/{episode}: never reached the trainer (the replay topic holds "
            f"{len(replay.seqs.get(key, ()))} of its {acked} events, {last} its last segment; "
            f"the trainer had {len(view.open.get(key, ()))})")


def _recycled(decisions: list[str]) -> bool:
    return "RECYCLE" in decisions or "RECYCLE_WITH_LOSS" in decisions


async def _supervise(settings: Settings, faults: Faults,
                     workers: list[subprocess.Popen[bytes]], worker_log: Path,
                     stop: asyncio.Event) -> None:
    """Restart the worker after it exited at start-up because the broker was down or nodes of
    the cluster were (what a process supervisor does); record any other exit as unexpected
    (the run then fails)."""
    t0 = time.monotonic()
    while not stop.is_set():
        await asyncio.sleep(0.5)
        current = workers[-1]
        code = current.poll()
        if code is None or code == -9:  # running, or the SIGKILL that _inject is handling
            continue
        with open(worker_log, "rb") as log_file:  # what this worker wrote
            log_file.seek(_LOG_OFFSETS.get(current.pid, 0))
            tail = log_file.read().decode(errors="replace")[-8000:].strip()
        # the worker's one-line error (asyncio's shutdown warnings can follow it)
        errors = [line for line in tail.splitlines() if line.startswith("trajbus: error:")]
        # fail-fast messages at start-up: the broker is down, or nodes of the cluster are (its
        # topics cannot get their replicas; the worker waits a minute for them, then exits)
        why = ("broker down" if errors and "did not answer" in errors[-1] else
               "cluster short of brokers" if errors and " live broker" in errors[-1] else None)
        if why is not None:
            await asyncio.sleep(1.0)
            workers.append(_start_worker(settings, worker_log))
            faults.log.append(f"{time.monotonic() - t0:.1f}s: worker pid {current.pid} exited "
                              f"at start-up ({why}), restarted as pid {workers[-1].pid}")
            _say(faults.log[-1])
        else:
            faults.unexpected_exits.append(f"worker pid {current.pid} exited with code "
                                           f"{code}: {tail.strip()[-300:]}")
            return


async def _inject(settings: Settings, faults: Faults, workers: list[subprocess.Popen[bytes]],
                  worker_log: Path) -> None:
    """Inject the planned faults, in time order, while the fleet runs."""
    t0 = time.monotonic()
    plan: list[tuple[float, str]] = []
    if faults.kill_worker_after_s is not None:
        plan.append((faults.kill_worker_after_s, "kill-worker"))
    if faults.restart_broker_after_s is not None and faults.restart_broker is not None:
        plan.append((faults.restart_broker_after_s, "restart-broker"))
    for at, what in sorted(plan):
        await asyncio.sleep(max(0.0, t0 + at - time.monotonic()))
        if what == "kill-worker":
            old = workers[-1]
            old.kill()
            await asyncio.to_thread(old.wait, 10)
            workers.append(_start_worker(settings, worker_log))
            faults.log.append(f"{time.monotonic() - t0:.1f}s: worker pid {old.pid} SIGKILLed, "
                              f"restarted as pid {workers[-1].pid}")
        else:
            assert faults.restart_broker is not None
            began = time.monotonic()
            did = await faults.restart_broker()
            faults.longest_outage_s = max(faults.longest_outage_s, time.monotonic() - began)
            faults.log.append(f"{began - t0:.1f}s: {did or 'broker restarted'} (took "
                              f"{time.monotonic() - began:.1f}s)")
        _say(faults.log[-1])


def _start_worker(settings: Settings, log_path: Path) -> subprocess.Popen[bytes]:
    env = dict(os.environ)
    env["TRAJBUS_KAFKA__BOOTSTRAP_SERVERS"] = settings.kafka.bootstrap_servers
    env["TRAJBUS_TOPICS__PREFIX"] = settings.topics.prefix
    env["TRAJBUS_TOPICS__PARTITIONS"] = str(settings.topics.partitions)
    # the worker creates topics too (replay, state changelogs, ticks): as replicated as the
    # run's (an unreplicated changelog on a cluster stalled the worker until its node returned)
    env["TRAJBUS_TOPICS__REPLICATION_FACTOR"] = str(settings.topics.replication_factor)
    if settings.topics.min_insync_replicas is not None:
        env["TRAJBUS_TOPICS__MIN_INSYNC_REPLICAS"] = str(settings.topics.min_insync_replicas)
    out = open(log_path, "ab")
    offset = out.seek(0, os.SEEK_END)
    proc = subprocess.Popen(
        [sys.executable, "-m", "trajbus", "worker", "--worker-id", "demo", "-v"],
        env=env, stdout=out, stderr=out)
    _LOG_OFFSETS[proc.pid] = offset
    return proc


# where each worker's output begins in the shared log (the supervisor reads only its own)
_LOG_OFFSETS: dict[int, int] = {}


async def _trainer(settings: Settings, seed: int, view: View, started: float,
                   stop: asyncio.Event) -> None:
    from trajbus.consumers.replay.client import ReplayClient

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
    # From the beginning: the run has topics of its own ("latest" would miss what the worker
    # wrote before this consumer was assigned its partitions).
    consumer = new_consumer(settings.kafka, *topics,
                            auto_offset_reset="earliest", isolation_level="read_committed",
                            enable_auto_commit=False, group_id=None)
    await consumer.start()
    try:
        while not stop.is_set():
            batch = await consumer.getmany(timeout_ms=300)
            for msgs in batch.values():
                for msg in msgs:
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
                        decision, sb = str(r["decision"]), r["header"]["sandbox"]
                        view.decisions[decision] += 1
                        view.by_sandbox.setdefault(sb, []).append(decision)
                        if decision == "RECYCLE_WITH_LOSS":
                            view.loss_details[sb] = dict(r["details"])
                        if decision == "ANOMALY":
                            view.anomalies.append(f"{sb}: {r['reason']}")
                    elif d.kind == "DeadLetter":
                        view.dead_letters[f"{r['stage']}:{r['reason_code']}"] += 1
                        if len(view.dead_letter_examples) < 5:
                            view.dead_letter_examples.append(
                                f"{r['stage']}:{r['reason_code']} {r['header']['sandbox']}/"
                                f"{r['header']['episode']}: {r['reason'][:160]}")
    finally:
        await close_client(consumer, "demo consumer")


async def _live(view: View, started: float, stop: asyncio.Event) -> None:
    while not stop.is_set():
        await asyncio.sleep(1)
        decisions = " ".join(f"{k.lower()}={v}" for k, v in sorted(view.decisions.items()))
        line = (f"\r[demo] {time.monotonic() - started:5.1f}s  trainer: "
                f"{len(view.episodes)} episodes, {sum(view.kinds.values())} events | "
                f"alerts: {sum(view.alerts.values())} | decisions: {decisions or '-'} | "
                f"dead letters: {sum(view.dead_letters.values())}")
        print(line[:160].ljust(160), end="", file=sys.stderr, flush=True)


@dataclass
class ReplayTopics:
    """The replay topics read raw (read_committed, no client-side dedupe)."""

    seqs: dict[tuple[str, str], Counter[tuple[int, str]]] = field(default_factory=dict)
    gaps: dict[tuple[str, str], list[tuple[int, int]]] = field(default_factory=dict)
    # (last_seq, record timestamp) of each gap-free segment: what the scheduler takes as
    # downstream's confirmation, stamped with the log time it judges by
    confirmations: dict[tuple[str, str], list[tuple[int, int]]] = field(default_factory=dict)
    # sandbox-level stream on the raw input topic: seq -> (kind, earliest record timestamp)
    sandbox_stream: dict[str, dict[int, tuple[str, int]]] = field(default_factory=dict)
    # episodes whose last segment (is_last) is on the replay topic
    closed: set[tuple[str, str]] = field(default_factory=set)
    # replay partitions whose last stable offset is behind their end (an open transaction
    # hides the records after it from every read_committed reader): tp -> (stable, end)
    unstable: dict[str, tuple[int, int]] = field(default_factory=dict)
    error: str | None = None

    def confirmed_at(self, sandbox: str, episode: str, seq: int) -> int | None:
        """The log time at which downstream first confirmed ``episode`` up to ``seq``."""
        times = [ts for last, ts in self.confirmations.get((sandbox, episode), [])
                 if last >= seq]
        return min(times) if times else None

    def drained_at(self, sandbox: str) -> int | None:
        """The log time at which the scheduler could first act on the sandbox's Drained
        report: its own stream is put back in seq order first, so the report waits for every
        earlier seq of the stream."""
        stream = self.sandbox_stream.get(sandbox, {})
        drained = [seq for seq, (kind, _ts) in stream.items() if kind == "Drained"]
        if not drained:
            return None
        return max(ts for seq, (_kind, ts) in stream.items() if seq <= min(drained))


async def _replay_topics(settings: Settings) -> ReplayTopics:
    from trajbus.consumers.operator.tools import read_records

    codec = default_codec()
    out = ReplayTopics()
    topics = Topics(settings)
    try:
        parts = await read_records(settings, [topics.replay(t) for t in TASKS]
                                   + [topics.sandbox_events])
    except Exception as exc:  # reported as a problem: the check cannot pass unread
        out.error = f"{type(exc).__name__}: {exc}"
        return out
    for tp, records in parts.items():
        for rec in records:
            if tp.topic == topics.sandbox_events:
                try:
                    event = codec.decode(rec.value)
                except DecodeError:
                    continue
                head = event.record["header"]
                if head["episode"] is None:
                    stream = out.sandbox_stream.setdefault(head["sandbox"], {})
                    earlier = stream.get(head["seq"])
                    if earlier is None or rec.timestamp_ms < earlier[1]:
                        stream[head["seq"]] = (event.kind, rec.timestamp_ms)
                continue
            d = codec.decode(rec.value)
            if d.kind != "ReplaySegment":
                continue
            seg = d.record
            key = (seg["header"]["sandbox"], seg["header"]["episode"])
            if seg["is_last"]:
                out.closed.add(key)
            if seg["gap"] is None and seg["events"]:
                out.confirmations.setdefault(key, []).append((seg["last_seq"], rec.timestamp_ms))
            seen = out.seqs.setdefault(key, Counter())
            for raw in seg["events"]:
                h = codec.decode(raw).record["header"]
                seen[(h["seq"], h["event_id"])] += 1
            if seg["gap"] is not None:
                out.gaps.setdefault(key, []).append((seg["gap"]["from_seq"],
                                                     seg["gap"]["to_seq"]))
    try:
        out.unstable = await _unstable_partitions(settings, [topics.replay(t) for t in TASKS])
    except Exception as exc:  # a diagnosis only: the checks above stand without it
        out.unstable = {f"(not measured: {type(exc).__name__}: {exc})": (-1, -1)}
    return out


async def _unstable_partitions(settings: Settings, topics: list[str]
                               ) -> dict[str, tuple[int, int]]:
    """Partitions of ``topics`` whose last stable offset (the end for read_committed) is
    behind their high watermark (the end for read_uncommitted)."""
    from trajbus.consumers.operator.tools import topic_partitions

    parts = await topic_partitions(settings, topics)
    tps = [TopicPartition(t, p) for t in sorted(parts) for p in parts[t]]
    if not tps:
        return {}
    ends: dict[str, dict[Any, int]] = {}
    for isolation in ("read_committed", "read_uncommitted"):
        consumer = new_consumer(settings.kafka,
                                enable_auto_commit=False, isolation_level=isolation)
        await consumer.start()
        try:
            ends[isolation] = await consumer.end_offsets(tps)
        finally:
            await close_client(consumer, "demo consumer")
    stable, end = ends["read_committed"], ends["read_uncommitted"]
    return {f"{tp.topic}[{tp.partition}]": (stable[tp], end[tp])
            for tp in sorted(end) if stable.get(tp, end[tp]) < end[tp]}


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
        summary["events"] = con.execute(
            "SELECT sandbox, episode, seq, event_id, count(*) FROM events "
            "WHERE sandbox <> '_tick' GROUP BY ALL").fetchall()
        summary["context"] = {
            view: {r[0]: r[1] for r in con.execute(
                f"SELECT event_id, {what} FROM {view}").fetchall()}
            for view, what in (("decisions", "decided_by"), ("alerts", "alert"),
                               ("dead_letters", "stage"))}
        summary["endings"] = Counter(
            (r[0], r[1]) for r in con.execute(
                "SELECT ending, truncated_by FROM episodes").fetchall())
        summary["topics"] = await _context_on_topics(settings)
    except Exception as exc:  # the summary says what failed; the check below still runs
        summary["error"] = f"{type(exc).__name__}: {exc}"
    return summary


async def _context_on_topics(settings: Settings) -> dict[str, set[str]]:
    """The event ids on the decisions, alerts and dead-letter topics (ticks left out): what the
    archive's decision context must equal."""
    from trajbus.consumers.operator.tools import read_records
    from trajbus.schemas.codec import DecodeError, default_codec

    topics = Topics(settings)
    names = {topics.decisions: "decisions", topics.alerts: "alerts",
             topics.deadletter: "dead_letters"}
    codec = default_codec()
    out: dict[str, set[str]] = {v: set() for v in names.values()}
    for tp, recs in (await read_records(settings, list(names))).items():
        for rec in recs:
            try:
                d = codec.decode(rec.value or b"")
            except DecodeError:
                continue
            if d.kind != "Tick":
                out[names[tp.topic]].add(str(d.header["event_id"]))
    return out


async def _waterfall(settings: Settings, view: View, work: Path) -> Path | None:
    """A step-time waterfall report of one finished episode (operators' tool)."""
    if view.sample is None:
        return None
    sandbox, episode = view.sample
    try:
        from trajbus.consumers.operator import tools, waterfall

        entries = await tools.read_sandbox_log(settings, sandbox, episode)
        out = work / f"waterfall-{sandbox}-{episode}.html"
        out.write_text(waterfall.render_html(entries))
        return out
    except Exception as exc:  # a report problem must not fail the pipeline check
        _say(f"waterfall report skipped: {type(exc).__name__}: {exc}")
        return None


def _expects_gap(acked: list[tuple[int, str]], final_seq: int | None) -> bool:
    """True when an acknowledged seq is really missing (a crash lost it): only then may the
    replay carry a gap marker."""
    seqs = sorted(seq for seq, _ in acked)
    if not seqs:
        return final_seq is not None and final_seq >= 0
    return seqs != list(range(seqs[-1] + 1)) or (final_seq is not None and final_seq > seqs[-1])


def _unexplained_loss(sandbox: str, details: dict[str, str], replay: ReplayTopics,
                      faults: Faults | None) -> str | None:
    """Why a RECYCLE_WITH_LOSS of a sandbox that did not crash is a fault of the pipeline, or
    None when the log shows the platform's rule at work.

    The scheduler ends a drain with loss when its grace window ends (log time) before
    downstream confirms the final seqs, or before the sandbox's Drained report. A broker outage
    and a worker restart together can hold those back past the window: then the confirmation
    (or the report) is in the log *after* the window's end, and the verdict is right. One that
    is in the log before the window's end means the scheduler judged by a clock ahead of its
    inputs: a bug. An emitter that could not flush is explained only by a broker outage."""
    outage = faults is not None and faults.longest_outage_s > 0
    lost = details.get("lost", "")
    ended = details.get("grace_ended_ms")
    if ended is None:  # the emitter's own Drained report said it could not flush everything
        return None if outage else (f"sandbox {sandbox}: RECYCLE_WITH_LOSS ({lost}) without a "
                                    "crash or a broker outage")
    end = int(ended)
    if lost.startswith("unknown"):
        at = replay.drained_at(sandbox)
        if at is not None and at > end:
            return None
        return (f"sandbox {sandbox}: RECYCLE_WITH_LOSS (no Drained report when the grace window "
                f"ended at {end}), but its Drained report was in the log at {at}")
    for part in lost.split(","):
        episode, _, span = part.rpartition(":")
        if episode == "unflushed":
            if outage:
                continue
            return f"sandbox {sandbox}: RECYCLE_WITH_LOSS ({part}) without a broker outage"
        final_seq = int(span.rpartition("-")[2])
        at = replay.confirmed_at(sandbox, episode, final_seq)
        if at is None:
            return (f"sandbox {sandbox}: RECYCLE_WITH_LOSS ({part}), and downstream never "
                    f"confirmed seq {final_seq} on the replay topics")
        if at <= end:
            return (f"sandbox {sandbox}: RECYCLE_WITH_LOSS ({part} unconfirmed when the grace "
                    f"window ended at {end}), but downstream confirmed seq {final_seq} at {at}")
    return None


def _summary(expected: dict[tuple[str, str, str], Any], manifest: Any, view: View,
             replay: ReplayTopics, archive: dict[str, Any], waterfall: Path | None,
             elapsed: float, faults: Faults | None = None,
             drain_window_s: float = 30.0) -> int:
    problems: list[str] = []
    exact = truncated_ok = 0
    for (_task, sandbox, episode), rec in sorted(expected.items()):
        got = view.episodes.get((sandbox, episode))
        want = sorted((seq, eid) for seq, eid in rec.acked)
        if got is None:
            problems.append(_never_reached(sandbox, episode, len(want), view, replay))
        elif got == want:
            exact += 1
            if (sandbox, episode) in view.truncated:
                truncated_ok += 1
        else:
            missing = sorted(set(want) - set(got))[:3]
            extra = sorted(set(got) - set(want))[:3]
            problems.append(f"{sandbox}/{episode}: {len(got)} events vs {len(want)} "
                            f"acknowledged (missing {missing}, unexpected {extra})")

    problems.extend(view.reader_failures)
    if replay.unstable and any("never reached the trainer" in p for p in problems):
        problems.append(f"replay partitions with an open transaction at the end (last stable "
                        f"offset, end): {replay.unstable}")
    # The replay topics themselves: once each, gaps only where a seq is really missing.
    if replay.error is not None:
        problems.append(f"reading the replay topics failed: {replay.error}")
    for exit_ in faults.unexpected_exits if faults is not None else []:
        problems.append(f"unexpected worker exit: {exit_}")
    twice = false_gaps = 0
    for (_task, sandbox, episode), rec in sorted(expected.items()):
        seen = replay.seqs.get((sandbox, episode), Counter())
        dups = sorted(k for k, n in seen.items() if n > 1)
        if dups:
            twice += len(dups)
            problems.append(f"{sandbox}/{episode}: {len(dups)} events more than once on the "
                            f"replay topic (e.g. seq {dups[0][0]})")
        gaps = replay.gaps.get((sandbox, episode))
        if gaps and not _expects_gap(rec.acked, rec.final_seq):
            false_gaps += 1
            problems.append(f"{sandbox}/{episode}: false gap marker(s) {gaps} (every seq was "
                            "acknowledged)")

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

    # Lifecycles: every sandbox drained, then recycled once; loss only where a crash was planted.
    crashed = {e.sandbox for e in manifest.episodes if e.behaviour == "crash"}
    outage_losses = 0
    sandboxes = sorted({e.sandbox for e in manifest.episodes} | set(manifest.sandbox_streams))
    for sb in sandboxes:
        ds = view.by_sandbox.get(sb, [])
        recycles = [d for d in ds if d in ("RECYCLE", "RECYCLE_WITH_LOSS")]
        # The drain starts with DRAIN (the sandbox reported DRAINING) or with TERMINATE (the
        # watchdog's loop verdict reached the scheduler first: it drains the sandbox itself).
        drains = [i for i, d in enumerate(ds) if d in ("DRAIN", "TERMINATE")]
        if len(recycles) != 1 or not drains or drains[0] > ds.index(recycles[0]):
            problems.append(f"sandbox {sb}: lifecycle decisions {ds} (want DRAIN or "
                            "TERMINATE, then one RECYCLE)")
        elif recycles == ["RECYCLE_WITH_LOSS"] and sb not in crashed:
            why_not = _unexplained_loss(sb, view.loss_details.get(sb, {}), replay, faults)
            if why_not is None:
                outage_losses += 1
            else:
                problems.append(why_not)
    for a in view.anomalies[:10]:
        problems.append(f"ANOMALY decision: {a}")
    if view.dead_letters:
        problems.append(f"dead letters from a clean fleet: {dict(view.dead_letters)}; e.g. "
                        + "; ".join(view.dead_letter_examples))

    # The archive: every acknowledged event once (episodes and sandbox-level streams).
    archived_ok = None
    if "events" in archive:
        mine = set(sandboxes)
        rows: dict[tuple[str, str | None], Counter[tuple[int, str]]] = {}
        for sb, ep, seq, eid, n in archive["events"]:
            if sb in mine:
                rows.setdefault((sb, ep), Counter())[(seq, eid)] += n
        want_rows: dict[tuple[str, str | None], list[tuple[int, str]]] = {
            (s, ep): list(r.acked) for (_t, s, ep), r in expected.items()}
        for sb, stream in manifest.sandbox_streams.items():
            want_rows[(sb, None)] = [(int(seq), str(eid)) for seq, eid in stream]
        bad = 0
        for key, want in sorted(want_rows.items(), key=lambda kv: (kv[0][0], kv[0][1] or "")):
            have = rows.pop(key, Counter())
            wanted = {(int(seq), str(eid)) for seq, eid in want}
            missing = sorted(wanted - set(have))
            dups = sorted(k for k, n in have.items() if n > 1)
            extra = sorted(set(have) - wanted)
            if missing or dups or extra:
                bad += 1
                if bad <= 5:
                    problems.append(f"archive {key[0]}/{key[1] or '(sandbox)'}: "
                                    f"{len(missing)} missing, {len(dups)} duplicated, "
                                    f"{len(extra)} unexpected rows")
        for key in sorted(rows, key=lambda k: (k[0], k[1] or ""))[:5]:
            problems.append(f"archive has rows of {key[0]}/{key[1]} that nobody acknowledged")
        if bad > 5:
            problems.append(f"... and {bad - 5} more archived streams differ")
        archived_ok = bad == 0 and not rows

    print("\n=== trajbus demo summary ===")
    print(f"elapsed: {elapsed:.1f}s; first replay segment reached the trainer after "
          f"{view.first_segment_s or float('nan'):.2f}s")
    if faults is not None and faults.log:
        print("faults injected: " + "; ".join(faults.log))
    print(f"trainer view: {exact}/{len(expected)} episodes exactly equal to what the emitters "
          f"acknowledged (in order, no duplicates); {len(view.truncated)} truncated "
          f"(crashed/recycled), {len(view.gappy)} with gap markers")
    print(f"replay topics (raw): {twice} events more than once, {false_gaps} false gaps")
    print("events by kind at the trainer: " +
          ", ".join(f"{k}={v}" for k, v in view.kinds.most_common()))
    nonloops = sum(1 for e in manifest.episodes if e.behaviour == "nonloop")
    print(f"watchdog: {len(caught & planted)}/{len(planted)} planted loops caught, "
          f"{len(false_alarms)} false alarms ({nonloops} look-alike non-loops left alone); "
          f"alerts {dict(view.alerts)}")
    print(f"scheduler decisions: {dict(view.decisions)}; {len(crashed)} sandboxes crashed on "
          "purpose" + (f"; {outage_losses} RECYCLE_WITH_LOSS from the injected faults "
                       f"(downstream confirmed after the {drain_window_s:.0f}s drain window "
                       "had ended, as the log shows)" if outage_losses else ""))
    print(f"dead letters: {dict(view.dead_letters) or 'none'}; anomalies: "
          f"{len(view.anomalies) or 'none'}")
    stats = archive.get("stats")
    print(f"archive: {archive.get('url')} ({archive.get('seconds', 0):.1f}s; {stats})"
          + ("" if archived_ok is None else
             "; every acknowledged event archived once" if archived_ok else "; NOT exact"))
    if "rows" in archive:
        print(f"  sample query: trajbus archive sql \"{archive['query']}\"")
        for row in archive["rows"]:
            print("   ", " | ".join(str(c) for c in row))
    if "context" in archive:
        ctx, on_topics = archive["context"], archive["topics"]
        same = all(set(ctx[v]) == on_topics[v] for v in on_topics)
        by = Counter(ctx["decisions"].values())
        print(f"  decision context: {len(ctx['decisions'])} decisions ({dict(by)}), "
              f"{len(ctx['alerts'])} alerts, {len(ctx['dead_letters'])} dead letters"
              + ("; the same as on their topics" if same else "; NOT the topics'"))
        print("  episode endings: " + ", ".join(
            f"{e}{f' ({t})' if t else ''}={n}" for (e, t), n in sorted(
                archive["endings"].items(), key=lambda kv: (kv[0][0], kv[0][1] or ""))))
        stuck = sum(n for (e, _), n in archive["endings"].items() if e == "in_progress")
        if stuck:  # every sandbox was recycled: no episode of theirs can still be running
            problems.append(f"archive: {stuck} episodes still in_progress after every sandbox "
                            "was recycled")
        for v in on_topics:
            if set(ctx[v]) != on_topics[v]:
                problems.append(f"archive {v}: {len(set(ctx[v]) - on_topics[v])} not on the "
                                f"topic, {len(on_topics[v] - set(ctx[v]))} missing")
    elif "error" in archive:
        problems.append(f"archive query failed: {archive['error']}")
    if waterfall:
        print(f"step-time waterfall of one episode: {waterfall}")
    if problems:
        print(f"\nPROBLEMS ({len(problems)}):")
        for p in problems[:40]:
            print(f"  - {p}")
        return 1
    print("\nOK: every acknowledged event reached the trainer once, in order, and the archive "
          "once; every planted loop was caught and nothing else was flagged; every sandbox "
          "drained and recycled; no dead letters, no anomalies.")
    return 0


def _say(msg: str) -> None:
    print(f"[demo] {msg}", file=sys.stderr, flush=True)
