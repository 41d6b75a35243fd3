"""A reorder worker on an aged changelog, SIGKILLed and restarted: the time from the kill to
serving every partition again, what it restored, its RSS before and after (``kill_rounds``).
Serving: one fresh EpisodeStart per input partition, produced once the new process is
spawned, visible as a ReplaySegment to a read_committed consumer; each incarnation also
continues one restored open episode per partition (``continuation_records``: its next seq
comes out without a gap only from the restored state)."""

from __future__ import annotations

import argparse
import asyncio
import gc
import os
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

from harness.changelog import Partition
from harness.events import probe_records
from harness.figures import stats
from harness.groups import GroupWatch, ReplayWatch
from harness.kafka import Fleet, end_offsets, when_ready
from harness.procstat import proc_cpu_s, rss_mb
from harness.worker import WorkerProc, import_time, worker_env
from harness.worklog import parse_log

GROUP_SUFFIX = ".reorder"


def continuation_records(parts: list[Partition], k: int, next_seq: int, task: str
                         ) -> tuple[list[tuple[bytes, bytes, int | None]], dict[bytes, int]]:
    """The next event (a ToolCall, seq ``next_seq``) of the k-th open episode (with a state in
    the changelog: one opened by the history's last records may have none yet) of every
    changelog partition at the history's end, into the input partition of the same number
    (the core that holds its state); the replay keys. Its segment comes out at once, without a
    gap, only if the worker restored that episode's state."""
    from trajbus.bus.topics import episode_record_key
    from trajbus.schemas import models as m

    recs: list[tuple[bytes, bytes, int | None]] = []
    keys: dict[bytes, int] = {}
    for part in parts:
        sb, ep = [key for key in part.open if key in part.in_changelog][k].split("/")
        ev = m.ToolCall(header=m.Envelope(event_id=f"{ep}-{next_seq}", task=task, sandbox=sb,
                                          episode=ep, seq=next_seq,
                                          producer_id=f"sandbox/{sb}"),
                        call_id=f"c{next_seq}", tool="shell", args_hash=f"{next_seq:064x}")
        recs.append((sb.encode(), ev.encode(), part.p))
        keys[episode_record_key(sb, ep)] = part.p
    return recs, keys


def continued_ok(watch: ReplayWatch, keys: dict[bytes, int], next_seq: int) -> bool:
    from trajbus.schemas.codec import default_codec

    codec = default_codec()
    for k in keys:
        rec = codec.decode(watch.values[k]).record
        if rec["first_seq"] != next_seq or rec["gap"] is not None or rec["is_first"]:
            print(f"[restore-history] {k.decode()}: segment {rec['first_seq']}-"
                  f"{rec['last_seq']} gap {rec['gap']} is_first {rec['is_first']}: the "
                  "restored state was not used", flush=True)
            return False
    return True


