"""Benchmark of a what-if run (issue 40): events/s re-run through the cores over a synthetic log.

    python bench/bench_whatif.py [--sandboxes 1000] [--pairs 30] [--repeat 3] [--json out.json]

Workload (generated up front, not timed): ``--sandboxes`` sandboxes, one episode each of
``--pairs`` ToolCall/ToolResult pairs 2-20 s apart (5% loop on one call long enough to fire,
5% repeat a call 16 times -- a loop only under a 15-repeat rule -- the rest vary their calls),
cut into replay segments of up to 16 events on 6 replay partitions, written (record timestamp)
when their last event happened; per sandbox PROVISIONING/ACTIVE and a heartbeat every 4 min on
the sandbox events topic; a tick every 10 s for the scheduler. No broker: the log is a
:class:`~trajbus.consumers.whatif.RecordedLog` built in memory, its recorded outputs those of
the live adapters over it.

Measured (process CPU time, best of ``--repeat``):

- ``watchdog_core_events_per_s``: ``WatchdogCore.handle`` alone over the decoded events in log
  order (the core a what-if run re-runs; target >= 100,000 events/s);
- ``watchdog_stage_events_per_s``: the watchdog stage of a what-if run (the live adapter:
  Avro decode of each segment and its events, the core, encoding the outputs);
- ``whatif_events_per_s``: a whole ``whatif(log, {"watchdog.loop_min_repeats": 15})`` -- the
  recorded-rules run and its self-check, the changed watchdog, the scheduler re-run on the
  substituted alerts, the diff -- events fed to the cores (both runs) per CPU second;
  ``whatif_seconds`` its CPU time.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout

from aiokafka import TopicPartition

from trajbus.bus.settings import Settings
from trajbus.bus.topics import Topics
from trajbus.consumers.engine.processors import scheduler_spec, watchdog_spec
from trajbus.consumers.engine.runner import InRecord
from trajbus.consumers.operator.tools import (
    DerivedRecord,
    feed_processor,
    merge_by_timestamp,
    processor_inputs,
)
from trajbus.consumers.watchdog.core import WatchdogCore
from trajbus.consumers.whatif import RecordedLog, whatif
from trajbus.consumers.whatif.run import run_pipeline
from trajbus.schemas import models as m
from trajbus.schemas.codec import default_codec

GOAL_CORE = 100_000
T0 = 1_767_225_600_000
PARTITIONS = 6
TOOLS = ["shell", "python", "http.get", "browser.click", "fs.read", "search"]


def build_log(n_sandboxes: int, pairs: int, seed: int = 7) -> tuple[Settings, RecordedLog]:
    rng = random.Random(seed)
    settings = Settings()
    settings.topics.prefix = "bench"
    topics = Topics(settings)
    replay = topics.replay("task-a")
    parts: dict[TopicPartition, list[InRecord]] = {}

    def add(topic: str, p: int, key: bytes, value: bytes, ts: int) -> None:
        parts.setdefault(TopicPartition(topic, p), []).append(
            InRecord(topic, p, 0, key, value, ts))

    for i in range(n_sandboxes):
        sb = f"sb-{i:05d}"
        start = T0 + rng.randrange(600_000)
        kind = "loop" if i % 20 == 0 else "near" if i % 20 == 1 else "varied"
        for seq, (state, t) in enumerate((("PROVISIONING", start - 2000),
                                          ("ACTIVE", start - 1000))):
            ev = m.SandboxLifecycle(header=m.Envelope(
                event_id=f"{sb}-s{seq}", task="task-a", sandbox=sb, episode=None, seq=seq,
                event_time_ms=t, producer_id="runtime"), state=m.LifecycleState(state),
                node="n1" if state == "PROVISIONING" else None,
                tenant="acme" if state == "PROVISIONING" else None)
            add(topics.sandbox_events, i % PARTITIONS, sb.encode(), ev.encode(), t)
        t, seq = start, 0
        events: list[tuple[int, bytes]] = []

        def h(t: int, seq: int, sb: str = sb) -> m.Envelope:
            return m.Envelope(event_id=f"{sb}-e{seq}", task="task-a", sandbox=sb,
                              episode="ep-1", seq=seq, event_time_ms=t, producer_id="sidecar")

        events.append((t, m.EpisodeStart(header=h(t, seq)).encode()))
        for k in range(pairs):
            t += rng.randrange(2000, 20_000)
            seq += 1
            same = (kind == "loop") or (kind == "near" and 2 <= k < 18)
            tool = "browser.click" if same else rng.choice(TOOLS)
            args = "a" * 64 if same else f"{rng.getrandbits(256):064x}"
            events.append((t, m.ToolCall(header=h(t, seq), call_id=f"c{k}", tool=tool,
                                         args_hash=args).encode()))
            t += rng.randrange(100, 1500)
            seq += 1
            res = "b" * 64 if same else f"{rng.getrandbits(256):064x}"
            events.append((t, m.ToolResult(header=h(t, seq), call_id=f"c{k}", tool=tool,
                                           status=m.ToolStatus.OK, result_hash=res).encode()))
        t += 1000
        seq += 1
        events.append((t, m.EpisodeEnd(header=h(t, seq),
                                       outcome=m.EpisodeOutcome.TERMINAL).encode()))
        for s, k in enumerate(range(0, len(events), 16)):
            chunk = events[k:k + 16]
            first = k
            seg = m.ReplaySegment(
                header=m.Envelope(event_id=f"seg-{sb}-{s}", task="task-a", sandbox=sb,
                                  episode="ep-1", seq=s, event_time_ms=chunk[-1][0],
                                  producer_id="trajbus.reorder"),
                first_seq=first, last_seq=first + len(chunk) - 1, events=[v for _, v in chunk],
                is_first=first == 0, is_last=k + 16 >= len(events), is_terminal=False)
            add(replay, i % PARTITIONS, f"{sb}/ep-1".encode(), seg.encode(), chunk[-1][0])
        for b, hb in enumerate(range(start + 240_000, t, 240_000)):
            ev = m.Heartbeat(header=m.Envelope(
                event_id=f"{sb}-h{b}", task="task-a", sandbox=sb, episode=None, seq=2 + b,
                event_time_ms=hb, producer_id="runtime"))
            add(topics.sandbox_events, i % PARTITIONS, sb.encode(), ev.encode(), hb)
    end = max(r.timestamp_ms for recs in parts.values() for r in recs)
    for t in range(T0 - 10_000, end + 20_000, 10_000):
        tick = m.Tick(header=m.Envelope(task="_tick", sandbox="_tick", seq=0, event_time_ms=t,
                                        producer_id="bench.ticker"))
        add(topics.control, 0, b"_tick", tick.encode(), t)
    for tp, recs in parts.items():  # a partition is in log-time order, offsets from 0
        recs.sort(key=lambda r: r.timestamp_ms)
        parts[tp] = [r._replace(offset=o) for o, r in enumerate(recs)]
    return settings, _recorded(settings, parts)


def _recorded(settings: Settings, parts: dict[TopicPartition, list[InRecord]]) -> RecordedLog:
    """The log with what the live adapters record over it (alerts also as scheduler input)."""
    codec = default_codec()
    topics = Topics(settings)
    recorded: list[DerivedRecord] = []
    for spec in (watchdog_spec(settings), scheduler_spec(settings)):
        mine = processor_inputs(spec.input_topics, spec.input_pattern, parts)
        for out, ts in feed_processor(spec.factory, spec.global_state,
                                      merge_by_timestamp(mine, spec.input_topics)):
            if out.topic in (topics.alerts, topics.decisions):
                recorded.append(DerivedRecord.from_decoded(codec.decode(out.value), ts + 5))
            if out.topic == topics.alerts:
                recs = parts.setdefault(TopicPartition(out.topic, 0), [])
                recs.append(InRecord(out.topic, 0, len(recs), out.key, out.value, ts + 5))
    return RecordedLog(parts, recorded, None)


def _core_events(settings: Settings, log: RecordedLog) -> list[tuple[str, dict[str, Any]]]:
    codec = default_codec()
    spec = watchdog_spec(settings)
    mine = processor_inputs(spec.input_topics, spec.input_pattern, log.inputs)
    out = []
    for rec in merge_by_timestamp(mine, spec.input_topics):
        d = codec.decode(rec.value)
        if d.kind == "ReplaySegment":
            for raw in d.record["events"]:
                e = codec.decode(raw)
                out.append((e.kind, e.record))
    return out


def bench(n_sandboxes: int, pairs: int, repeat: int) -> dict[str, Any]:
    settings, log = build_log(n_sandboxes, pairs)
    events = _core_events(settings, log)
    core_best = stage_best = whatif_best = float("inf")
    diff = None
    stage_events = 0
    for _ in range(repeat):
        core = WatchdogCore(settings.watchdog, settings.watchdog.per_task)
        c0 = time.process_time()
        for kind, record in events:
            core.handle(kind, record)
        core_best = min(core_best, time.process_time() - c0)
        stage = run_pipeline(log, settings, only=("watchdog",))
        stage_best = min(stage_best, stage.seconds)
        stage_events = stage.events
        c0 = time.process_time()
        diff = whatif(log, {"watchdog.loop_min_repeats": 15}, settings=settings)
        whatif_best = min(whatif_best, time.process_time() - c0)
    assert diff is not None and diff.self_check.passed, diff.self_check.headline()
    t = diff.totals()
    return {
        "sandboxes": n_sandboxes, "pairs": pairs, "input_records": log.input_count(),
        "watchdog_events": len(events), "recorded_outputs": len(log.recorded),
        "watchdog_core_events_per_s": round(len(events) / core_best),
        "watchdog_stage_events_per_s": round(stage_events / stage_best),
        "whatif_events": diff.events, "whatif_seconds": round(whatif_best, 3),
        "whatif_events_per_s": round(diff.events / whatif_best),
        "diff_added": t["added"], "diff_removed": t["removed"], "diff_moved": t["moved"],
        "self_check_compared": diff.self_check.compared,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sandboxes", type=int, default=1000)
    ap.add_argument("--pairs", type=int, default=30)
    ap.add_argument("--repeat", type=int, default=3, help="best of N runs")
    ap.add_argument("--json", help="write the figures to this JSON file")
    args = ap.parse_args(argv)
    from bench_watchdog import reference_ms

    res: dict[str, Any] = {"name": "whatif", "reference_ms": reference_ms()}
    res.update(bench(args.sandboxes, args.pairs, args.repeat))
    met = res["watchdog_core_events_per_s"] >= GOAL_CORE
    res["targets"] = [
        {"measure": "watchdog core events/s in a what-if run (CPU)",
         "result": res["watchdog_core_events_per_s"], "target": ">= 100,000", "met": met},
        {"measure": "whole what-if run (2 runs, self-check, diff) events/s (CPU)",
         "result": res["whatif_events_per_s"], "target": "(reported)", "met": True},
    ]
    print(f"whatif: {res['sandboxes']} sandboxes, {res['watchdog_events']:,} watchdog events, "
          f"{res['input_records']:,} input records; watchdog core "
          f"{res['watchdog_core_events_per_s']:,} events/s, watchdog stage (decode + core) "
          f"{res['watchdog_stage_events_per_s']:,} events/s, whole what-if "
          f"{res['whatif_events_per_s']:,} events/s ({res['whatif_seconds']} s CPU; diff "
          f"+{res['diff_added']} -{res['diff_removed']} ~{res['diff_moved']}); "
          f"calibration {res['reference_ms']} ms")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=2, sort_keys=True)
    return 0 if met else 1


if __name__ == "__main__":
    sys.exit(main())
