"""The end-to-end bench's minimal peer pipeline: a confluent-kafka idempotent producer
(``produce_peer``, run as ``bench_e2e.py --produce-peer``) -> broker -> the minimal
consume/reorder/produce loop with ~100 ms transactions and a changelog (``bench_worker.py
--peer confluent-txn``, ``peers.reorder_loop``) -> a read_committed confluent-kafka consumer
(``PeerConsumer``); same broker, same event shapes and offered rates as trajbus
(``peer_pipeline``, one offered rate: ``peer_phase``)."""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from harness.events import event_templates, write_schemas
from harness.kafka import create_topics
from harness.procstat import proc_cpu_s
from harness.trainer import Sink, now_ms, phase_report, wait_for_events
from harness.worker import ROOT, stop_process

BENCH = ROOT / "bench"


def produce_peer(args: argparse.Namespace) -> dict[str, Any]:
    """``--produce-peer``: the peer's sending side. One confluent-kafka idempotent producer
    (acks=all, the worker's compression, linger 5 ms); the same events as :func:`produce`
    (same shapes, sandboxes, steps and pacing), encoded with the trajbus codec and stamped with
    their creation time; no journal, redaction or per-event acknowledgement. Prints JSON."""
    import hashlib

    from confluent_kafka import Producer

    from trajbus.bus.settings import KafkaSettings
    from trajbus.schemas.codec import default_codec

    encode = default_codec().encode
    t_start, t_call, t_res, t_end = event_templates()
    p = Producer({"bootstrap.servers": args.bootstrap, "enable.idempotence": True, "acks": "all",
                  "compression.type": KafkaSettings().compression_type or "none",
                  "linger.ms": 5, "partitioner": "murmur2_random",
                  "queue.buffering.max.messages": 1_000_000})
    canon_args = json.dumps({"cmd": "pytest -x tests/test_parser.py", "cwd": "/work/repo",
                             "timeout": 60}, sort_keys=True, separators=(",", ":"))
    canon_res = json.dumps({"stdout": "3 passed in 0.41s", "rc": 0}, sort_keys=True,
                           separators=(",", ":"))
    call_fields = {"tool": "shell", "args_canonical": canon_args, "args_summary": canon_args[:40],
                   "args_hash": hashlib.sha256(canon_args.encode()).hexdigest()}
    res_fields = {"tool": "shell", "result_canonical": canon_res, "duration_ms": 410,
                  "result_summary": canon_res[:40],
                  "result_hash": hashlib.sha256(canon_res.encode()).hexdigest()}
    sandboxes = [f"{args.phase}-sb{i:04d}" for i in range(args.sandboxes)]
    cur: list[list[Any]] = [[None, 0, 0] for _ in sandboxes]  # episode, steps done, counter
    topic, task = args.peer_topic, args.task

    def send(k: int, template: dict[str, Any], kind: str, seq: int, **extra: Any) -> None:
        sb, ep = sandboxes[k], cur[k][0]
        rec = dict(template)
        rec["header"] = {"event_id": f"{sb}-{ep}-{seq}", "task": task, "sandbox": sb,
                         "episode": ep, "seq": seq, "event_time_ms": int(now_ms()),
                         "producer_id": f"peer/{sb}", "policy_version": None}
        rec.update(extra)
        while True:
            try:
                p.produce(topic, encode(kind, rec), key=sb.encode())
                break
            except BufferError:
                p.poll(0.01)
        p.poll(0)

    # connection, metadata and the idempotent producer id before the clock starts (as the
    # emitters' start()): one record with the tick key, which the loop skips
    p.produce(topic, b"", key=b"_tick", partition=0)
    if p.flush(60):
        raise RuntimeError("peer producer: warm-up record not acknowledged in 60 s")
    rate, n, i = args.rate, 0, 0
    cpu0 = time.process_time()
    t_first = now_ms()
    t0 = time.perf_counter()
    while n < args.events:
        if rate > 0:  # paced: event n is due at t0 + n / rate
            ahead = t0 + n / rate - time.perf_counter()
            if ahead > 0.001:
                time.sleep(ahead)
        k = i % len(sandboxes)
        i += 1
        st = cur[k]
        if st[0] is None:
            st[0], st[1] = f"{args.phase}-ep{k}-{st[2]}", 0
            st[2] += 1
            send(k, t_start, "EpisodeStart", 0)
        elif st[1] >= 2 * args.steps:
            send(k, t_end, "EpisodeEnd", st[1] + 1)
            st[0] = None
        elif st[1] % 2 == 0:
            send(k, t_call, "ToolCall", st[1] + 1, call_id=f"c{st[1]}", **call_fields)
            st[1] += 1
        else:
            send(k, t_res, "ToolResult", st[1] + 1, call_id=f"c{st[1] - 1}", **res_fields)
            st[1] += 1
        n += 1
    t_last_emit = now_ms()
    for k, st in enumerate(cur):  # close open episodes
        if st[0] is not None:
            send(k, t_end, "EpisodeEnd", st[1] + 1)
            st[0] = None
            n += 1
    acked = p.flush(120) == 0
    cpu = time.process_time() - cpu0
    return {"events": n, "t_first_emit_ms": t_first, "t_last_emit_ms": t_last_emit,
            "t_all_acked_ms": now_ms(), "all_acked": acked, "cpu_s": round(cpu, 3),
            "emit_events_per_s": round(n / max(1e-9, (t_last_emit - t_first) / 1000)),
            "events_per_cpu_s": round(n / max(cpu, 1e-9))}


