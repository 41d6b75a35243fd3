"""The reorder worker beside its peers: events per CPU-second draining the same backlog.

    python bench/bench_worker.py --bootstrap 127.0.0.1:9092 --json out.json [--events N]
        [--repeat 3] [--variants trajbus,confluent-txn,...]

One invocation, one broker, one input. A backlog like a fleet's (``--sandboxes`` sandboxes
running episodes of tool call/result pairs, ``--disorder`` of the events displaced a few
positions later in their sandbox's stream, ``--dups`` of them re-sent a little later as exact
copies) is encoded once with the trajbus encoder (``schemas/codec.py``: Avro single-object
encoding) and produced once to ``<base>-src.sandbox.events`` (keyed by sandbox). Then every
variant drains it, each from the beginning with a consumer group of its own, in a separate
process:

* ``trajbus``: ``python -m trajbus worker --processors reorder --until-idle S`` on a prefix of
  its own. Its input topic must be ``<prefix>.sandbox.events`` and it writes ticks into it,
  so each round first copies the source records (same partitions, keys and bytes) into a fresh
  prefix; the copy is not measured.
* ``confluent-txn`` / ``confluent``: a minimal confluent-kafka loop: consume, fastavro decode
  of the single-object encoding (fingerprint -> writer schema, the whole record decoded),
  per-episode reorder dict (next seq + buffer; older or buffered seqs are duplicates), produce
  each released event (its original bytes, key ``sandbox/episode``) and a changelog record per
  touched episode (next seq + buffered events) every ``--txn-interval-ms``: in a transaction
  with ``send_offsets_to_transaction`` (``-txn``), or without transactions (flush, then commit
  the offsets: at-least-once).
* ``aiokafka-txn`` / ``aiokafka``: the same loop on aiokafka.
* ``quix-eos``: Quix Streams (``processing_guarantee="exactly-once"``, RocksDB state with its
  changelog, ``commit_interval`` = ``--quix-commit-interval``), the same reorder as a stateful
  ``apply`` keyed by sandbox. Quix Streams pins an older confluent-kafka and other versions
  than trajbus's environment, so it runs from a virtualenv of its own (``--quix-python``;
  by default ``.trajbus/venv-quix``, created on first use from the ``bench-quix`` pin in
  pyproject.toml). Skipped with a note when it cannot be installed.

What is measured per run: the CPU time (user + system, /proc/<pid>/stat, all threads, i.e.
librdkafka's too) of the variant's process only, from the moment its consumer group is
Stable with partitions assigned (after imports and start-up; restore and recovery are inside)
until its committed offsets reach the end of the input (both polled from this process through
the admin API every ~0.1 s), and the wall time of the same window. ``events_per_cpu_s`` =
input records (duplicates included: each is a delivery the variant must read, decode and
judge) / CPU seconds; ``distinct_per_cpu_s`` counts each distinct event once. The whole
process's CPU (start-up and the idle wait included) is reported beside it.

Correctness: after each run this process reads the variant's output (read_committed) and
checks that every distinct event is there exactly once and in seq order per episode (trajbus:
the events inside its ReplaySegments; its late and dead-letter topics must stay empty). A run
that fails the check is marked invalid and its figures are not used in medians or ratios.

With ``--repeat N`` the rounds interleave (A, B, C, A, B, C, ...) and the figures are medians;
the ratios are medians of the per-round ratios to ``confluent-txn`` (same round, similar load),
``trajbus / confluent-txn`` being the issue's goal row (>= 0.7). The box's load is reported
per window: busy cores (/proc/stat) and how much of it was other processes (the broker
included). Target: trajbus >= 0.7x the minimal confluent-kafka transactional loop.
"""

from __future__ import annotations

import argparse
import asyncio
import io
import json
import os
import random
import re
import resource
import statistics
import struct
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

CLK_TCK = os.sysconf("SC_CLK_TCK")
TARGET_RATIO = 0.7
VARIANTS = ("trajbus", "confluent-txn", "confluent", "aiokafka-txn", "aiokafka", "quix-eos")
BASELINE = "confluent-txn"
TASKS = ("swe-bench", "web-shop", "terminal", "math")
QUIX_VENV = ROOT / ".trajbus" / "venv-quix"
TICK_KEY = b"_tick"
HEADER_LEN = 10  # Avro single-object header: C3 01 + 8-byte fingerprint


