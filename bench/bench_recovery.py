"""Recovery of the reorder worker after a SIGKILL: kill to serving all partitions, and memory.

    python bench/bench_recovery.py --json out.json [--bootstrap HOST:PORT] [--episodes 20000]
        [--sandboxes 1000] [--partitions 6] [--repeat 3]

The issue-18 scenario at the platform's scale, measured end to end with real processes:

1. **Open episodes.** ``--episodes`` episodes (EpisodeStart + 1..``--max-calls`` ToolCall /
   ToolResult pairs each, no EpisodeEnd: all stay open) of ``--sandboxes`` sandboxes are
   encoded with the trajbus models and produced to the input topic (``<prefix>.sandbox.events``,
   keyed by sandbox, murmur2 like the Java/aiokafka clients, the worker's compression), the
   episodes' events interleaved (every episode's first event, then every episode's second, ...)
   the way a partition sees a fleet. One reorder worker (``python -m trajbus worker
   --processors reorder --worker-id bench -v``, a subprocess with ``TRAJBUS_KAFKA__*`` /
   ``TRAJBUS_TOPICS__*`` set) drains it; "caught up" is its group's committed offsets on the
   input topic reaching the end offsets of what was produced (polled through the admin API).
   After ``--settle`` seconds its RSS (``/proc/<pid>/status`` VmRSS) is the "before" figure.
2. **Kill and restart.** The worker is SIGKILLed and restarted at once with the same
   ``--worker-id`` (static membership: it should take its partitions back without waiting for
   its dead self's session). As soon as the new process is spawned, one probe EpisodeStart
   (a new sandbox and episode) is produced into every input partition (explicit partition).
   **Kill to serving all partitions** = SIGKILL -> the moment every probe's ReplaySegment is
   visible on the replay topic to a read_committed consumer (positioned at the end before the
   kill, polling with a 20 ms fetch wait). The first probe's time is reported beside it. Once
   the restarted worker has caught up (committed offsets past the probes) and ``--settle``
   seconds passed, its RSS is the "after" figure. From its log: the "restored N state records
   for partitions [...] in X s" line(s), and where the time went (log timestamps relative to
   the SIGKILL): spawn, first log line (imports, broker check, topic preparation, start of the
   transactional producer), subscribed (init_transactions done, consumer started), joined
   group, partitions assigned, restore finished. ``python_import_s`` (the worker's imports in a
   fresh interpreter, measured once at the end) tells how much of the first stretch is imports.
3. ``--repeat`` kill/restart rounds (each kills the previous round's restarted worker);
   min/median/max over the rounds.

Targets (issue 18): kill to serving all partitions <= 5 s with 20,000 open episodes (the
slowest round); RSS after restore / RSS before the crash <= 1.2 (the worst round; the ratio
against the first, never-restored worker is reported too, so a leak that accumulates across
restarts shows). The late and dead-letter topics must stay empty (reported).

With ``--bootstrap`` it uses that broker, otherwise it starts its own (``LocalBroker``, free
ports, temporary data directory). Prints one summary line and writes all figures as JSON;
the workers' logs stay in the work directory (``_logs``).
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import random
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))  # the harness, also when a test loads this file

from harness.broker import broker_for  # noqa: E402
from harness.events import probe_records  # noqa: E402
from harness.figures import stats  # noqa: E402
from harness.groups import GroupWatch, ReplayWatch  # noqa: E402
from harness.kafka import Fleet, end_offsets  # noqa: E402
from harness.procstat import rss_mb  # noqa: E402
from harness.restart import GROUP_SUFFIX  # noqa: E402
from harness.worker import WorkerProc, import_time, worker_env  # noqa: E402
from harness.worklog import parse_log  # noqa: E402

TARGET_KILL_TO_SERVING_S = 5.0
TARGET_RSS_RATIO = 1.2


def open_episodes(n: int, sandboxes: int, max_calls: int, task: str, seed: int
                  ) -> tuple[list[tuple[bytes, bytes, int | None]], int]:
    """(key, value, None) records of ``n`` open episodes, interleaved across episodes; and the
    number of events."""
    from trajbus.schemas import models as m

    rng = random.Random(seed)
    t0 = int(time.time() * 1000)
    per_ep: list[list[tuple[bytes, bytes, int | None]]] = []
    for i in range(n):
        sb, ep = f"sb-{i % sandboxes:05d}", f"ep-{i:06d}"
        key = sb.encode()

        def hdr(seq: int, sb: str = sb, ep: str = ep) -> m.Envelope:
            return m.Envelope(event_id=f"{ep}-{seq}", task=task, sandbox=sb, episode=ep,
                              seq=seq, event_time_ms=t0 + seq * 100, producer_id=f"sandbox/{sb}")

        evs = [(key, m.EpisodeStart(header=hdr(0)).encode(), None)]
        seq = 0
        for c in range(rng.randint(1, max_calls)):
            seq += 1
            evs.append((key, m.ToolCall(header=hdr(seq), call_id=f"c{c}", tool="shell",
                                        args_hash=f"{rng.getrandbits(256):064x}").encode(), None))
            seq += 1
            evs.append((key, m.ToolResult(header=hdr(seq), call_id=f"c{c}", tool="shell",
                                          status=m.ToolStatus.OK,
                                          result_hash=f"{rng.getrandbits(256):064x}").encode(),
                        None))
        per_ep.append(evs)
    longest = max(len(e) for e in per_ep)
    records = [evs[j] for j in range(longest) for evs in per_ep if j < len(evs)]
    return records, len(records)


# -- the benchmark -----------------------------------------------------------------------------
def run(a: argparse.Namespace, bootstrap: str, work: Path) -> dict[str, Any]:
    from trajbus.bus.admin import ensure_base_topics
    from trajbus.bus.settings import KafkaSettings, Settings, TopicSettings
    from trajbus.bus.topics import Topics

    load_start = os.getloadavg()
    prefix = f"bench-recovery-{uuid.uuid4().hex[:8]}"
    settings = Settings(kafka=KafkaSettings(bootstrap_servers=bootstrap),
                        topics=TopicSettings(prefix=prefix, partitions=a.partitions))
    topics = Topics(settings)
    asyncio.run(ensure_base_topics(settings, [a.task]))
    compression = KafkaSettings().compression_type or "none"

    t = time.monotonic()
    records, n_events = open_episodes(a.episodes, a.sandboxes, a.max_calls, a.task, a.seed)
    t_encode = time.monotonic() - t
    worker = WorkerProc(worker_env(bootstrap, prefix, a.partitions,
                                   TRAJBUS_STATE_DIR=str(work / "state")), work)
    fleet = Fleet(bootstrap, topics.sandbox_events, compression)
    group: GroupWatch | None = None
    rounds: list[dict[str, Any]] = []
    first: dict[str, Any] = {}
    try:
        t = time.monotonic()
        fleet.produce(records, timeout=a.timeout)
        t_produce = time.monotonic() - t
        del records
        target = end_offsets(bootstrap, topics.sandbox_events)
        print(f"[recovery] {a.episodes:,} open episodes ({n_events:,} events, "
              f"{a.sandboxes:,} sandboxes, {a.partitions} partitions) produced in "
              f"{t_produce:.1f} s", flush=True)
        group = GroupWatch(bootstrap, prefix + GROUP_SUFFIX, topics.sandbox_events)
        t_start_wall = time.time()
        proc = worker.start()
        drain_s = group.wait_caught_up(target, proc, a.timeout)
        time.sleep(a.settle)
        before = rss_mb(proc.pid)
        assert worker.log_path is not None
        first = {"caught_up_after_start_s": round(drain_s, 2), **(before or {}),
                 **parse_log(worker.log_path, t_start_wall)}
        for k in ("restore_lines", "restored_records", "restore_s"):
            first.pop(k, None)
        state_topic = f"{prefix}{GROUP_SUFFIX}.state"
        first["state_topic_offsets"] = sum(end_offsets(bootstrap, state_topic).values())
        print(f"[recovery] worker caught up {drain_s:.1f} s after its start; RSS "
              f"{first.get('rss_mb')} MB; state topic {first['state_topic_offsets']:,} offsets",
              flush=True)

        for r in range(a.repeat):
            watch = ReplayWatch(bootstrap, topics.replay(a.task))
            try:
                rss_before = rss_mb(proc.pid)
                state_offsets = sum(end_offsets(bootstrap, state_topic).values())
                tag = f"r{r + 1}-{uuid.uuid4().hex[:4]}"
                probes, keys = probe_records(a.partitions, a.task, tag)
                t_kill_wall, t_kill = time.time(), time.monotonic()
                worker.sigkill()
                t_dead = time.monotonic()
                proc = worker.start()
                t_spawned = time.monotonic()
                fleet.produce(probes, timeout=a.timeout)
                t_probes = time.monotonic()
                seen = watch.wait(set(keys), a.timeout)
            finally:
                watch.close()
            serving = max(seen.values()) - t_kill
            first_probe = min(seen.values()) - t_kill
            target = end_offsets(bootstrap, topics.sandbox_events)
            group.wait_caught_up(target, proc, a.timeout)
            time.sleep(a.settle)
            after = rss_mb(proc.pid)
            assert worker.log_path is not None
            log = parse_log(worker.log_path, t_kill_wall)
            res: dict[str, Any] = {
                "round": r + 1,
                "kill_to_serving_all_partitions_s": round(serving, 3),
                "kill_to_first_partition_s": round(first_probe, 3),
                "per_partition_s": {str(keys[k]): round(v - t_kill, 3)
                                    for k, v in sorted(seen.items(), key=lambda x: keys[x[0]])},
                "timeline_s": {"dead": round(t_dead - t_kill, 3),
                               "spawned": round(t_spawned - t_kill, 3),
                               "probes_produced": round(t_probes - t_kill, 3),
                               **log["timeline_s"],
                               "first_probe_served": round(first_probe, 3),
                               "all_probes_served": round(serving, 3)},
                "restored_records": log["restored_records"], "restore_s": log["restore_s"],
                "restore_lines": log["restore_lines"],
                "state_topic_offsets_at_kill": state_offsets,
                "rss_before_mb": (rss_before or {}).get("rss_mb"),
                "rss_after_mb": (after or {}).get("rss_mb"),
                "peak_rss_after_mb": (after or {}).get("peak_rss_mb"),
                "load_average_1m": round(os.getloadavg()[0], 2),
            }
            if res["rss_before_mb"] and res["rss_after_mb"]:
                res["rss_ratio"] = round(res["rss_after_mb"] / res["rss_before_mb"], 3)
            if first.get("rss_mb") and res["rss_after_mb"]:
                res["rss_ratio_vs_uninterrupted"] = round(res["rss_after_mb"] / first["rss_mb"], 3)
            rounds.append(res)
            print(f"[recovery] round {r + 1}/{a.repeat}: kill to serving all partitions "
                  f"{serving:.2f} s (first {first_probe:.2f} s); restored "
                  f"{res['restored_records']:,} records in {res['restore_s']} s; RSS "
                  f"{res['rss_before_mb']} -> {res['rss_after_mb']} MB; timeline "
                  f"{res['timeline_s']}", flush=True)
    finally:
        worker.stop()
        fleet.close()
        if group is not None:
            group.close()
        gc.collect()  # librdkafka clients gone before the broker stops (no disconnect noise)
    imports = import_time()
    leftovers = {name: sum(end_offsets(bootstrap, t).values())
                 for name, t in (("late", topics.late), ("deadletter", topics.deadletter))}
    return summarise(a, rounds, first, leftovers, imports, load_start, work, {
        "episodes": a.episodes, "events": n_events, "sandboxes": a.sandboxes,
        "partitions": a.partitions, "max_calls_per_episode": a.max_calls,
        "compression": compression, "encode_s": round(t_encode, 1),
        "produce_s": round(t_produce, 1)})


def summarise(a: argparse.Namespace, rounds: list[dict[str, Any]], first: dict[str, Any],
              leftovers: dict[str, int], imports: float, load_start: tuple[float, ...],
              work: Path, inp: dict[str, Any]) -> dict[str, Any]:
    serving = [r["kill_to_serving_all_partitions_s"] for r in rounds]
    ratios = [r["rss_ratio"] for r in rounds if "rss_ratio" in r]
    ratios_first = [r["rss_ratio_vs_uninterrupted"] for r in rounds
                    if "rss_ratio_vs_uninterrupted" in r]
    phases: dict[str, float | None] = {}  # medians; every round's in _rounds
    for name in ("dead", "spawned", "first_log_line", "subscribed", "joined_group", "assigned",
                 "restored", "first_probe_served", "all_probes_served"):
        vals = [r["timeline_s"][name] for r in rounds if name in r["timeline_s"]]
        phases[name] = stats(vals)["median"]
    worst = max(serving) if serving else None
    worst_ratio = max(ratios) if ratios else None
    out: dict[str, Any] = {
        "name": "recovery", "input": inp, "repeat": a.repeat, "cpus": os.cpu_count(),
        "settle_s": a.settle,
        "measure": "kill_to_serving_all_partitions_s = SIGKILL of the reorder worker -> every "
                   "probe (one new EpisodeStart per input partition, produced once the "
                   "restarted worker, same --worker-id, was spawned) visible as a "
                   "ReplaySegment to a read_committed consumer; RSS = VmRSS of the worker "
                   f"{a.settle} s after its group's committed offsets reached the input's end",
        "uninterrupted_worker": first,
        "kill_to_serving_all_partitions_s": stats(serving),
        "kill_to_first_partition_s": stats([r["kill_to_first_partition_s"] for r in rounds]),
        "restored_records": stats([r["restored_records"] for r in rounds], 0),
        "restore_s": stats([r["restore_s"] for r in rounds]),
        "rss_before_mb": stats([r["rss_before_mb"] for r in rounds if r["rss_before_mb"]], 1),
        "rss_after_mb": stats([r["rss_after_mb"] for r in rounds if r["rss_after_mb"]], 1),
        "rss_ratio": stats(ratios, 3),
        "rss_ratio_vs_uninterrupted": stats(ratios_first, 3),
        "timeline_after_kill_median_s": phases,
        "python_import_s": imports,
        "late_and_deadletter_offsets": leftovers,
        "load_average_at_start": [round(x, 2) for x in load_start],
        "load_average_at_end": [round(x, 2) for x in os.getloadavg()],
        # per-round details: in the JSON, not in BENCHMARKS.md's table (keys with "_")
        "_rounds": rounds,
        "_logs": str(work),
    }
    out["targets"] = [
        {"measure": f"worker SIGKILL to serving all partitions again, {a.episodes:,} open "
                    f"episodes (s, slowest of {len(serving)} restarts)",
         "result": worst if worst is not None else "n/a",
         "target": f"<= {TARGET_KILL_TO_SERVING_S:g}",
         "met": worst is not None and worst <= TARGET_KILL_TO_SERVING_S},
        {"measure": "worker RSS after restore / RSS before the crash (worst restart)",
         "result": worst_ratio if worst_ratio is not None else "n/a",
         "target": f"<= {TARGET_RSS_RATIO:g}",
         "met": worst_ratio is not None and worst_ratio <= TARGET_RSS_RATIO},
        {"measure": "worker RSS after restore / RSS of the never-restored worker (worst)",
         "result": max(ratios_first) if ratios_first else "n/a", "target": "(reported)",
         "met": True},
        {"measure": "records on the late and dead-letter topics",
         "result": sum(leftovers.values()), "target": "0",
         "met": sum(leftovers.values()) == 0},
    ]
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", required=True, type=Path, help="write the figures here")
    ap.add_argument("--bootstrap", help="use this broker (default: start a local one)")
    ap.add_argument("--episodes", type=int, default=20_000, help="open episodes (default 20,000)")
    ap.add_argument("--sandboxes", type=int, default=1_000)
    ap.add_argument("--partitions", type=int, default=6)
    ap.add_argument("--max-calls", type=int, default=3,
                    help="tool call/result pairs per episode: 1..N (default 3)")
    ap.add_argument("--repeat", type=int, default=3, help="kill/restart rounds (default 3)")
    ap.add_argument("--settle", type=float, default=3.0,
                    help="seconds after catching up before reading the RSS (default 3)")
    ap.add_argument("--task", default="recovery")
    ap.add_argument("--timeout", type=float, default=300.0, help="bound of every wait (s)")
    ap.add_argument("--seed", type=int, default=18)
    ap.add_argument("--dir", type=Path, help="work directory for the logs (default: a temp dir)")
    a = ap.parse_args(argv)
    a.repeat = max(1, a.repeat)
    work = a.dir or Path(tempfile.mkdtemp(prefix="bench-recovery-"))
    work.mkdir(parents=True, exist_ok=True)
    with broker_for(a.bootstrap, "bench-recovery") as bootstrap:
        res = run(a, bootstrap, work)
    a.json.write_text(json.dumps(res, indent=2, default=str) + "\n")
    s, rr = res["kill_to_serving_all_partitions_s"], res["rss_ratio"]
    first = res["uninterrupted_worker"]
    print(f"recovery: {res['input']['episodes']:,} open episodes, {a.repeat} SIGKILL/restart(s): "
          f"kill to serving all {a.partitions} partitions min/median/max "
          f"{s['min']}/{s['median']}/{s['max']} s (target <= {TARGET_KILL_TO_SERVING_S:g}); "
          f"restored {res['restored_records']['median']:,.0f} records in "
          f"{res['restore_s']['median']} s (median); RSS before {first.get('rss_mb')} MB, "
          f"after {res['rss_after_mb']['median']} MB (after/before max {rr['max']}, target "
          f"<= {TARGET_RSS_RATIO:g}); load {res['load_average_at_start']} -> "
          f"{res['load_average_at_end']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
