"""Failover: how long the trainer's stream stalls when a node of a 3-node cluster dies.

    python bench/bench_failover.py --json out.json [--rounds 3] [--rate 500]

A fresh local 3-node cluster (replication factor 3, min.insync.replicas 2, the brokers'
``broker.session.timeout.ms`` 4 s), one reorder worker (``trajbus worker --processors
reorder``), a producer subprocess driving sandbox emitters at ``--rate`` events/s
(bench_e2e.py's), and a trainer (:class:`ReplayClient`, per-ack commits) in this process. Each
round SIGKILLs the leader of the busiest replay partition, starts it again 10 s later, and
lets the stream settle. Measured per round, from the trainer's receipts:

- **stall**: the longest time without any delivery to the trainer from the kill on (the
  worker's transactions span every partition, so one dead leader holds up the whole stream
  until its partitions have a new leader);
- **first event emitted after the kill, delivered**: when the trainer got the first event
  stamped after the kill, minus the kill (end-to-end recovery).

The goal (issue 36): stall <= the brokers' failover time + 2 s. The failover time is taken as
the brokers' session timeout (the controller fences a dead broker after it, then elects new
leaders) -- 4 s for the local cluster, 9 s with Kafka's defaults.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

SESSION_TIMEOUT_MS = 4000  # LocalBroker's broker.session.timeout.ms


async def run(args: argparse.Namespace) -> dict[str, Any]:
    from trajbus.bus.admin import ensure_base_topics
    from trajbus.bus.inventory import partition_leaders
    from trajbus.bus.settings import KafkaSettings, Settings, TopicSettings
    from trajbus.bus.topics import Topics
    from trajbus.consumers.replay.client import ReplayClient
    from trajbus.infra.cluster import LocalCluster

    work = Path(tempfile.mkdtemp(prefix="bench-failover-"))
    cluster = LocalCluster(work / "cluster", 3, base_port=0)
    cluster.start(timeout=180)
    prefix = f"fo{uuid.uuid4().hex[:6]}"
    settings = Settings(kafka=KafkaSettings(bootstrap_servers=cluster.bootstrap),
                        topics=TopicSettings(prefix=prefix, partitions=6,
                                             replication_factor=3))
    task = "bench"
    await ensure_base_topics(settings, [task])
    replay_topic = Topics(settings).replay(task)
    env = {**os.environ, "TRAJBUS_KAFKA__BOOTSTRAP_SERVERS": cluster.bootstrap,
           "TRAJBUS_TOPICS__PREFIX": prefix, "TRAJBUS_TOPICS__PARTITIONS": "6",
           "TRAJBUS_TOPICS__REPLICATION_FACTOR": "3"}
    worker_log = open(work / "worker.log", "ab")
    worker = subprocess.Popen([sys.executable, "-m", "trajbus", "worker", "--processors",
                               "reorder", "--worker-id", "bench", "-v"], env=env,
                              stdout=worker_log, stderr=worker_log)
    per_round_s = 40.0
    # enough events for the warm-up, every round and its settling time, and a margin: a
    # producer that ran dry would look like a stream that never recovered
    events = int(args.rate * (12 + (per_round_s + 12) * args.rounds + 30))
    producer = subprocess.Popen(
        [sys.executable, str(HERE / "bench_e2e.py"), "--produce", "--bootstrap",
         cluster.bootstrap, "--prefix", prefix, "--task", task, "--phase", "fo",
         "--rate", str(args.rate), "--events", str(events), "--sandboxes", "20",
         "--steps", "10", "--partitions", "6"],
        env=env, stdout=subprocess.DEVNULL, stderr=open(work / "producer.log", "ab"))
    receipts: list[tuple[float, float]] = []  # (receipt wall ms, event time ms)
    stop = asyncio.Event()

    async def trainer() -> None:
        async with ReplayClient([task], f"{prefix}-trainer", settings,
                                start="earliest") as client:
            async for seg in client.segments():
                now = time.time() * 1000
                for ev in seg.events:
                    receipts.append((now, ev.header["event_time_ms"]))
                await client.ack(seg)
                if stop.is_set():
                    return

    reader = asyncio.create_task(trainer())
    rounds: list[dict[str, Any]] = []
    try:
        await asyncio.sleep(12)  # the stream flows
        for r in range(args.rounds):
            leaders = await partition_leaders(settings, replay_topic)
            node = max(set(leaders.values()), key=lambda n: sum(1 for v in leaders.values()
                                                                if v == n))
            kill_ms = time.time() * 1000
            await asyncio.to_thread(cluster.kill_node, node)
            await asyncio.sleep(10)
            await asyncio.to_thread(cluster.start_node, node, 120)
            await asyncio.sleep(per_round_s - 10 - 12)
            measured_ms = time.time() * 1000
            after = sorted(t for t, _ in receipts if t >= kill_ms - 1000)
            # a stall still going on when the round is measured counts up to that moment
            marks = [kill_ms, *[t for t in after if t >= kill_ms], measured_ms]
            stall = max((b - a for a, b in itertools.pairwise(marks)), default=None)
            post = [t for t, ev_t in receipts if ev_t >= kill_ms]
            rounds.append({"round": r + 1, "node": node,
                           "stall_ms": round(stall) if stall is not None else None,
                           "first_post_kill_event_ms": round(min(post) - kill_ms) if post
                           else None})
            print(f"[failover] round {r + 1}: node {node} killed; stall "
                  f"{rounds[-1]['stall_ms']} ms; first event emitted after the kill "
                  f"delivered after {rounds[-1]['first_post_kill_event_ms']} ms", flush=True)
            await asyncio.sleep(12)
    finally:
        stop.set()
        producer.terminate()
        worker.terminate()
        for p in (producer, worker):
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()
        reader.cancel()
        await asyncio.gather(reader, return_exceptions=True)
        cluster.stop()
    stalls = [r["stall_ms"] for r in rounds if r["stall_ms"] is not None]
    goal = SESSION_TIMEOUT_MS + 2000
    met = bool(stalls) and len(stalls) == len(rounds) and max(stalls) <= goal
    return {"rate": args.rate, "rounds": rounds, "session_timeout_ms": SESSION_TIMEOUT_MS,
            "goal_stall_ms": goal,
            "stall_ms_median": statistics.median(stalls) if stalls else None,
            "stall_ms_max": max(stalls) if stalls else None,
            "targets": [{"measure": f"trainer's stall after the SIGKILL of a replay leader "
                                    f"(3-node cluster, {args.rate} events/s; max of "
                                    f"{len(rounds)} rounds)",
                         "result": f"{max(stalls):,.0f} ms" if stalls else "no stall measured",
                         "target": f"<= broker session timeout ({SESSION_TIMEOUT_MS:,} ms) "
                                   f"+ 2 s = {goal:,} ms", "met": met}],
            "date": time.strftime("%Y-%m-%d")}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--rate", type=int, default=500, help="events/s offered (default 500)")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    res = asyncio.run(run(args))
    print(json.dumps(res, indent=2))
    if args.json:
        args.json.write_text(json.dumps(res, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