# -- measuring ---------------------------------------------------------------------------------
def proc_cpu_s(pid: int) -> float | None:
    """User + system CPU seconds of a live process (all its threads), from /proc."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


def box_cpu() -> tuple[float, float]:
    """(busy, total) CPU seconds of the whole machine since boot, from /proc/stat."""
    vals = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    idle = vals[3] + (vals[4] if len(vals) > 4 else 0)
    total = sum(vals[:8])
    return (total - idle) / CLK_TCK, total / CLK_TCK


def median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


# -- the backlog -------------------------------------------------------------------------------
def event_templates() -> tuple[dict[str, Any], ...]:
    """Avro-ready records of EpisodeStart, ToolCall, ToolResult and EpisodeEnd (built once
    through the models, so every field is present); copy one and set the header and fields."""
    from trajbus.schemas import models as m

    def tmpl(ev: Any) -> dict[str, Any]:
        return m._avro_ready(ev.to_record())

    hdr = m.Envelope(event_id="x", task="t", sandbox="s", episode="e", seq=0, producer_id="p")
    return (tmpl(m.EpisodeStart(header=hdr, tenant="team-a", context={"dataset": "v3"})),
            tmpl(m.ToolCall(header=hdr, call_id="c", tool="shell", args_hash="0" * 64)),
            tmpl(m.ToolResult(header=hdr, call_id="c", tool="shell", status=m.ToolStatus.OK,
                              result_hash="0" * 64, duration_ms=1)),
            tmpl(m.EpisodeEnd(header=hdr, outcome=m.EpisodeOutcome.TERMINAL)))


def write_schemas(path: Path) -> None:
    """{fingerprint hex: {kind, parsing canonical form}} of every bundled schema, for the peers
    (which decode with fastavro alone)."""
    from trajbus.schemas.codec import default_codec

    reg = default_codec().registry
    path.write_text(json.dumps({
        info.fingerprint.hex(): {"kind": info.short_name, "canonical": info.canonical}
        for info in (reg.reader(n) for n in reg.names)}))


def make_backlog(sandboxes: int, events: int, disorder: float, dups: float, seed: int
                 ) -> tuple[list[tuple[bytes, bytes]], dict[bytes, tuple[str, int]],
                            dict[str, Any]]:
    """(key, value) records in delivery order, the expected distinct events (raw bytes ->
    (episode key, seq)) and a description. Encoded with the trajbus codec."""
    from trajbus.schemas.codec import default_codec

    codec = default_codec()
    rng = random.Random(seed)
    t_base = int(time.time() * 1000) - 3_600_000
    t_start, t_call, t_res, t_end = event_templates()
    tools = ("shell", "editor.open", "editor.write", "browser.click", "python")
    per_sb = max(4, events // sandboxes)
    expected: dict[bytes, tuple[str, int]] = {}
    streams: list[tuple[str, list[bytes]]] = []
    episodes = 0
    for s in range(sandboxes):
        sb, task = f"sb-{s:05d}", TASKS[s % len(TASKS)]
        evs: list[bytes] = []
        e = 0
        t = t_base + rng.randint(0, 60_000)
        while len(evs) < per_sb:
            ep = f"ep-{e:04d}"
            ekey = f"{sb}/{ep}"
            e += 1
            episodes += 1
            steps = rng.randint(2, 12)
            seq = 0

            def add(template: dict[str, Any], kind: str, seq: int, t: int,
                    extra: dict[str, Any], sb: str = sb, ep: str = ep, task: str = task,
                    ekey: str = ekey, evs: list[bytes] = evs) -> None:
                rec = dict(template)
                rec["header"] = {"event_id": f"{sb}-{ep}-{seq}", "task": task, "sandbox": sb,
                                 "episode": ep, "seq": seq, "event_time_ms": t,
                                 "producer_id": f"sandbox/{sb}", "policy_version": 7}
                rec.update(extra)
                raw = codec.encode(kind, rec)
                expected[raw] = (ekey, seq)
                evs.append(raw)

            add(t_start, "EpisodeStart", seq, t, {})
            for i in range(steps):
                tool = tools[rng.randrange(len(tools))]
                args = json.dumps({"cmd": f"pytest -x tests/test_{rng.randrange(500)}.py",
                                   "cwd": "/work/repo", "timeout": 60}, sort_keys=True)
                seq += 1
                t += rng.randint(50, 2000)
                add(t_call, "ToolCall", seq, t, {
                    "call_id": f"c{i}", "tool": tool, "args_hash": f"{rng.getrandbits(256):064x}",
                    "args_canonical": args, "args_summary": args[:40]})
                seq += 1
                t += rng.randint(50, 5000)
                add(t_res, "ToolResult", seq, t, {
                    "call_id": f"c{i}", "tool": tool,
                    "result_hash": f"{rng.getrandbits(256):064x}",
                    "result_summary": f"{rng.randrange(40)} passed, {rng.randrange(3)} failed "
                                      f"in {rng.random() * 9:.2f}s",
                    "duration_ms": rng.randint(5, 5000)})
            seq += 1
            add(t_end, "EpisodeEnd", seq, t + 10, {"reward": round(rng.random(), 3)})
        streams.append((sb, evs))

    # disorder: an event moves 1-3 places later in its sandbox's stream (a late send)
    ordered: list[tuple[str, list[bytes]]] = []
    for sb, evs in streams:
        j = 0
        while j < len(evs) - 1:
            if rng.random() < disorder:
                k = min(len(evs) - 1, j + rng.randint(1, 3))
                evs.insert(k, evs.pop(j))
                j = k + 1
            else:
                j += 1
        # duplicates: an exact copy re-sent 1-30 places later (a retried send)
        out: list[bytes] = []
        later: dict[int, list[bytes]] = {}
        for i, raw in enumerate(evs):
            out.append(raw)
            out.extend(later.pop(i, []))
            if rng.random() < dups:
                later.setdefault(min(len(evs) - 1, i + rng.randint(1, 30)), []).append(raw)
        for rest in later.values():
            out.extend(rest)
        ordered.append((sb, out))

    # the fleet: every sandbox emits concurrently, at its own phase
    keyed = [(i + phase, sb.encode(), raw)
             for (sb, evs), phase in zip(ordered, (rng.random() for _ in ordered), strict=True)
             for i, raw in enumerate(evs)]
    keyed.sort(key=lambda x: x[0])
    records = [(k, v) for _, k, v in keyed]

    # how disordered is it, as a consumer of one episode sees it
    highest: dict[str, int] = {}
    seen: set[bytes] = set()
    late = 0
    for _, raw in records:
        if raw in seen:
            continue
        seen.add(raw)
        ekey, seq = expected[raw]
        if seq < highest.get(ekey, -1):
            late += 1
        highest[ekey] = max(highest.get(ekey, -1), seq)
    desc = {"records": len(records), "distinct_events": len(expected),
            "sandboxes": sandboxes, "episodes": episodes, "tasks": len(TASKS),
            "out_of_order_fraction": round(late / len(expected), 4),
            "duplicate_fraction": round(len(records) / len(expected) - 1, 4),
            "mean_record_bytes": round(sum(len(v) for _, v in records) / len(records), 1),
            "seed": seed}
    return records, expected, desc


# -- Kafka helpers (harness side, confluent-kafka) ----------------------------------------------
def _conf(bootstrap: str, **extra: Any) -> dict[str, Any]:
    return {"bootstrap.servers": bootstrap, **extra}


def create_topics(bootstrap: str, names: list[str], partitions: int,
                  compacted: bool = False) -> None:
    from confluent_kafka.admin import AdminClient, NewTopic

    admin = AdminClient(_conf(bootstrap))
    cfg = {"cleanup.policy": "compact"} if compacted else {}
    fs = admin.create_topics([NewTopic(n, partitions, 1, config=cfg) for n in names])
    for f in fs.values():
        f.result(30)


def produce_records(bootstrap: str, topic: str, records: list[tuple[bytes, bytes]],
                    compression: str, partition_of: list[int] | None = None) -> None:
    from confluent_kafka import Producer

    p = Producer(_conf(bootstrap, **{"compression.type": compression, "linger.ms": 50,
                                     "enable.idempotence": True, "partitioner": "murmur2_random",
                                     "queue.buffering.max.messages": 1_000_000,
                                     "batch.size": 1_000_000}))
    errors: list[str] = []

    def cb(err: Any, _msg: Any) -> None:
        if err is not None:
            errors.append(str(err))

    for i, (k, v) in enumerate(records):
        kw: dict[str, Any] = {} if partition_of is None else {"partition": partition_of[i]}
        while True:
            try:
                p.produce(topic, v, key=k, on_delivery=cb, **kw)
                break
            except BufferError:
                p.poll(0.05)
        if i % 10_000 == 0:
            p.poll(0)
    if p.flush(120) or errors:
        raise RuntimeError(f"producing to {topic}: {errors[:3] or 'flush timed out'}")


def read_topic(bootstrap: str, topic: str, read_committed: bool = True
               ) -> list[tuple[int, bytes | None, bytes]]:
    """Every record of ``topic`` as (partition, key, value), in partition order."""
    from confluent_kafka import OFFSET_BEGINNING, Consumer, KafkaError, TopicPartition

    c = Consumer(_conf(bootstrap, **{
        "group.id": f"bench-worker-check-{uuid.uuid4().hex[:8]}", "enable.auto.commit": False,
        "enable.partition.eof": True,
        "isolation.level": "read_committed" if read_committed else "read_uncommitted"}))
    try:
        md = c.list_topics(topic, timeout=30).topics[topic]
        parts = sorted(md.partitions)
        c.assign([TopicPartition(topic, p, OFFSET_BEGINNING) for p in parts])
        pending = set(parts)
        out: list[tuple[int, bytes | None, bytes]] = []
        deadline = time.monotonic() + 120
        while pending and time.monotonic() < deadline:
            for msg in c.consume(5000, 0.5):
                err = msg.error()
                if err is not None:
                    if err.code() == KafkaError._PARTITION_EOF:
                        pending.discard(msg.partition())
                        continue
                    raise RuntimeError(f"reading {topic}: {err}")
                out.append((msg.partition() or 0, msg.key(), msg.value() or b""))
        if pending:
            raise RuntimeError(f"reading {topic}: partitions {sorted(pending)} not read to "
                               "the end in 120 s")
        return out
    finally:
        c.close()


def end_offsets(bootstrap: str, topic: str) -> dict[int, int]:
    from confluent_kafka import Consumer, TopicPartition

    c = Consumer(_conf(bootstrap, **{"group.id": "bench-worker-offsets"}))
    try:
        md = c.list_topics(topic, timeout=30).topics[topic]
        return {p: c.get_watermark_offsets(TopicPartition(topic, p), timeout=30)[1]
                for p in sorted(md.partitions)}
    finally:
        c.close()


def copy_topic(bootstrap: str, src: str, dst: str, compression: str) -> None:
    """dst := src record for record (same partition, key and value)."""
    recs = read_topic(bootstrap, src, read_committed=False)
    produce_records(bootstrap, dst, [(k or b"", v) for _, k, v in recs], compression,
                    partition_of=[p for p, _, _ in recs])


class GroupWatch:
    """Polls a consumer group through the admin API: Stable with partitions assigned, and
    its committed offsets on the input topic."""

    def __init__(self, bootstrap: str, group: str, topic: str, target: dict[int, int]) -> None:
        from confluent_kafka import ConsumerGroupTopicPartitions, TopicPartition
        from confluent_kafka.admin import AdminClient

        self.admin = AdminClient(_conf(bootstrap))
        self.group = group
        self.target = target
        self.request = [ConsumerGroupTopicPartitions(
            group, [TopicPartition(topic, p) for p in sorted(target)])]

    def active(self) -> bool:
        from confluent_kafka import ConsumerGroupState

        try:
            desc = self.admin.describe_consumer_groups([self.group])[self.group].result(5)
        except Exception:  # not known to the coordinator yet
            return False
        return desc.state == ConsumerGroupState.STABLE and any(
            m.assignment is not None and m.assignment.topic_partitions for m in desc.members)

    def drained(self) -> bool:
        try:
            res = self.admin.list_consumer_group_offsets(self.request)[self.group].result(5)
        except Exception:
            return False
        got = {tp.partition: tp.offset for tp in res.topic_partitions}
        return all(got.get(p, -1) >= end for p, end in self.target.items())


# -- running one variant -----------------------------------------------------------------------
def run_measured(cmd: list[str], env: dict[str, str] | None, watch: GroupWatch,
                 timeout: float, log_path: Path, cwd: Path = ROOT) -> dict[str, Any]:
    """Start ``cmd``, measure its CPU and wall time from group-active to drained, wait for
    its exit."""
    log = open(log_path, "ab")
    ru0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    t_launch = time.monotonic()
    proc = subprocess.Popen(cmd, env=env, cwd=cwd, stdout=log, stderr=log)
    start: tuple[float, float, float, float] | None = None  # wall, cpu, box busy, harness
    end: tuple[float, float, float, float] | None = None
    last_cpu = 0.0
    error = None
    try:
        deadline = t_launch + timeout
        while time.monotonic() < deadline:
            cpu = proc_cpu_s(proc.pid)
            if proc.poll() is not None:
                error = f"exited {proc.returncode} before draining the input"
                break
            if cpu is not None:
                last_cpu = cpu
            sample = (time.monotonic(), last_cpu, box_cpu()[0], time.process_time())
            if start is None:
                if watch.active():
                    start = sample
            elif watch.drained():
                end = (time.monotonic(), proc_cpu_s(proc.pid) or last_cpu, box_cpu()[0],
                       time.process_time())
                break
            time.sleep(0.1)
        else:
            error = f"not drained within {timeout:.0f} s"
        if end is not None:
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                error = "did not exit within 60 s of draining its input"
    finally:
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=10)
        log.close()
    ru1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    res: dict[str, Any] = {
        "exit_code": proc.returncode,
        "process_cpu_s_total": round(ru1.ru_utime + ru1.ru_stime - ru0.ru_utime - ru0.ru_stime,
                                     3),
        "process_wall_s_total": round(time.monotonic() - t_launch, 2)}
    if error is None and proc.returncode not in (0, None):
        error = f"exited {proc.returncode}"
    if error is not None:
        tail = log_path.read_bytes()[-1500:].decode(errors="replace")
        return {**res, "error": error, "log_tail": tail}
    assert start is not None and end is not None
    wall = end[0] - start[0]
    cpu = end[1] - start[1]
    busy = end[2] - start[2]
    harness = end[3] - start[3]
    res.update({"cpu_s": round(cpu, 3), "wall_s": round(wall, 3),
                "startup_s": round(start[0] - t_launch, 2),
                "variant_cores": round(cpu / wall, 2) if wall > 0 else None,
                "box_busy_cores": round(busy / wall, 2) if wall > 0 else None,
                "other_processes_cores": round(max(0.0, busy - cpu - harness) / wall, 2)
                if wall > 0 else None})
    return res


def check_events(values: list[tuple[int, bytes | None, bytes]],
                 expected: dict[bytes, tuple[str, int]]) -> dict[str, Any]:
    """Each distinct event exactly once, in seq order per episode."""
    seen: set[bytes] = set()
    nxt: dict[str, int] = {}
    dup = unknown = disorder = 0
    for _, _, raw in values:
        where = expected.get(raw)
        if where is None:
            unknown += 1
            continue
        if raw in seen:
            dup += 1
            continue
        seen.add(raw)
        ekey, seq = where
        if seq != nxt.get(ekey, 0):
            disorder += 1
        nxt[ekey] = seq + 1
    missing = len(expected) - len(seen)
    return {"output_events": len(values), "distinct_found": len(seen), "missing": missing,
            "duplicates": dup, "unknown": unknown, "out_of_order": disorder,
            "valid": missing == 0 and dup == 0 and unknown == 0 and disorder == 0}


def trajbus_events(bootstrap: str, prefix: str) -> tuple[list[tuple[int, bytes | None, bytes]],
                                                         dict[str, int]]:
    """The events inside every ReplaySegment of the prefix's replay topics, in order; and the
    record counts of its late and dead-letter topics."""
    from trajbus.schemas.codec import default_codec

    codec = default_codec()
    out: list[tuple[int, bytes | None, bytes]] = []
    counts = {"segments": 0, "gap_markers": 0}
    for task in TASKS:
        try:
            recs = read_topic(bootstrap, f"{prefix}.replay.{task}")
        except (KeyError, RuntimeError):
            continue
        for part, key, value in recs:
            seg = codec.decode(value).record
            counts["segments"] += 1
            counts["gap_markers"] += seg.get("gap") is not None
            out.extend((part, key, ev) for ev in seg["events"])
    for name in ("late", "deadletter"):
        try:
            counts[name] = len(read_topic(bootstrap, f"{prefix}.{name}"))
        except (KeyError, RuntimeError):
            counts[name] = 0
    return out, counts


# -- the peers (each runs as `bench_worker.py --peer NAME ...` in its own process) -------------
def load_schemas(path: str) -> dict[bytes, tuple[str, Any]]:
    from fastavro import parse_schema

    raw = json.loads(Path(path).read_text())
    return {bytes.fromhex(fp): (s["kind"], parse_schema(json.loads(s["canonical"])))
            for fp, s in raw.items()}


class Reorder:
    """The minimal per-episode reorder: next expected seq and a buffer of early events.
    Older or already buffered seqs are duplicates (dropped). ``state(key)`` is the changelog
    value: next seq, then the buffered events (length-prefixed)."""

    __slots__ = ("eps",)

    def __init__(self) -> None:
        self.eps: dict[str, list[Any]] = {}

    def add(self, key: str, seq: int, raw: bytes) -> list[bytes]:
        st = self.eps.get(key)
        if st is None:
            st = self.eps[key] = [0, {}]
        nxt, buf = st[0], st[1]
        if seq < nxt or seq in buf:
            return []
        if seq > nxt:
            buf[seq] = raw
            return []
        out = [raw]
        nxt += 1
        while buf:
            early = buf.pop(nxt, None)
            if early is None:
                break
            out.append(early)
            nxt += 1
        st[0] = nxt
        return out

    def state(self, key: str) -> bytes:
        nxt, buf = self.eps[key]
        parts = [struct.pack("<qI", nxt, len(buf))]
        for seq in sorted(buf):
            parts.append(struct.pack("<qI", seq, len(buf[seq])))
            parts.append(buf[seq])
        return b"".join(parts)


def make_decoder(schemas: dict[bytes, tuple[str, Any]]) -> Callable[[bytes], dict[str, Any]]:
    from fastavro import schemaless_reader

    def decode(raw: bytes) -> dict[str, Any]:
        _, schema = schemas[raw[2:HEADER_LEN]]
        buf = io.BytesIO(raw)
        buf.seek(HEADER_LEN)
        rec: dict[str, Any] = schemaless_reader(buf, schema, None)  # type: ignore[assignment]
        return rec

    return decode


def peer_confluent(a: argparse.Namespace) -> int:
    from confluent_kafka import Consumer, KafkaError, Producer

    decode = make_decoder(load_schemas(a.schemas))
    txn = a.peer.endswith("-txn")
    c = Consumer(_conf(a.bootstrap, **{
        "group.id": a.group, "enable.auto.commit": False, "auto.offset.reset": "earliest",
        "isolation.level": "read_committed"}))
    pconf = _conf(a.bootstrap, **{"compression.type": a.compression, "linger.ms": 5,
                                  "enable.idempotence": True, "acks": "all",
                                  "queue.buffering.max.messages": 1_000_000})
    if txn:
        pconf["transactional.id"] = f"{a.group}.txn"
    p = Producer(pconf)
    if txn:
        p.init_transactions(60)
    c.subscribe(a.in_topics.split(","))
    r = Reorder()
    add, produce, out_topic = r.add, p.produce, a.out_topic
    dirty: dict[str, int] = {}
    in_txn = False
    pending = False
    last_commit = last_data = time.monotonic()
    interval = a.txn_interval_ms / 1000

    def commit() -> None:
        nonlocal in_txn, pending
        for key, part in dirty.items():
            produce(a.state_topic, r.state(key), key=key.encode(), partition=part)
        dirty.clear()
        if txn:
            p.send_offsets_to_transaction(c.position(c.assignment()),
                                          c.consumer_group_metadata(), 60)
            p.commit_transaction(60)
            in_txn = False
        else:
            p.flush(60)  # outputs acknowledged before the offsets: at-least-once
            c.commit(asynchronous=False)
        pending = False

    while True:
        msgs = c.consume(2000, a.poll_ms / 1000)  # returns at 2000 records or the timeout
        now = time.monotonic()
        if msgs:
            last_data = now
            if txn and not in_txn:
                p.begin_transaction()
                in_txn = True
            for msg in msgs:
                err = msg.error()
                if err is not None:
                    if err.code() == KafkaError._PARTITION_EOF:
                        continue
                    raise RuntimeError(str(err))
                if msg.key() == TICK_KEY:
                    continue
                raw = msg.value() or b""
                h = decode(raw)["header"]
                ep = h["episode"]
                if ep is None:
                    continue
                key = f"{h['sandbox']}/{ep}"
                released = add(key, h["seq"], raw)
                if released:
                    kb = key.encode()
                    for ev in released:
                        produce(out_topic, ev, key=kb)
                dirty[key] = msg.partition() or 0
            pending = True
            p.poll(0)
        elif now - last_data > a.idle:
            break
        if pending and now - last_commit >= interval:
            commit()
            last_commit = now
    if pending:
        commit()
    c.close()
    p.flush(60)
    return 0


async def peer_aiokafka(a: argparse.Namespace) -> int:
    from aiokafka import AIOKafkaConsumer, AIOKafkaProducer

    decode = make_decoder(load_schemas(a.schemas))
    txn = a.peer.endswith("-txn")
    c = AIOKafkaConsumer(*a.in_topics.split(","), bootstrap_servers=a.bootstrap,
                         group_id=a.group, enable_auto_commit=False,
                         auto_offset_reset="earliest", isolation_level="read_committed",
                         max_poll_records=2000)
    p = AIOKafkaProducer(bootstrap_servers=a.bootstrap, compression_type=a.compression,
                         linger_ms=5, enable_idempotence=True, acks="all",
                         transactional_id=f"{a.group}.txn" if txn else None)
    await p.start()
    await c.start()
    r = Reorder()
    add, send, out_topic = r.add, p.send, a.out_topic
    dirty: dict[str, int] = {}
    offsets: dict[Any, int] = {}
    in_txn = False
    last_commit = last_data = time.monotonic()
    interval = a.txn_interval_ms / 1000

    async def commit() -> None:
        nonlocal in_txn
        for key, part in dirty.items():
            await send(a.state_topic, r.state(key), key=key.encode(), partition=part)
        dirty.clear()
        if txn:
            # the records first: a Kafka 4 broker keeps one pending transaction verification
            # per producer, and offsets sent while records are in flight make aiokafka retry
            # (the worker does the same since issue 17; RELIABILITY.md)
            await p.flush()
            await p.send_offsets_to_transaction(dict(offsets), a.group)
            await p.commit_transaction()
            in_txn = False
        else:
            await p.flush()
            await c.commit(dict(offsets))
        offsets.clear()

    try:
        while True:
            batch = await c.getmany(timeout_ms=100, max_records=2000)
            now = time.monotonic()
            if batch:
                last_data = now
                if txn and not in_txn:
                    await p.begin_transaction()
                    in_txn = True
                for tp, msgs in batch.items():
                    for msg in msgs:
                        if msg.key == TICK_KEY:
                            continue
                        raw = msg.value
                        h = decode(raw)["header"]
                        ep = h["episode"]
                        if ep is None:
                            continue
                        key = f"{h['sandbox']}/{ep}"
                        released = add(key, h["seq"], raw)
                        if released:
                            kb = key.encode()
                            for ev in released:
                                await send(out_topic, ev, key=kb)
                        dirty[key] = tp.partition
                    offsets[tp] = msgs[-1].offset + 1
            elif now - last_data > a.idle:
                break
            if offsets and now - last_commit >= interval:
                await commit()
                last_commit = now
        if offsets:
            await commit()
    finally:
        await c.stop()
        await p.stop()
    return 0


def peer_quix(a: argparse.Namespace) -> int:
    from quixstreams import Application
    from quixstreams.models.serializers import Deserializer, Serializer

    decode = make_decoder(load_schemas(a.schemas))

    class EventIn(Deserializer):
        """Avro single-object -> (episode key, seq, raw) (None for ticks / no episode)."""

        def __call__(self, value: bytes, ctx: Any) -> Any:
            h = decode(value)["header"]
            ep = h["episode"]
            if ep is None:
                return None
            return (f"{h['sandbox']}/{ep}", h["seq"], value)

    class EventOut(Serializer):
        def __call__(self, value: Any, ctx: Any) -> bytes:
            return bytes(value[1])

    app = Application(
        broker_address=a.bootstrap, consumer_group=a.group, auto_offset_reset="earliest",
        processing_guarantee="exactly-once", commit_interval=a.quix_commit_interval,
        state_dir=tempfile.mkdtemp(prefix="bench-worker-quix-"), use_changelog_topics=True,
        producer_extra_config={"compression.type": a.compression, "linger.ms": 5},
        consumer_extra_config={"isolation.level": "read_committed"},
        loglevel="WARNING")
    topics = [app.topic(t, value_deserializer=EventIn(), key_deserializer="bytes")
              for t in a.in_topics.split(",")]
    out = app.topic(a.out_topic, value_serializer=EventOut(), key_serializer="bytes")

    def reorder(value: Any, state: Any) -> list[tuple[bytes, bytes]]:
        # state is scoped to the message key (the sandbox); one entry per episode:
        # [next seq, {seq: event as latin-1 text}] (state values are JSON)
        key, seq, raw = value
        st = state.get(key)
        if st is None:
            st = [0, {}]
        nxt, buf = st
        s = str(seq)
        if seq < nxt or s in buf:
            return []
        if seq > nxt:
            buf[s] = raw.decode("latin-1")
            state.set(key, st)
            return []
        kb = key.encode()
        released = [(kb, raw)]
        nxt += 1
        while buf:
            early = buf.pop(str(nxt), None)
            if early is None:
                break
            released.append((kb, early.encode("latin-1")))
            nxt += 1
        st[0] = nxt
        state.set(key, st)
        return released

    for topic in topics:
        sdf = app.dataframe(topic)
        sdf = sdf.filter(lambda v: v is not None)
        sdf = sdf.apply(reorder, stateful=True, expand=True)
        sdf.to_topic(out, key=lambda v: v[0])
    app.run(timeout=a.idle, collect=False)
    return 0


# -- the harness -------------------------------------------------------------------------------
def quix_python(a: argparse.Namespace, notes: list[str]) -> str | None:
    """The interpreter of the Quix Streams virtualenv (created on first use), or None."""
    check = ["-c", "import quixstreams, fastavro; print(quixstreams.__version__)"]
    if a.quix_python:
        py = a.quix_python
    else:
        py = str(QUIX_VENV / "bin" / "python")
        if not Path(py).exists() or subprocess.run([py, *check], capture_output=True).returncode:
            pin = quix_pin()
            print(f"[worker] creating {QUIX_VENV} with {pin} (first run only)", flush=True)
            try:
                subprocess.run([sys.executable, "-m", "venv", str(QUIX_VENV)], check=True,
                               capture_output=True, timeout=300)
                subprocess.run([py, "-m", "pip", "install", "-q", pin, "fastavro"], check=True,
                               capture_output=True, timeout=600)
            except (subprocess.SubprocessError, OSError) as exc:
                err = getattr(exc, "stderr", b"") or b""
                notes.append(f"quix-eos skipped: installing {pin} into {QUIX_VENV} failed: "
                             f"{exc} {err.decode(errors='replace')[-300:]}")
                return None
    got = subprocess.run([py, *check], capture_output=True, text=True)
    if got.returncode:
        notes.append(f"quix-eos skipped: {py} cannot import quixstreams: {got.stderr[-300:]}")
        return None
    notes.append(f"quix-eos: Quix Streams {got.stdout.strip()} from {py}")
    return py


def export_ref(ref: str) -> Path:
    """``git archive`` of ``ref`` laid out as the installed package (pyproject's package-dir:
    ``bus/`` -> ``trajbus/bus`` ...), in a temporary directory to put first on PYTHONPATH."""
    import shutil
    import tarfile
    import tomllib

    out = Path(tempfile.mkdtemp(prefix="bench-worker-ref-"))
    src, pkg = out / "src", out / "pkg"
    blob = subprocess.run(["git", "archive", "--format=tar", ref], cwd=ROOT, check=True,
                          capture_output=True).stdout
    with tarfile.open(fileobj=io.BytesIO(blob)) as tar:
        tar.extractall(src, filter="data")
    dirs = tomllib.loads((src / "pyproject.toml").read_text())["tool"]["setuptools"][
        "package-dir"]
    for name, folder in sorted(dirs.items()):
        shutil.copytree(src / folder, pkg / name.replace(".", "/"), dirs_exist_ok=True)
    return pkg


def git_describe(ref: str) -> str:
    got = subprocess.run(["git", "log", "-1", "--format=%h %cd", "--date=iso", ref], cwd=ROOT,
                         capture_output=True, text=True)
    return got.stdout.strip() or ref


def git_dirty() -> bool:
    got = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no", "--",
                          "consumers", "bus", "schemas", "trajbus"], cwd=ROOT,
                         capture_output=True, text=True)
    return bool(got.stdout.strip())


def quix_pin() -> str:
    """The quixstreams requirement of pyproject.toml's bench-quix extra."""
    import tomllib

    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"]
    for req in extras.get("bench-quix", []):
        if req.startswith("quixstreams"):
            return str(req)
    return "quixstreams"