class PeerConsumer:
    """The peer's trainer side: a read_committed confluent-kafka consumer in a thread; offsets
    committed (asynchronously) at most every 100 ms. Records each event's latency (receipt -
    event_time_ms) and its split at the output record's timestamp (the loop's produce)."""

    def __init__(self, bootstrap: str, topic: str, group: str) -> None:
        import threading

        self.bootstrap, self.topic, self.group = bootstrap, topic, group
        self.sinks: dict[str, Sink] = {}
        self.seen: dict[str, set[tuple[str, int]]] = {}
        self.duplicates: dict[str, int] = {}
        self.assigned = threading.Event()
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self._run, name="peer-consumer", daemon=True)

    async def start(self) -> None:
        self.thread.start()
        for _ in range(600):
            if self.assigned.is_set():
                return
            await asyncio.sleep(0.05)
        raise RuntimeError("peer consumer: no partitions assigned in 30 s")

    def _run(self) -> None:
        from confluent_kafka import Consumer

        from trajbus.schemas.codec import default_codec

        decode = default_codec().decode
        c = Consumer({"bootstrap.servers": self.bootstrap, "group.id": self.group,
                      "isolation.level": "read_committed", "auto.offset.reset": "earliest",
                      "enable.auto.commit": False})
        c.subscribe([self.topic], on_assign=lambda _c, _parts: self.assigned.set())
        last_commit = 0.0
        try:
            while not self.stopping.is_set():
                msgs = c.consume(1000, 0.05)
                t = now_ms()
                for msg in msgs:
                    if msg.error() is not None:
                        continue
                    h = decode(msg.value() or b"").header
                    phase = h["episode"].split("-", 1)[0]
                    sink = self.sinks.setdefault(phase, Sink())
                    seen = self.seen.setdefault(phase, set())
                    key = (h["episode"], h["seq"])
                    if key in seen:
                        self.duplicates[phase] = self.duplicates.get(phase, 0) + 1
                        continue
                    seen.add(key)
                    if not sink.first_ms:
                        sink.first_ms = t
                    sink.last_ms = t
                    sink.events += 1
                    sink.latencies_ms.append(t - h["event_time_ms"])
                    ts = msg.timestamp()[1]
                    sink.to_worker_ms.append(ts - h["event_time_ms"])
                    sink.to_trainer_ms.append(t - ts)
                if msgs and time.monotonic() - last_commit >= 0.1:
                    c.commit(asynchronous=True)
                    last_commit = time.monotonic()
        finally:
            c.close()

    async def wait_for(self, phase: str, events: int, timeout: float) -> bool:
        return await wait_for_events(self.sinks, phase, events, timeout)

    async def stop(self) -> None:
        self.stopping.set()
        await asyncio.to_thread(self.thread.join, 30)


