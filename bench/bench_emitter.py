"""Emitter throughput vs Kafka's own ProducerPerformance, same broker, same record size.

    python bench/bench_emitter.py --bootstrap 127.0.0.1:9092 --json out.json

Runs, in one go: SandboxEmitter publishing ~200-byte events and 256 KiB trace chunks (through
the full path: redaction, Avro encoding, write-ahead journal with fsync group commit, the one
shared idempotent producer, waiting for every ack), then
``org.apache.kafka.tools.ProducerPerformance`` (acks=all, idempotence on, same linger, batch
size and compression) with the same record sizes against the same topics. Prints the ratios.
Goals: >= 0.5x ProducerPerformance records/s for small events, >= 0.8x MB/s for 256 KiB.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent


async def _emitter_run(settings: Any, topics: Any, kind: str, count: int, sandboxes: int,
                       payload: int, durability: str) -> dict[str, Any]:
    from trajbus.producers.emitter import SandboxEmitter

    state = Path(tempfile.mkdtemp(prefix=f"bench-{kind}-"))
    ems = []
    for i in range(sandboxes):
        em = SandboxEmitter(f"bench-{kind}-{i}", "bench", settings=settings,
                            state_dir=state / str(i), durability=durability,
                            queue_policy="block")
        await em.start()
        await em.start_episode("e")
        ems.append(em)
    data = os.urandom(payload // 2).hex().encode()[:payload]
    per = count // sandboxes
    value_bytes = 0

    async def drive(em: Any) -> None:
        nonlocal value_bytes
        off = 0
        for _ in range(per):
            await em.trace_chunk("e", data, file_offset=off)
            off += len(data)

    # one warm-up event each (connections, metadata)
    assert all([await em.flush(30) for em in ems])
    t0 = time.perf_counter()
    await asyncio.gather(*(drive(em) for em in ems))
    ok = all([await em.flush(300) for em in ems])
    elapsed = time.perf_counter() - t0
    # record size on the wire (Avro value) for the comparison
    from trajbus.schemas.models import Envelope, TraceChunk

    sample = TraceChunk(header=Envelope(task="bench", sandbox="bench-x-0", episode="e", seq=1,
                                        producer_id=ems[0].producer_id),
                        file_offset=0, length=len(data), sha256="0" * 64, data=data).encode()
    value_bytes = len(sample)
    for em in ems:
        await em.close(30)
    shutil.rmtree(state, ignore_errors=True)
    n = per * sandboxes
    return {"records": n, "record_bytes": value_bytes, "seconds": elapsed, "all_acked": ok,
            "records_per_s": n / elapsed, "mb_per_s": n * value_bytes / elapsed / 1e6,
            "sandboxes": sandboxes, "durability": durability}


def _producer_perf(bootstrap: str, topic: str, count: int, size: int,
                   kafka: Any) -> dict[str, Any]:
    lib = ROOT / "infra" / "kafka" / "lib"
    props = [f"bootstrap.servers={bootstrap}", "acks=all", "enable.idempotence=true",
             f"linger.ms={kafka.linger_ms}", f"batch.size={kafka.max_batch_size}",
             f"max.request.size={kafka.max_request_size}",
             f"compression.type={kafka.compression_type or 'none'}"]
    cmd = ["java", "-Xmx1g", "-cp", f"{lib}/*", "org.apache.kafka.tools.ProducerPerformance",
           "--topic", topic, "--num-records", str(count), "--record-size", str(size),
           "--throughput", "-1", "--producer-props", *props]
    t0 = time.perf_counter()
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=900, check=False)
    wall = time.perf_counter() - t0
    lines = [ln for ln in out.stdout.splitlines() if "records sent" in ln]
    if out.returncode != 0 or not lines:
        raise RuntimeError(f"ProducerPerformance failed ({out.returncode}):\n"
                           f"{out.stdout[-2000:]}\n{out.stderr[-2000:]}")
    m = re.search(r"(\d+) records sent, ([\d.]+) records/sec \(([\d.]+) MB/sec\)", lines[-1])
    assert m, lines[-1]
    return {"records": int(m.group(1)), "record_bytes": size,
            "records_per_s": float(m.group(2)), "mb_per_s": float(m.group(3)) * 1.048576,
            "wall_seconds": wall, "summary": lines[-1]}


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    from trajbus.bus.producer import close_producer
    from trajbus.bus.topics import Topics
    from trajbus.producers.testing import create_topics, make_settings

    prefix = f"bench-{uuid.uuid4().hex[:8]}"
    settings = make_settings(args.bootstrap, prefix, partitions=args.partitions,
                             queue_max_events=args.queue)
    topics = Topics(settings)
    await create_topics(settings, [topics.sandbox_events, topics.trace_chunks])
    results: dict[str, Any] = {"bootstrap": args.bootstrap, "cpus": os.cpu_count()}
    small = await _emitter_run(settings, topics, "small", args.small_count, args.sandboxes,
                               args.small_payload, args.durability)
    large = await _emitter_run(settings, topics, "large", args.large_count, args.sandboxes,
                               256 * 1024, args.durability)
    await close_producer()
    results["emitter_small"] = small
    results["emitter_256k"] = large
    k = settings.kafka
    results["java_small"] = await asyncio.to_thread(
        _producer_perf, args.bootstrap, topics.trace_chunks, args.small_count,
        small["record_bytes"], k)
    results["java_256k"] = await asyncio.to_thread(
        _producer_perf, args.bootstrap, topics.trace_chunks, args.large_count,
        large["record_bytes"], k)
    results["ratio_small_records_per_s"] = (small["records_per_s"]
                                            / results["java_small"]["records_per_s"])
    results["ratio_256k_mb_per_s"] = large["mb_per_s"] / results["java_256k"]["mb_per_s"]
    results["goals"] = {"small_records_per_s_ratio": 0.5, "large_mb_per_s_ratio": 0.8}
    return results


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--bootstrap", required=True)
    ap.add_argument("--json", default=None)
    ap.add_argument("--small-count", type=int, default=100_000)
    ap.add_argument("--small-payload", type=int, default=60,
                    help="trace bytes per small event (the Avro event is ~200 bytes)")
    ap.add_argument("--large-count", type=int, default=800)
    ap.add_argument("--sandboxes", type=int, default=8)
    ap.add_argument("--partitions", type=int, default=6)
    ap.add_argument("--queue", type=int, default=10_000)
    ap.add_argument("--durability", choices=["fsync", "os"], default="fsync")
    args = ap.parse_args()
    sys.path.insert(0, str(ROOT))
    res = asyncio.run(main_async(args))
    s, j = res["emitter_small"], res["java_small"]
    ls, lj = res["emitter_256k"], res["java_256k"]
    print(f"small ({s['record_bytes']} B): emitter {s['records_per_s']:,.0f} rec/s "
          f"({s['mb_per_s']:.1f} MB/s) vs ProducerPerformance {j['records_per_s']:,.0f} rec/s "
          f"-> ratio {res['ratio_small_records_per_s']:.2f} (goal >= 0.5)")
    print(f"256 KiB: emitter {ls['mb_per_s']:.1f} MB/s ({ls['records_per_s']:.0f} rec/s) vs "
          f"ProducerPerformance {lj['mb_per_s']:.1f} MB/s -> ratio "
          f"{res['ratio_256k_mb_per_s']:.2f} (goal >= 0.8)")
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