def main_bench(a: argparse.Namespace) -> dict[str, Any]:
    from trajbus.bus.admin import ensure_base_topics
    from trajbus.bus.settings import KafkaSettings, Settings, TopicSettings

    load_start = os.getloadavg()
    notes: list[str] = []
    variants = [v for v in a.variants.split(",") if v]
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown:
        raise SystemExit(f"unknown variants {unknown}; choose from {', '.join(VARIANTS)}")
    a.ref_trees = {}
    for ref in a.trajbus_ref or []:  # the worker of another commit, right after "trajbus"
        a.ref_trees[ref] = export_ref(ref)
        at = variants.index("trajbus") + 1 if "trajbus" in variants else 0
        variants.insert(at, f"trajbus@{ref}")
        notes.append(f"trajbus@{ref}: the worker of git ref {ref} "
                     f"({git_describe(ref)}), exported to {a.ref_trees[ref]}")
    if "trajbus" in variants:
        notes.append(f"trajbus: the worker of the working tree ({git_describe('HEAD')}"
                     f"{', with uncommitted changes' if git_dirty() else ''})")
    qpy = quix_python(a, notes) if "quix-eos" in variants else None
    if "quix-eos" in variants and qpy is None:
        variants.remove("quix-eos")
    compression = KafkaSettings().compression_type or "none"  # the worker's own codec
    base = f"bench-worker-{uuid.uuid4().hex[:8]}"
    work = Path(tempfile.mkdtemp(prefix="bench-worker-"))

    def settings(prefix: str) -> Settings:
        return Settings(kafka=KafkaSettings(bootstrap_servers=a.bootstrap),
                        topics=TopicSettings(prefix=prefix, partitions=a.partitions))

    # the backlog, produced once
    t0 = time.monotonic()
    records, expected, desc = make_backlog(a.sandboxes, a.events, a.disorder, a.dups, a.seed)
    src = f"{base}-src"
    asyncio.run(ensure_base_topics(settings(src), []))
    src_topic = f"{src}.sandbox.events"
    produce_records(a.bootstrap, src_topic, records, compression)
    target_src = end_offsets(a.bootstrap, src_topic)
    assert sum(target_src.values()) == len(records), (target_src, len(records))
    desc.update({"partitions": a.partitions, "compression": compression,
                 "prepared_in_s": round(time.monotonic() - t0, 1)})
    print(f"[worker] backlog: {desc['records']:,} records, {desc['distinct_events']:,} distinct "
          f"events, {desc['sandboxes']} sandboxes, {desc['episodes']:,} episodes, "
          f"{desc['out_of_order_fraction']:.1%} out of order, "
          f"{desc['duplicate_fraction']:.1%} duplicates", flush=True)
    schemas_file = work / "schemas.json"
    write_schemas(schemas_file)

    rounds: dict[str, list[dict[str, Any]]] = {v: [] for v in variants}
    for r in range(a.repeat):
        for v in variants:
            print(f"[worker] round {r + 1}/{a.repeat}: {v}", flush=True)
            res = run_variant(a, v, r, base, src, target_src, expected, schemas_file, work,
                              compression, qpy, settings)
            res["round"] = r + 1
            res["load_average_1m"] = round(os.getloadavg()[0], 2)
            rounds[v].append(res)
            if res.get("valid") and res.get("cpu_s"):
                print(f"[worker]   {res['events_per_cpu_s']:,} events per CPU-second "
                      f"({res['cpu_s']} CPU-s, {res['wall_s']} s wall, box busy "
                      f"{res['box_busy_cores']} cores, others {res['other_processes_cores']})",
                      flush=True)
            else:
                print(f"[worker]   INVALID: {res.get('error') or res.get('check')}", flush=True)
    return summarise(a, rounds, desc, notes, load_start, work)