async def peer_phase(args: argparse.Namespace, topic: str, consumer: PeerConsumer,
                     loop_pid: int, rate: int, events: int, phase: str) -> dict[str, Any]:
    cmd = [sys.executable, str(BENCH / "bench_e2e.py"), "--produce-peer", "--bootstrap",
           args.bootstrap, "--peer-topic", topic, "--task", "bench-peer", "--phase", phase,
           "--rate", str(rate), "--events", str(events), "--sandboxes", str(args.sandboxes),
           "--steps", str(args.steps)]
    def loop_cpu() -> float:
        return proc_cpu_s(loop_pid, children=True) or 0.0

    l_cpu0, c_cpu0 = loop_cpu(), time.process_time()
    proc = await asyncio.create_subprocess_exec(*cmd, stdout=asyncio.subprocess.PIPE,
                                                stderr=asyncio.subprocess.PIPE, cwd=ROOT)
    out, err = await proc.communicate()
    if proc.returncode != 0:
        raise RuntimeError(f"peer producer failed ({proc.returncode}): {err.decode()[-2000:]}")
    prod = json.loads(out.decode().strip().splitlines()[-1])
    total = prod["events"]
    ok = await consumer.wait_for(phase, total, timeout=max(60.0, total / 2000))
    l_cpu, c_cpu = loop_cpu() - l_cpu0, time.process_time() - c_cpu0
    sink = consumer.sinks.get(phase, Sink())
    return phase_report(rate, prod, ok, sink, ("loop", l_cpu), ("consumer", c_cpu),
                        {"duplicates": consumer.duplicates.get(phase, 0)})


async def peer_pipeline(args: argparse.Namespace, prefix: str) -> dict[str, Any]:
    """The minimal peer pipeline at the same offered rates as trajbus (see the comment above)."""
    from trajbus.bus.settings import KafkaSettings

    name = f"{prefix}-peer"
    in_topic, out_topic, state_topic = f"{name}.in", f"{name}.out", f"{name}.state"
    create_topics(args.bootstrap, [in_topic, out_topic], args.partitions)
    create_topics(args.bootstrap, [state_topic], args.partitions, compacted=True)
    work = Path(tempfile.mkdtemp(prefix="bench-e2e-peer-"))
    write_schemas(work / "schemas.json")
    log = open(work / "loop.log", "ab")
    loop = subprocess.Popen([
        sys.executable, str(BENCH / "bench_worker.py"), "--peer", "confluent-txn",
        "--bootstrap", args.bootstrap, "--group", f"{name}.loop", "--in-topics", in_topic,
        "--out-topic", out_topic, "--state-topic", state_topic,
        "--schemas", str(work / "schemas.json"),
        "--compression", KafkaSettings().compression_type or "none", "--idle", "1e9",
        "--txn-interval-ms", str(args.peer_txn_interval_ms)], stdout=log, stderr=log, cwd=ROOT)
    consumer = PeerConsumer(args.bootstrap, out_topic, f"{name}.consumer")
    phases: list[dict[str, Any]] = []
    try:
        await consumer.start()
        warm = await peer_phase(args, in_topic, consumer, loop.pid, 0, 20, "peerwarm")
        if not warm["complete"]:
            raise RuntimeError(f"peer warm-up did not arrive; loop log {work / 'loop.log'}")
        for rate in args.rates:
            events = args.events if rate == 0 else min(args.events, int(rate * args.seconds))
            print(f"[e2e] minimal peer pipeline: offered {rate or 'max'} events/s, {events} "
                  "events", flush=True)
            phases.append(await peer_phase(args, in_topic, consumer, loop.pid, rate, events,
                                           f"peer{rate or 'max'}"))
            if loop.poll() is not None:
                raise RuntimeError(f"peer loop exited {loop.returncode}; log {work}/loop.log")
    finally:
        await consumer.stop()
        stop_process(loop)
        log.close()
    return {"pipeline": "confluent-kafka idempotent producer -> broker -> minimal reorder loop "
                        f"(bench_worker.py confluent-txn: transactions every "
                        f"{args.peer_txn_interval_ms:g} ms with a changelog) -> read_committed "
                        "confluent-kafka consumer (commits every 100 ms)",
            "phases": phases, "loop_log": str(work / "loop.log")}
