"""Emitter throughput vs Kafka's own ProducerPerformance, same broker, same record size.

    python bench/bench_emitter.py --bootstrap 127.0.0.1:9092 --json out.json

Runs, in one go: SandboxEmitter publishing ~200-byte events and 256 KiB trace chunks (through
the full path: redaction, Avro encoding, write-ahead journal with fsync group commit, the one
shared idempotent producer, waiting for every ack), then
``org.apache.kafka.tools.ProducerPerformance`` (acks=all, idempotence on, same linger, batch
size and compression) with the same record sizes against the same topics. Prints the ratios.
Goals: >= 0.5x ProducerPerformance records/s for small events, >= 0.8x MB/s for 256 KiB.
The 256 KiB emitter run is repeated with ``durability="os"`` (journal written, not fsynced)
to show the fsync's share (context, not a target: the default keeps fsync).

Two more peers on the same records, broker and topic, for context (not targets): the bare
aiokafka producer (pre-encoded values, futures gathered: the floor of any aiokafka-based
emitter) and confluent-kafka (librdkafka, the C client most Python shops would reach for). The
confluent-kafka rows are skipped, with a note, when the package is not installed (it is in
the ``bench`` extra: ``pip install -e '.[bench]'``).
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
                       payload: int, durability: str,
                       barrier: Any = None) -> dict[str, Any]:
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
    if barrier is not None:  # several processes: start timing together
        await barrier()
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


async def _child(args: argparse.Namespace) -> None:
    """One emitting process of ``--processes``: warm up, say ready, wait for go, run."""
    from trajbus.bus.producer import close_producer
    from trajbus.bus.topics import Topics
    from trajbus.producers.testing import make_settings

    settings = make_settings(args.bootstrap, args.child_prefix, partitions=args.partitions,
                             queue_max_events=args.queue, queue_full_timeout_s=300.0)

    async def barrier() -> None:
        print("ready", flush=True)
        await asyncio.to_thread(sys.stdin.readline)

    res = await _emitter_run(settings, Topics(settings), f"small-p{args.child_index}",
                             args.small_count // args.processes, args.sandboxes,
                             args.small_payload, args.durability, barrier)
    await close_producer()
    print(json.dumps(res), flush=True)


def _emitter_processes(args: argparse.Namespace, prefix: str) -> dict[str, Any]:
    """The small-event run split over ``args.processes`` emitter processes started together
    (sandboxes run one emitter each in production: one process per core is the machine's
    capacity, as ProducerPerformance uses both cores with its two threads)."""
    procs = []
    for i in range(args.processes):
        cmd = [sys.executable, __file__, "--bootstrap", args.bootstrap, "--child-prefix", prefix,
               "--child-index", str(i), "--processes", str(args.processes),
               "--small-count", str(args.small_count), "--small-payload",
               str(args.small_payload), "--sandboxes", str(args.sandboxes), "--partitions",
               str(args.partitions), "--queue", str(args.queue), "--durability",
               args.durability]
        procs.append(subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                      text=True))
    for p in procs:
        assert p.stdout is not None and p.stdout.readline().strip() == "ready"
    for p in procs:
        assert p.stdin is not None
        p.stdin.write("go\n")
        p.stdin.flush()
    runs = []
    for p in procs:
        out, _ = p.communicate(timeout=900)
        runs.append(json.loads(out.strip().splitlines()[-1]))
    n = sum(r["records"] for r in runs)
    elapsed = max(r["seconds"] for r in runs)
    return {"processes": args.processes, "records": n, "record_bytes": runs[0]["record_bytes"],
            "seconds": elapsed, "records_per_s": n / elapsed,
            "all_acked": all(r["all_acked"] for r in runs),
            "sandboxes": args.sandboxes * args.processes}


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


def _confluent(bootstrap: str, topic: str, count: int, size: int,
               kafka: Any) -> dict[str, Any]:
    """confluent-kafka (librdkafka) producing ``count`` random records of ``size`` bytes, with
    the same acks, idempotence, linger, batch size and compression as the others."""
    try:
        from confluent_kafka import Producer
    except ImportError:
        return {"skipped": "confluent-kafka is not installed (pip install confluent-kafka, "
                           "or the 'bench' extra)"}
    conf = {"bootstrap.servers": bootstrap, "acks": "all", "enable.idempotence": True,
            "linger.ms": kafka.linger_ms, "batch.size": kafka.max_batch_size,
            "message.max.bytes": kafka.max_request_size,
            "compression.type": kafka.compression_type or "none",
            "queue.buffering.max.kbytes": 1_048_576, "queue.buffering.max.messages": 1_000_000}
    producer = Producer(conf)
    value = os.urandom(size)
    errors = 0

    def on_delivery(err: Any, _msg: Any) -> None:
        nonlocal errors
        if err is not None:
            errors += 1

    producer.produce(topic, value, on_delivery=on_delivery)  # warm-up: metadata, connections
    producer.flush(30)
    t0 = time.perf_counter()
    for _ in range(count):
        while True:
            try:
                producer.produce(topic, value, on_delivery=on_delivery)
                break
            except BufferError:
                producer.poll(0.005)
        producer.poll(0)
    left = producer.flush(300)
    elapsed = time.perf_counter() - t0
    return {"records": count, "record_bytes": size, "seconds": elapsed,
            "records_per_s": count / elapsed, "mb_per_s": count * size / elapsed / 1e6,
            "errors": errors, "unflushed": left}


async def _aiokafka_raw(settings: Any, topic: str, count: int, size: int) -> dict[str, Any]:
    """The bare shared aiokafka producer with pre-built values, send futures gathered in
    chunks: no encoding, journal or bookkeeping (what the emitter's send loop costs on top)."""
    from trajbus.bus.producer import close_producer, get_producer

    producer = await get_producer(settings.kafka)
    value = os.urandom(size)
    await (await producer.send(topic, value))
    t0 = time.perf_counter()
    pending = []
    for i in range(count):
        pending.append(await producer.send(topic, value, key=b"sb-%d" % (i % 8)))
        if len(pending) >= 5000:
            await asyncio.gather(*pending)
            pending = []
    await asyncio.gather(*pending)
    elapsed = time.perf_counter() - t0
    await close_producer()
    return {"records": count, "record_bytes": size, "seconds": elapsed,
            "records_per_s": count / elapsed, "mb_per_s": count * size / elapsed / 1e6}


def targets(res: dict[str, Any]) -> list[dict[str, Any]]:
    small, large = res["ratio_small_records_per_s"], res["ratio_256k_mb_per_s"]
    return [
        {"measure": "emitter / ProducerPerformance records/s (small events)",
         "result": round(small, 3), "target": ">= 0.5", "met": small >= 0.5},
        *([{"measure": "emitters, one process per core / ProducerPerformance records/s "
                        "(small events)",
            "result": round(res["ratio_small_records_per_s_processes"], 3),
            "target": ">= 0.5", "met": res["ratio_small_records_per_s_processes"] >= 0.5}]
          if "ratio_small_records_per_s_processes" in res else []),
        {"measure": "emitter / ProducerPerformance MB/s (256 KiB chunks)",
         "result": round(large, 3), "target": ">= 0.8", "met": large >= 0.8},
    ]


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    from trajbus.bus.producer import close_producer
    from trajbus.bus.topics import Topics
    from trajbus.producers.testing import create_topics, make_settings

    prefix = f"bench-{uuid.uuid4().hex[:8]}"
    # Backpressure, not failure: on a loaded box acks can stall for seconds and the default
    # 5 s queue-full timeout (right for a sandbox) would abort a throughput run.
    settings = make_settings(args.bootstrap, prefix, partitions=args.partitions,
                             queue_max_events=args.queue, queue_full_timeout_s=300.0)
    topics = Topics(settings)
    await create_topics(settings, [topics.sandbox_events, topics.trace_chunks])
    results: dict[str, Any] = {"bootstrap": args.bootstrap, "cpus": os.cpu_count()}
    small = await _emitter_run(settings, topics, "small", args.small_count, args.sandboxes,
                               args.small_payload, args.durability)
    large = await _emitter_run(settings, topics, "large", args.large_count, args.sandboxes,
                               256 * 1024, args.durability)
    multi = None
    if args.processes > 1:
        multi = await asyncio.to_thread(_emitter_processes, args, prefix)
    # Context for the 256 KiB goal: the same run with the journal written but not fsynced
    # (durability="os"), to show what the write-ahead journal's fsync costs at this size.
    large_os = None
    if args.durability == "fsync":
        large_os = await _emitter_run(settings, topics, "large-os", args.large_count,
                                      args.sandboxes, 256 * 1024, "os")
    await close_producer()
    results["emitter_small"] = small
    if multi is not None:
        results[f"emitter_small_{args.processes}_processes"] = multi
    results["emitter_256k"] = large
    if large_os is not None:
        results["emitter_256k_durability_os"] = large_os
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
    if multi is not None:
        results["ratio_small_records_per_s_processes"] = (
            multi["records_per_s"] / results["java_small"]["records_per_s"])
    if large_os is not None:
        results["ratio_256k_mb_per_s_durability_os"] = (
            large_os["mb_per_s"] / results["java_256k"]["mb_per_s"])
    results["goals"] = {"small_records_per_s_ratio": 0.5, "large_mb_per_s_ratio": 0.8}
    results["aiokafka_raw_small"] = await _aiokafka_raw(settings, topics.trace_chunks,
                                                        args.small_count, small["record_bytes"])
    results["confluent_small"] = await asyncio.to_thread(
        _confluent, args.bootstrap, topics.trace_chunks, args.small_count,
        small["record_bytes"], k)
    results["confluent_256k"] = await asyncio.to_thread(
        _confluent, args.bootstrap, topics.trace_chunks, args.large_count,
        large["record_bytes"], k)
    if "skipped" not in results["confluent_small"]:
        results["ratio_small_vs_confluent"] = (small["records_per_s"]
                                               / results["confluent_small"]["records_per_s"])
        results["ratio_256k_vs_confluent"] = (large["mb_per_s"]
                                              / results["confluent_256k"]["mb_per_s"])
    results["load_average_1m"] = round(os.getloadavg()[0], 2)
    results["targets"] = targets(results)
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
    ap.add_argument("--processes", type=int, default=os.cpu_count() or 1,
                    help="also run the small events from this many emitter processes at once "
                    "(default: one per core)")
    ap.add_argument("--child-prefix", help=argparse.SUPPRESS)
    ap.add_argument("--child-index", type=int, default=0, help=argparse.SUPPRESS)
    args = ap.parse_args()
    sys.path.insert(0, str(ROOT))
    if args.child_prefix:
        asyncio.run(_child(args))
        return 0
    res = asyncio.run(main_async(args))
    s, j = res["emitter_small"], res["java_small"]
    ls, lj = res["emitter_256k"], res["java_256k"]
    print(f"small ({s['record_bytes']} B): emitter {s['records_per_s']:,.0f} rec/s "
          f"({s['mb_per_s']:.1f} MB/s) vs ProducerPerformance {j['records_per_s']:,.0f} rec/s "
          f"-> ratio {res['ratio_small_records_per_s']:.2f} (goal >= 0.5)")
    print(f"256 KiB: emitter {ls['mb_per_s']:.1f} MB/s ({ls['records_per_s']:.0f} rec/s) vs "
          f"ProducerPerformance {lj['mb_per_s']:.1f} MB/s -> ratio "
          f"{res['ratio_256k_mb_per_s']:.2f} (goal >= 0.8)")
    if "ratio_small_records_per_s_processes" in res:
        m = res[f"emitter_small_{args.processes}_processes"]
        print(f"small, {args.processes} emitter processes: {m['records_per_s']:,.0f} rec/s -> "
              f"ratio {res['ratio_small_records_per_s_processes']:.2f}")
    raw = res["aiokafka_raw_small"]
    print(f"bare aiokafka, small: {raw['records_per_s']:,.0f} rec/s")
    cs, cl = res["confluent_small"], res["confluent_256k"]
    if "skipped" in cs:
        print(f"confluent-kafka: skipped ({cs['skipped']})")
    else:
        print(f"confluent-kafka (librdkafka): small {cs['records_per_s']:,.0f} rec/s, 256 KiB "
              f"{cl['mb_per_s']:.1f} MB/s")
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