def run_variant(a: argparse.Namespace, v: str, r: int, base: str, src: str,
                target_src: dict[int, int], expected: dict[bytes, tuple[str, int]],
                schemas_file: Path, work: Path, compression: str, qpy: str | None,
                settings: Callable[[str], Any]) -> dict[str, Any]:
    from trajbus.bus.admin import ensure_base_topics

    n_records = sum(target_src.values())
    log_path = work / f"{v}-r{r + 1}.log"
    if v == "trajbus" or v.startswith("trajbus@"):
        tree = a.ref_trees.get(v.partition("@")[2]) if "@" in v else None
        tag = re.sub(r"[^A-Za-z0-9_-]", "_", v.partition("@")[2])
        prefix = f"{base}-tb{'-' + tag if tag else ''}-r{r + 1}"
        asyncio.run(ensure_base_topics(settings(prefix), []))
        copy_topic(a.bootstrap, f"{src}.sandbox.events", f"{prefix}.sandbox.events",
                   compression)
        target = end_offsets(a.bootstrap, f"{prefix}.sandbox.events")
        env = dict(os.environ)
        env.update({"TRAJBUS_KAFKA__BOOTSTRAP_SERVERS": a.bootstrap,
                    "TRAJBUS_TOPICS__PREFIX": prefix,
                    "TRAJBUS_TOPICS__PARTITIONS": str(a.partitions)})
        if tree is not None:  # the exported ref's package comes first on the path
            env["PYTHONPATH"] = str(tree)
        cmd = [sys.executable, "-m", "trajbus", "worker", "--processors", "reorder",
               "--worker-id", "bench", "--until-idle", str(a.trajbus_idle), "-v"]
        watch = GroupWatch(a.bootstrap, f"{prefix}.reorder", f"{prefix}.sandbox.events", target)
        res = run_measured(cmd, env, watch, a.timeout, log_path, cwd=tree or ROOT)
        if "error" in res:
            return {**res, "valid": False}
        values, counts = trajbus_events(a.bootstrap, prefix)
        check = check_events(values, expected)
        check.update(counts)
        check["valid"] = bool(check["valid"] and not counts["late"]
                              and not counts["deadletter"])
    else:
        name = f"{base}-{v}-r{r + 1}"
        out_topic, state_topic = f"{name}.out", f"{name}.state"
        create_topics(a.bootstrap, [out_topic], a.partitions)
        create_topics(a.bootstrap, [state_topic], a.partitions, compacted=True)
        py = qpy if v == "quix-eos" else sys.executable
        assert py is not None
        cmd = [py, str(Path(__file__).resolve()), "--peer", v, "--bootstrap", a.bootstrap,
               "--group", name, "--in-topics", f"{src}.sandbox.events,{src}.trace.chunks",
               "--out-topic", out_topic, "--state-topic", state_topic, "--schemas",
               str(schemas_file), "--compression", compression, "--idle", str(a.idle),
               "--txn-interval-ms", str(a.txn_interval_ms),
               "--quix-commit-interval", str(a.quix_commit_interval)]
        watch = GroupWatch(a.bootstrap, name, f"{src}.sandbox.events", target_src)
        res = run_measured(cmd, None, watch, a.timeout, log_path)
        if "error" in res:
            return {**res, "valid": False}
        check = check_events(read_topic(a.bootstrap, out_topic), expected)
    res["check"] = check
    res["valid"] = check["valid"]
    cpu = res["cpu_s"]
    res["records"] = n_records
    res["events_per_cpu_s"] = round(n_records / cpu) if cpu > 0 else None
    res["distinct_per_cpu_s"] = round(len(expected) / cpu) if cpu > 0 else None
    res["events_per_wall_s"] = round(n_records / res["wall_s"]) if res["wall_s"] > 0 else None
    return res