def kill_rounds(args: argparse.Namespace, bootstrap: str, prefix: str, parts: list[Partition],
                aged_records: int, history_end_ms: int, next_seq: int) -> dict[str, Any]:
    """One reorder worker (``python -m trajbus worker --processors reorder --worker-id bench``,
    ``WorkerProc``) on the aged changelog, SIGKILLed and restarted ``--kills``
    times. Serving = bench_recovery's: one fresh EpisodeStart per input partition, produced once
    the new process is spawned, visible as a ReplaySegment to a read_committed consumer.
    ``parts``: the changelog's partitions, ``aged_records``: what a restore of it reads,
    ``next_seq``: the seq after the restored open episodes' last."""
    from trajbus.bus.admin import ensure_base_topics
    from trajbus.bus.settings import KafkaSettings, Settings, TopicSettings
    from trajbus.bus.topics import Topics

    P = args.partitions
    task = "bench"  # the task of the changelog's episodes (Blobs): one replay topic for all
    settings = Settings(kafka=KafkaSettings(bootstrap_servers=bootstrap),
                        topics=TopicSettings(prefix=prefix, partitions=P))
    topics = Topics(settings)
    state_topic = f"{prefix}{GROUP_SUFFIX}.state"
    # The input topics are empty and the group has no committed offsets: the worker starts
    # at their end (0), as one whose history's offsets were all committed with that state.
    asyncio.run(ensure_base_topics(settings, [task]))
    work = Path(tempfile.mkdtemp(prefix="bench-restore-history-kill-", dir=args.dir))
    worker = WorkerProc(worker_env(bootstrap, prefix, P, TRAJBUS_STATE_DIR=str(work / "state")),
                        work)
    fleet = Fleet(bootstrap, topics.sandbox_events, KafkaSettings().compression_type or "none")
    group = GroupWatch(bootstrap, prefix + GROUP_SUFFIX, topics.sandbox_events)
    replay = topics.replay(task)
    incarnations: list[dict[str, Any]] = []

    def serve(k: int, kill: bool) -> dict[str, Any]:
        """(SIGKILL the worker and) start it, probe every partition, wait until served and
        caught up; the figures of this incarnation."""
        fresh, fresh_keys = probe_records(P, task, f"k{k}-{uuid.uuid4().hex[:4]}")
        cont, cont_keys = continuation_records(parts, k, next_seq, task)
        watch = when_ready(lambda: ReplayWatch(bootstrap, replay))
        prev = worker.proc
        rss_before = rss_mb(prev.pid) if kill and prev is not None else None
        state_offsets = sum(end_offsets(bootstrap, state_topic, P).values())
        try:
            t0_wall, t0 = time.time(), time.monotonic()
            if kill:
                worker.sigkill()
            t_dead = time.monotonic()
            proc = worker.start()
            t_spawned = time.monotonic()
            fleet.produce(fresh + cont, timeout=args.kill_timeout)
            t_probes = time.monotonic()
            seen = watch.wait(set(fresh_keys) | set(cont_keys), args.kill_timeout)
            # the new process's CPU time to serving (and a little): on a shared box, the
            # load-independent part of a restart's wall time
            cpu = proc_cpu_s(proc.pid)
            cpu = None if cpu is None else round(cpu, 2)
            ok = continued_ok(watch, cont_keys, next_seq)
        finally:
            watch.close()
        group.wait_caught_up(end_offsets(bootstrap, topics.sandbox_events), proc,
                             args.kill_timeout)
        time.sleep(args.settle)
        after = rss_mb(proc.pid)
        assert worker.log_path is not None
        log = parse_log(worker.log_path, t0_wall)
        serving = max(seen[x] for x in fresh_keys) - t0
        first = min(seen[x] for x in fresh_keys) - t0
        res: dict[str, Any] = {
            "incarnation": k, "after": "SIGKILL" if kill else "first start",
            "to_serving_all_partitions_s": round(serving, 3),
            "to_first_partition_s": round(first, 3),
            "worker_cpu_s_at_serving": cpu,
            "to_continued_episodes_served_s": round(max(seen[x] for x in cont_keys) - t0, 3),
            "continued_restored_episodes": ok,
            "restored_records": log["restored_records"], "restore_s": log["restore_s"],
            "restore_lines": log["restore_lines"],
            "state_topic_offsets_at_start": state_offsets,
            "timeline_s": {"dead": round(t_dead - t0, 3), "spawned": round(t_spawned - t0, 3),
                           "probes_produced": round(t_probes - t0, 3), **log["timeline_s"],
                           "first_probe_served": round(first, 3),
                           "all_probes_served": round(serving, 3)},
            "rss_before_mb": (rss_before or {}).get("rss_mb"),
            "rss_after_mb": (after or {}).get("rss_mb"),
            "peak_rss_after_mb": (after or {}).get("peak_rss_mb"),
            "load_avg": " ".join(f"{x:.2f}" for x in os.getloadavg()),
        }
        if not kill:
            res["state_clock_behind_wall_s"] = round(t0_wall - history_end_ms / 1000, 1)
        if res["rss_before_mb"] and res["rss_after_mb"]:
            res["rss_ratio"] = round(res["rss_after_mb"] / res["rss_before_mb"], 3)
        print(f"[restore-history] {'SIGKILL' if kill else 'start'} -> serving all {P} "
              f"partitions {serving:.2f} s (first {first:.2f} s); restored "
              f"{res['restored_records']:,} records in {res['restore_s']} s (aged changelog: "
              f"{aged_records:,}); continued episodes {'ok' if ok else 'NOT OK'}; RSS "
              f"{res['rss_before_mb']} -> {res['rss_after_mb']} MB; load {res['load_avg']}",
              flush=True)
        return res

    try:
        incarnations.append(serve(0, kill=False))
        for k in range(1, args.kills + 1):
            incarnations.append(serve(k, kill=True))
    finally:
        worker.stop()
        fleet.close()
        group.close()
        gc.collect()  # librdkafka clients gone before the topics and the broker
    kills = incarnations[1:]
    serving = [r["to_serving_all_partitions_s"] for r in kills]
    ratios = [r["rss_ratio"] for r in kills if "rss_ratio" in r]
    phases = {name: stats([r["timeline_s"][name] for r in kills if name in r["timeline_s"]])
              ["median"] for name in ("first_log_line", "subscribed", "joined_group",
                                      "assigned", "restored", "all_probes_served")}
    return {
        "measure": "SIGKILL of the reorder worker -> every fresh probe (one EpisodeStart per "
                   "input partition, produced once the restarted worker, same --worker-id, was "
                   "spawned) visible as a ReplaySegment to a read_committed consumer "
                   "(bench_recovery's definition); RSS = VmRSS "
                   f"{args.settle:g} s after its group's committed offsets reached the input's "
                   "end; each incarnation also continued one restored open episode per "
                   "partition (its next seq: a segment without a gap only from its state)",
        "aged_changelog_records": aged_records,
        "kill_to_serving_all_partitions_s": serving,
        "kill_to_serving_stats_s": stats(serving),
        "kill_to_first_partition_s": [r["to_first_partition_s"] for r in kills],
        "worker_cpu_s_at_serving": [r["worker_cpu_s_at_serving"] for r in kills],
        "restored_records": [r["restored_records"] for r in incarnations],
        "restore_s": [r["restore_s"] for r in incarnations],
        "restored_the_aged_changelog": all(r["restored_records"] >= aged_records
                                           for r in incarnations),
        "continued_restored_episodes": all(r["continued_restored_episodes"]
                                           for r in incarnations),
        "rss_first_start_mb": incarnations[0]["rss_after_mb"],
        "rss_before_kill_mb": [r["rss_before_mb"] for r in kills],
        "rss_after_restore_mb": [r["rss_after_mb"] for r in kills],
        "rss_ratio": ratios,
        "timeline_after_kill_median_s": phases,
        "python_import_s": import_time(),
        "load_avg": [r["load_avg"] for r in kills],
        "_incarnations": incarnations,
        "_logs": str(work),
    }