def summarise(a: argparse.Namespace, rounds: dict[str, list[dict[str, Any]]],
              desc: dict[str, Any], notes: list[str], load_start: tuple[float, float, float],
              work: Path) -> dict[str, Any]:
    table: dict[str, Any] = {}
    for v, runs in rounds.items():
        ok = [x for x in runs if x.get("valid") and x.get("events_per_cpu_s")]

        def med(field: str, ok: list[dict[str, Any]] = ok) -> float | None:
            m = median([float(x[field]) for x in ok if x.get(field) is not None])
            if m is None:
                return None
            return round(m, 3) if m < 100 else round(m)

        table[v] = {"valid_runs": f"{len(ok)}/{len(runs)}",
                    "events_per_cpu_s": med("events_per_cpu_s"),
                    "distinct_per_cpu_s": med("distinct_per_cpu_s"),
                    "events_per_wall_s": med("events_per_wall_s"),
                    "cpu_s": med("cpu_s"), "wall_s": med("wall_s"),
                    "process_cpu_s_total": med("process_cpu_s_total"),
                    "variant_cores": med("variant_cores"),
                    "box_busy_cores": med("box_busy_cores"),
                    "other_processes_cores": med("other_processes_cores")}
    ratios: dict[str, Any] = {}
    base = rounds.get(BASELINE, [])
    for v, runs in rounds.items():
        if v == BASELINE or not base:
            continue
        per_round = [x["events_per_cpu_s"] / b["events_per_cpu_s"]
                     for x, b in zip(runs, base, strict=False)
                     if x.get("valid") and b.get("valid") and x.get("events_per_cpu_s")
                     and b.get("events_per_cpu_s")]
        m = median(per_round)
        ratios[f"{v} / {BASELINE}"] = {
            "median_of_round_ratios": None if m is None else round(m, 3),
            "per_round": [round(x, 3) for x in per_round]}
    for v, runs in rounds.items():  # the working tree against another ref, round by round
        if v.startswith("trajbus@") and "trajbus" in rounds:
            per_round = [x["events_per_cpu_s"] / y["events_per_cpu_s"]
                         for x, y in zip(rounds["trajbus"], runs, strict=False)
                         if x.get("valid") and y.get("valid") and x.get("events_per_cpu_s")
                         and y.get("events_per_cpu_s")]
            m = median(per_round)
            ratios[f"trajbus / {v}"] = {
                "median_of_round_ratios": None if m is None else round(m, 3),
                "per_round": [round(x, 3) for x in per_round]}
    goal = ratios.get(f"trajbus / {BASELINE}", {}).get("median_of_round_ratios")
    targets = [{"measure": "worker / minimal confluent-kafka transactional loop, events per "
                           "CPU-second draining a backlog (median of interleaved rounds)",
                "result": goal if goal is not None else "n/a",
                "target": f">= {TARGET_RATIO}", "met": goal is not None and goal >= TARGET_RATIO}]
    for v in table:
        if table[v]["events_per_cpu_s"] is not None:
            targets.append({"measure": f"{v}: events per CPU-second draining the backlog",
                            "result": table[v]["events_per_cpu_s"], "target": "(reported)",
                            "met": True})
    load_end = os.getloadavg()
    return {"name": "worker", "input": desc, "repeat": a.repeat, "cpus": os.cpu_count(),
            "measure": "events_per_cpu_s = input records (duplicates included) / CPU seconds "
                       "of the variant's process (user+sys, all threads) from its consumer "
                       "group Stable with partitions assigned until its committed offsets "
                       "reach the end of the input; medians of the valid rounds",
            "settings": {"idle_s": a.idle, "trajbus_until_idle_s": a.trajbus_idle,
                         "txn_interval_ms": a.txn_interval_ms,
                         "quix_commit_interval_s": a.quix_commit_interval,
                         "compression": desc.get("compression")},
            "variants": table, "ratios": ratios, "notes": notes,
            "load_average_at_start": [round(x, 2) for x in load_start],
            "load_average_at_end": [round(x, 2) for x in load_end],
            "targets": targets,
            # per-run details: in the JSON, not in BENCHMARKS.md's table (keys with "_")
            "_rounds": rounds, "_logs": str(work)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--bootstrap", required=True)
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--events", type=int, default=60_000,
                    help="distinct events in the backlog (duplicates come on top)")
    ap.add_argument("--sandboxes", type=int, default=1000)
    ap.add_argument("--disorder", type=float, default=0.095,
                    help="fraction of events sent 1-3 places late in their sandbox's stream")
    ap.add_argument("--dups", type=float, default=0.18,
                    help="fraction of events re-sent as exact copies 1-30 places later")
    ap.add_argument("--partitions", type=int, default=6)
    ap.add_argument("--repeat", type=int, default=3, help="interleaved rounds")
    ap.add_argument("--trajbus-ref", action="append", default=None, metavar="REF",
                    help="also measure the worker of this git ref (e.g. HEAD, to compare "
                         "uncommitted changes; repeatable), interleaved like the others")
    ap.add_argument("--variants", default=",".join(VARIANTS),
                    help=f"comma-separated subset of {', '.join(VARIANTS)}")
    ap.add_argument("--idle", type=float, default=2.0,
                    help="each variant exits after this long without input")
    ap.add_argument("--trajbus-idle", type=float, default=8.0,
                    help="the worker's --until-idle: it counts from before the first fetch, "
                         "so it must outlast the group join and restore (outside the "
                         "measured window either way)")
    ap.add_argument("--txn-interval-ms", type=float, default=100.0,
                    help="the minimal loops' transaction / commit interval")
    ap.add_argument("--quix-commit-interval", type=float, default=0.1,
                    help="Quix Streams' commit_interval (its checkpoint = one transaction)")
    ap.add_argument("--quix-python", default=None,
                    help="python of a virtualenv with quixstreams and fastavro (default: "
                         f"{QUIX_VENV.relative_to(ROOT)}, created on first use)")
    ap.add_argument("--timeout", type=float, default=300.0, help="per run")
    ap.add_argument("--seed", type=int, default=17)
    # peer process mode
    ap.add_argument("--peer", choices=[v for v in VARIANTS if v != "trajbus"],
                    help=argparse.SUPPRESS)
    ap.add_argument("--group", help=argparse.SUPPRESS)
    ap.add_argument("--in-topics", help=argparse.SUPPRESS)
    ap.add_argument("--out-topic", help=argparse.SUPPRESS)
    ap.add_argument("--state-topic", help=argparse.SUPPRESS)
    ap.add_argument("--schemas", help=argparse.SUPPRESS)
    ap.add_argument("--compression", default="lz4", help=argparse.SUPPRESS)
    ap.add_argument("--poll-ms", type=float, default=20.0, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.peer:
        if a.peer.startswith("confluent"):
            return peer_confluent(a)
        if a.peer.startswith("aiokafka"):
            return asyncio.run(peer_aiokafka(a))
        return peer_quix(a)
    res = main_bench(a)
    print(f"[worker] events per CPU-second draining {res['input']['records']:,} records "
          f"(medians of {a.repeat} round(s); load average {res['load_average_at_start']} -> "
          f"{res['load_average_at_end']}):")
    for v, row in res["variants"].items():
        print(f"  {v:14s} {row['events_per_cpu_s'] or 'n/a':>8} ev/CPU-s  "
              f"{row['events_per_wall_s'] or 'n/a':>8} ev/s wall  valid {row['valid_runs']}  "
              f"others on the box {row['other_processes_cores']} cores")
    for name, rt in res["ratios"].items():
        print(f"  {name}: {rt['median_of_round_ratios']} (rounds {rt['per_round']})")
    for note in res["notes"]:
        print(f"  note: {note}")
    if a.json:
        a.json.write_text(json.dumps(res, indent=2, default=str) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
