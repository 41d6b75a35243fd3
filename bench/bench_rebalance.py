"""Latency of the partitions that stay put while a reorder worker joins and leaves (issue 18).

    python bench/bench_rebalance.py --json out.json [--bootstrap HOST:PORT] [--rounds 1]
        [--variant LABEL=REF[;ENV=VALUE...] ...] [--rate 1500] [--episodes 10000]
        [--steady 20] [--hold 20] [--window 10]

The goal: "a member joining or leaving: partitions that stay put keep flowing (their latency
during the rebalance within 2x of before)". aiokafka's group protocol is eager (every member
gives up all its partitions at every join/leave, then gets its new share), so "stay put" means
given back to the same worker.

One run, with real processes on one broker and fresh topics (``--partitions``, default 6):

1. **State.** ``--episodes`` open episodes (EpisodeStart + 1..3 tool call/result pairs) of
   ``--sandboxes`` sandboxes are produced into ``<prefix>.sandbox.events`` (sandbox i always
   into partition i mod partitions, keyed by sandbox); worker ``w1`` (``python -m trajbus
   worker --processors reorder --worker-id w1 -v``) drains them: it serves all partitions.
2. **Flow.** A paced flow of ``--rate`` events/s continues those episodes (one event per
   episode in turn, chunks every 20 ms, event_time_ms = the send time). A read_committed
   consumer of the replay topic decodes every ReplaySegment and, per event it carries
   (first_seq..last_seq), records **latency = receive time - event time** (the replay
   record's Kafka timestamp - event time, i.e. when the worker wrote it, is kept beside it),
   tagged with the event's input partition (the sandbox's partition).
3. **Timeline.** ``--warmup`` s, then ``--steady`` s measured ("before"), then ``w2`` joins,
   ``--hold`` s, then ``w2`` stops with SIGTERM (clean stop: explicit LeaveGroup), ``--hold``
   s, then the flow stops and the tail is collected.

Reported per run, for w1's **kept** partitions (those it serves while w2 is in the group: it
had them before and after both rebalances) and separately for the **moved** ones: p50/p99/max
latency of the events *sent* in the steady window, in the ``--window`` s after the join and in
the ``--window`` s after the leave; per kept partition the **stall** = the longest interval
with no replay record of that partition, among the intervals that overlap ``--window`` s after
the join (the leave), beside the longest in the steady window; and w1's log around each
rebalance (seconds after the join/leave): heartbeat told it of the rebalance, revoked, joined,
synced, assigned, "kept the state of partitions [...]" / "restored N state records ..." lines.

``--variant LABEL=REF[;ENV=VALUE...]`` (repeatable; default ``head=.``): the workers of git
``REF`` (``.`` = this working tree; another ref is exported with ``git archive`` and laid out
as installed, first on PYTHONPATH, as bench_worker.py / bench_many_emitters.py do) with extra
environment, e.g. ``hb500=.;TRAJBUS_KAFKA__HEARTBEAT_INTERVAL_MS=500``. ``--rounds`` rounds
run the variants alternately (v1, v2, v1, v2...) on the same broker, each with fresh topics.
Prints one summary line per run and a table per variant, and writes all figures as JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import itertools
import json
import os
import random
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from harness.broker import broker_for  # noqa: E402
from harness.figures import pct  # noqa: E402
from harness.groups import GroupWatch  # noqa: E402
from harness.kafka import Fleet, end_offsets  # noqa: E402
from harness.trees import export_ref, parse_variant  # noqa: E402
from harness.worker import WorkerProc, worker_env  # noqa: E402
from harness.worklog import RESTORED_RE, log_time  # noqa: E402

TASK = "rebalance"
GOAL_RATIO = 2.0
CHUNK_S = 0.02
_KEPT_RE = re.compile(r"kept the state of partitions \[([^\]]*)\]")
_ASSIGNED_RE = re.compile(r"Setting newly assigned partitions (.*) for group")
_TP_RE = re.compile(r"TopicPartition\(topic='([^']+)', partition=(\d+)\)")
# w1's log lines around a rebalance: (name, text of the first line after the event)
_MARKS = (("heartbeat_said_rebalancing", "because it is rebalancing"),
          ("revoking", "Revoking previously assigned partitions"),
          ("joined", "Joined group"),
          ("synced", "Successfully synced group"),
          ("assigned", "Setting newly assigned partitions"),
          ("kept_line", "kept the state of partitions"),
          ("restored_line", "state records for partitions"))

Record = tuple[bytes, bytes, int | None]


# -- the workload -------------------------------------------------------------------------------
@dataclass
class Ep:
    sandbox: str
    episode: str
    partition: int
    seq: int = 0

    def next(self, sent: dict[tuple[str, str, int], int] | None = None) -> Record:
        """The episode's next event (EpisodeStart, then ToolCall/ToolResult pairs), event time
        = now; ``sent`` records it."""
        from trajbus.schemas import models as m

        now = int(time.time() * 1000)
        seq = self.seq
        hdr = m.Envelope(event_id=f"{self.episode}-{seq}", task=TASK, sandbox=self.sandbox,
                         episode=self.episode, seq=seq, event_time_ms=now,
                         producer_id=f"sandbox/{self.sandbox}")
        h = f"{random.getrandbits(256):064x}"
        if seq == 0:
            ev: Any = m.EpisodeStart(header=hdr)
        elif seq % 2:
            ev = m.ToolCall(header=hdr, call_id=f"c{seq}", tool="shell", args_hash=h)
        else:
            ev = m.ToolResult(header=hdr, call_id=f"c{seq - 1}", tool="shell",
                              status=m.ToolStatus.OK, result_hash=h)
        self.seq += 1
        if sent is not None:
            sent[(self.sandbox, self.episode, seq)] = now
        return self.sandbox.encode(), ev.encode(), self.partition


def open_state(episodes: int, sandboxes: int, partitions: int, seed: int
               ) -> tuple[list[Ep], list[Record]]:
    """Open episodes (EpisodeStart + 1..3 pairs each, interleaved across episodes)."""
    rng = random.Random(seed)
    eps = [Ep(f"sb-{i % sandboxes:05d}", f"ep-{i:06d}", (i % sandboxes) % partitions)
           for i in range(episodes)]
    per_ep = [[e.next() for _ in range(1 + 2 * rng.randint(1, 3))] for e in eps]
    longest = max(map(len, per_ep))
    return eps, [evs[j] for j in range(longest) for evs in per_ep if j < len(evs)]


class Flow(threading.Thread):
    """``rate`` events/s: every CHUNK_S the events due, one per episode in turn, flushed."""

    def __init__(self, fleet: Fleet, eps: list[Ep], rate: float, seed: int) -> None:
        super().__init__(daemon=True)
        self.fleet, self.rate = fleet, rate
        self.eps = eps[:]
        random.Random(seed).shuffle(self.eps)
        self.sent: dict[tuple[str, str, int], int] = {}
        self.stop_ev = threading.Event()
        self.count = 0
        self.error: BaseException | None = None
        self.started = self.stopped = 0.0

    def run(self) -> None:
        try:
            i = 0
            self.started = t0 = time.time()
            while not self.stop_ev.is_set():
                due = int((time.time() - t0) * self.rate) - self.count
                recs = []
                for _ in range(max(0, due)):
                    recs.append(self.eps[i].next(self.sent))
                    i = (i + 1) % len(self.eps)
                if recs:
                    self.fleet.produce(recs, timeout=60)
                    self.count += len(recs)
                self.stop_ev.wait(CHUNK_S)
            self.stopped = time.time()
        except BaseException as exc:  # reported by the run
            self.error = exc


class ReplayLatency(threading.Thread):
    """A read_committed consumer of the replay topic from its current end: per event of the
    flow it sees, (receive time, replay record timestamp, event time, input partition)."""

    def __init__(self, bootstrap: str, topic: str, flow: Flow, part_of: dict[str, int]) -> None:
        from confluent_kafka import Consumer, TopicPartition

        from trajbus.schemas.codec import default_codec

        super().__init__(daemon=True)
        self.codec = default_codec()
        self.flow, self.part_of = flow, part_of
        self.c = Consumer({"bootstrap.servers": bootstrap,
                           "group.id": f"bench-rebalance-{uuid.uuid4().hex[:8]}",
                           "enable.auto.commit": False, "isolation.level": "read_committed",
                           "fetch.wait.max.ms": 20})
        md = self.c.list_topics(topic, timeout=30).topics[topic]
        parts = sorted(md.partitions)
        ends = {p: self.c.get_watermark_offsets(TopicPartition(topic, p), timeout=30)[1]
                for p in parts}
        self.c.assign([TopicPartition(topic, p, ends[p]) for p in parts])
        self.c.poll(0.2)
        self.samples: list[tuple[float, float, float, int]] = []  # recv, ts, event, partition
        self.records: dict[int, list[float]] = {}  # input partition -> receive times (s)
        self.unknown = 0  # segments of events the flow did not send (the drained state)
        self.stop_ev = threading.Event()
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            while not self.stop_ev.is_set():
                for msg in self.c.consume(1000, 0.05):
                    if msg.error() is not None:
                        continue
                    recv = time.time()
                    seg = self.codec.decode(msg.value()).record
                    h = seg["header"]
                    p = self.part_of.get(h["sandbox"])
                    ts = msg.timestamp()[1] / 1000
                    n = 0
                    for seq in range(seg["first_seq"], seg["last_seq"] + 1):
                        et = self.flow.sent.get((h["sandbox"], h["episode"], seq))
                        if et is not None and p is not None:
                            self.samples.append((recv, ts, et / 1000, p))
                            n += 1
                    if n and p is not None:
                        self.records.setdefault(p, []).append(recv)
                    elif not n:
                        self.unknown += 1
        except BaseException as exc:
            self.error = exc
        finally:
            self.c.close()


# -- analysis -----------------------------------------------------------------------------------


def latency(samples: list[tuple[float, float, float, int]], parts: set[int], t0: float,
            t1: float) -> dict[str, Any]:
    """p50/p99/max (ms) of the events sent in [t0, t1) of these input partitions: receive time
    - event time, and the replay record's timestamp - event time."""
    recv = [(r - e) * 1000 for r, _, e, p in samples if p in parts and t0 <= e < t1]
    wrote = [(ts - e) * 1000 for _, ts, e, p in samples if p in parts and t0 <= e < t1]

    def r(v: float | None) -> float | None:
        return None if v is None else round(v, 1)

    return {"n": len(recv), "p50_ms": r(pct(recv, 0.5)), "p99_ms": r(pct(recv, 0.99)),
            "max_ms": r(max(recv) if recv else None),
            "written_p50_ms": r(pct(wrote, 0.5)), "written_p99_ms": r(pct(wrote, 0.99)),
            "written_max_ms": r(max(wrote) if wrote else None)}


def longest_gap(times: list[float], t0: float, t1: float) -> float | None:
    """The longest interval (s) between consecutive receive times that overlaps [t0, t1)."""
    ts = sorted(times)
    gaps = [b - a for a, b in itertools.pairwise(ts) if b > t0 and a < t1]
    return round(max(gaps), 3) if gaps else None


def log_marks(path: Path, t0: float, t1: float) -> dict[str, Any]:
    """w1's log lines between t0 and t1: the first of each mark (s after t0) and the
    kept/restored lines."""
    marks: dict[str, float] = {}
    lines: list[str] = []
    text = path.read_text(errors="replace") if path.exists() else ""
    for line in text.splitlines():
        t = log_time(line)
        if t is None or t < t0 or t >= t1:
            continue
        for name, needle in _MARKS:
            if name not in marks and needle in line:
                marks[name] = round(t - t0, 3)
        if _KEPT_RE.search(line) or RESTORED_RE.search(line):
            lines.append(f"+{t - t0:.2f}s " + line.split(" INFO ", 1)[-1].strip())
    return {"after_s": marks, "state_lines": lines,
            "restored_records": sum(int(m.group(1)) for line in lines
                                    if (m := RESTORED_RE.search(line)))}


def assignments(path: Path, topic: str) -> list[tuple[float, set[int]]]:
    """(log time, partitions of ``topic``) of every assignment in a worker's log."""
    out = []
    for line in (path.read_text(errors="replace") if path.exists() else "").splitlines():
        m = _ASSIGNED_RE.search(line)
        t = log_time(line)
        if m is not None and t is not None:
            out.append((t, {int(p) for tp, p in _TP_RE.findall(m.group(1)) if tp == topic}))
    return out


# -- one run --------------------------------------------------------------------------------------
def one_run(a: argparse.Namespace, bootstrap: str, label: str, ref: str, extra: dict[str, str],
            tree: Path | None, rnd: int, work: Path) -> dict[str, Any]:
    from trajbus.bus.admin import ensure_base_topics
    from trajbus.bus.settings import KafkaSettings, Settings, TopicSettings
    from trajbus.bus.topics import Topics

    load0 = os.getloadavg()
    prefix = f"bench-rebalance-{label}-r{rnd}-{uuid.uuid4().hex[:6]}"
    settings = Settings(kafka=KafkaSettings(bootstrap_servers=bootstrap),
                        topics=TopicSettings(prefix=prefix, partitions=a.partitions))
    topics = Topics(settings)
    asyncio.run(ensure_base_topics(settings, [TASK]))
    compression = KafkaSettings().compression_type or "none"
    # TRAJBUS_DEBUG, every client line: the log's rebalance marks include a repeated warning
    # ("Heartbeat failed ... because it is rebalancing"), which the worker's client-log
    # limiter otherwise passes once per 30 s
    env = worker_env(bootstrap, prefix, a.partitions,
                     TRAJBUS_STATE_DIR=str(work / f"state-{prefix}"), TRAJBUS_DEBUG="1")
    if tree is not None:  # the exported ref's package comes first on the path
        env["PYTHONPATH"] = str(tree)
    env.update(extra)
    cwd = tree or ROOT
    logs = {w: work / f"{label}-r{rnd}-{w}.log" for w in ("w1", "w2")}
    w1 = WorkerProc(env, work, "w1", cwd, logs["w1"])
    w2 = WorkerProc(env, work, "w2", cwd, logs["w2"])
    eps, records = open_state(a.episodes, a.sandboxes, a.partitions, a.seed + rnd)
    part_of = {e.sandbox: e.partition for e in eps}
    fleet = Fleet(bootstrap, topics.sandbox_events, compression)
    flow_fleet = Fleet(bootstrap, topics.sandbox_events, compression)
    group = GroupWatch(bootstrap, f"{prefix}.reorder", topics.sandbox_events)
    flow: Flow | None = None
    watch: ReplayLatency | None = None
    res: dict[str, Any] = {"variant": label, "ref": ref, "env": extra, "round": rnd,
                           "prefix": prefix}
    try:
        fleet.produce(records, timeout=a.timeout)
        res["state_events"] = len(records)
        del records
        w1.start()
        assert w1.proc is not None
        group.wait_caught_up(end_offsets(bootstrap, topics.sandbox_events), w1.proc, a.timeout)
        flow = Flow(flow_fleet, eps, a.rate, a.seed + rnd)
        watch = ReplayLatency(bootstrap, topics.replay(TASK), flow, part_of)
        watch.start()
        flow.start()
        time.sleep(a.warmup)
        t_steady = time.time()
        time.sleep(a.steady)
        t_join = time.time()
        w2.start()
        time.sleep(a.hold)
        if w2.proc is None or w2.proc.poll() is not None:
            raise RuntimeError(f"w2 exited early ({logs['w2']})")
        t_leave = time.time()
        res["w2_exit"] = w2.stop()
        t_left = time.time()
        time.sleep(a.hold)
        t_end = time.time()
        flow.stop_ev.set()
        flow.join(30)
        time.sleep(a.tail)
        if w1.proc.poll() is not None:
            raise RuntimeError(f"w1 exited ({w1.proc.returncode}; {logs['w1']})")
    finally:
        if flow is not None:
            flow.stop_ev.set()
            flow.join(30)
        if watch is not None:
            watch.stop_ev.set()
            watch.join(30)
        w2.stop()
        w1.stop()
        fleet.close()
        flow_fleet.close()
        group.close()
        gc.collect()
    for thread in (flow, watch):
        if thread is not None and thread.error is not None:
            raise RuntimeError(f"{type(thread).__name__}: {thread.error!r}")
    assert flow is not None and watch is not None
    res["w2_stop_s"] = round(t_left - t_leave, 2)

    # which partitions stayed with w1 while w2 was in the group
    all_parts = set(range(a.partitions))
    w1_assign = assignments(logs["w1"], topics.sandbox_events)
    during = [ps for t, ps in w1_assign if t_join <= t < t_leave]
    kept = during[-1] if during else set()
    if not kept or kept == all_parts:
        res["note"] = f"w1's assignment while w2 was in the group not found: {w1_assign}"
    moved = all_parts - kept
    res["kept_partitions"], res["moved_partitions"] = sorted(kept), sorted(moved)

    samples = watch.samples
    w = a.window
    windows = {"steady": (t_steady, t_join), "after_join": (t_join, t_join + w),
               "after_leave": (t_leave, t_leave + w)}
    for cls, parts in (("kept", kept), ("moved", moved)):
        res[cls] = {name: latency(samples, parts, t0, t1) for name, (t0, t1) in windows.items()}
        steady = res[cls]["steady"]
        for name in ("after_join", "after_leave"):
            cur = res[cls][name]
            res[cls][name]["ratio_to_steady"] = {
                k: (round(cur[k] / steady[k], 2) if cur[k] and steady[k] else None)
                for k in ("p50_ms", "p99_ms", "max_ms")}
    # p99 per second of send time, seconds relative to the join: where the bad moments are
    per_s: dict[str, dict[int, list[float]]] = {"kept": {}, "moved": {}}
    for r, _, e, p in samples:
        if t_steady <= e < t_end:
            per_s["kept" if p in kept else "moved"].setdefault(
                int(e - t_join + 1000) - 1000, []).append((r - e) * 1000)
    res["_p99_per_s"] = {cls: {str(sec): round(pct(v, 0.99) or 0) for sec, v in sorted(b.items())}
                         for cls, b in per_s.items()}
    res["stall_s"] = {
        str(p): {"steady": longest_gap(watch.records.get(p, []), t_steady, t_join),
                 "join": longest_gap(watch.records.get(p, []), t_join, t_join + w),
                 "leave": longest_gap(watch.records.get(p, []), t_leave, t_leave + w)}
        for p in sorted(all_parts)}
    res["w1_log"] = {"join": log_marks(logs["w1"], t_join, t_leave),
                     "leave": log_marks(logs["w1"], t_leave, t_end)}
    res["w2_log"] = log_marks(logs["w2"], t_join, t_left)
    res["flow"] = {"events": flow.count, "rate_per_s": round(
        flow.count / max(1e-9, (flow.stopped or t_end) - flow.started)),
        "events_seen_on_replay": len(samples), "other_segments": watch.unknown}
    sent_before_end = sum(1 for t in flow.sent.values() if t / 1000 < t_end - 2)
    seen_before_end = sum(1 for _, _, e, _ in samples if e < t_end - 2)
    res["flow"]["unseen_sent_before_end_minus_2s"] = sent_before_end - seen_before_end
    res["load_average_1m"] = [round(load0[0], 2), round(os.getloadavg()[0], 2)]
    res["_logs"] = {k: str(v) for k, v in logs.items()}
    return res


# -- summary ------------------------------------------------------------------------------------
def _f(v: Any) -> str:
    return "-" if v is None else (f"{v:,.0f}" if isinstance(v, float) and v >= 100 else str(v))


def run_line(r: dict[str, Any]) -> str:
    k, mv = r["kept"], r["moved"]
    stalls = r["stall_s"]
    kj = max((stalls[str(p)]["join"] or 0) for p in r["kept_partitions"]) if r[
        "kept_partitions"] else None
    kl = max((stalls[str(p)]["leave"] or 0) for p in r["kept_partitions"]) if r[
        "kept_partitions"] else None
    ks = max((stalls[str(p)]["steady"] or 0) for p in r["kept_partitions"]) if r[
        "kept_partitions"] else None
    restored = (r["w1_log"]["join"]["restored_records"], r["w1_log"]["leave"]["restored_records"])
    return (f"[rebalance] {r['variant']} round {r['round']}: kept {r['kept_partitions']} p99 "
            f"steady/join/leave {_f(k['steady']['p99_ms'])}/{_f(k['after_join']['p99_ms'])}/"
            f"{_f(k['after_leave']['p99_ms'])} ms, max {_f(k['steady']['max_ms'])}/"
            f"{_f(k['after_join']['max_ms'])}/{_f(k['after_leave']['max_ms'])} ms; longest "
            f"silence steady/join/leave {ks}/{kj}/{kl} s; moved p99 join/leave "
            f"{_f(mv['after_join']['p99_ms'])}/{_f(mv['after_leave']['p99_ms'])} ms; w1 restored "
            f"{restored[0]:,}/{restored[1]:,} records at join/leave; load "
            f"{r['load_average_1m']}")


def summarise(runs: list[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for label in dict.fromkeys(r["variant"] for r in runs):
        rs = [r for r in runs if r["variant"] == label and "error" not in r]
        if not rs:
            continue
        v: dict[str, Any] = {"runs": len(rs)}
        for cls in ("kept", "moved"):
            for win in ("steady", "after_join", "after_leave"):
                for q in ("p50_ms", "p99_ms", "max_ms"):
                    v.setdefault(cls, {}).setdefault(win, {})[q] = [r[cls][win][q] for r in rs]
        for ev in ("steady", "join", "leave"):
            v.setdefault("kept_stall_s", {})[ev] = [
                max((r["stall_s"][str(p)][ev] or 0) for p in r["kept_partitions"])
                for r in rs if r["kept_partitions"]]
        v["w1_restored_records"] = {
            ev: [r["w1_log"][ev]["restored_records"] for r in rs] for ev in ("join", "leave")}
        v["w1_log_after_s"] = {ev: [r["w1_log"][ev]["after_s"] for r in rs]
                               for ev in ("join", "leave")}
        # a round where w1 kept nothing (w2 never got partitions: "note") measures nothing
        worst = [None if r.get("note") else max(r["kept"][w]["ratio_to_steady"]["p99_ms"] or 0
                                                for w in ("after_join", "after_leave"))
                 for r in rs]
        v["kept_p99_ratio_worst"] = worst
        v["valid_rounds"] = sum(x is not None for x in worst)
        v["goal_met_p99"] = all(x <= GOAL_RATIO for x in worst if x is not None) and any(
            x is not None for x in worst)
        out[label] = v
    return out


def print_table(summary: dict[str, Any]) -> None:
    print("\nvariant   class  window       p50 ms (runs)        p99 ms (runs)        max ms (runs)")
    for label, v in summary.items():
        for cls in ("kept", "moved"):
            for win in ("steady", "after_join", "after_leave"):
                row = v[cls][win]
                print(f"{label:<9} {cls:<6} {win:<12} "
                      + " ".join(f"{'/'.join(_f(x) for x in row[q]):<20}"
                                 for q in ("p50_ms", "p99_ms", "max_ms")))
        st = v["kept_stall_s"]
        print(f"{label:<9} kept partitions' longest silence (s): steady {st['steady']}, join "
              f"{st['join']}, leave {st['leave']}; w1 restored {v['w1_restored_records']}; "
              f"kept p99 after/before worst {v['kept_p99_ratio_worst']} (None: a round where "
              f"w1 kept nothing; goal <= {GOAL_RATIO:g} in {v['valid_rounds']} valid round(s):"
              f" {'met' if v['goal_met_p99'] else 'missed'})")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", required=True, type=Path, help="write the figures here")
    ap.add_argument("--bootstrap", help="use this broker (default: start a local one)")
    ap.add_argument("--variant", action="append", default=None, metavar="LABEL=REF[;ENV=V]",
                    help="workers of git REF ('.' = this tree) with extra env (default head=.)")
    ap.add_argument("--rounds", type=int, default=1, help="rounds of every variant, alternating")
    ap.add_argument("--partitions", type=int, default=6)
    ap.add_argument("--episodes", type=int, default=10_000, help="open episodes (state)")
    ap.add_argument("--sandboxes", type=int, default=1_000)
    ap.add_argument("--rate", type=float, default=1_500.0, help="flow, events/s")
    ap.add_argument("--warmup", type=float, default=5.0)
    ap.add_argument("--steady", type=float, default=20.0, help="measured steady seconds")
    ap.add_argument("--hold", type=float, default=20.0, help="seconds after the join / leave")
    ap.add_argument("--window", type=float, default=10.0,
                    help="seconds after the join / leave measured")
    ap.add_argument("--tail", type=float, default=5.0, help="seconds to collect the tail")
    ap.add_argument("--timeout", type=float, default=300.0)
    ap.add_argument("--seed", type=int, default=18)
    ap.add_argument("--dir", type=Path, help="work directory for the logs (default: temp)")
    a = ap.parse_args(argv)
    variants = [parse_variant(s) for s in (a.variant or ["head=."])]
    work = a.dir or Path(tempfile.mkdtemp(prefix="bench-rebalance-"))
    work.mkdir(parents=True, exist_ok=True)
    trees = {ref: (None if ref == "." else export_ref(ref)) for _, ref, _ in variants}
    load_start = os.getloadavg()
    started = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
    runs: list[dict[str, Any]] = []
    try:
        with broker_for(a.bootstrap, "bench-rebalance") as bootstrap:
            for rnd in range(1, a.rounds + 1):
                for label, ref, extra in variants:
                    try:
                        r = one_run(a, bootstrap, label, ref, extra, trees[ref], rnd, work)
                    except Exception as exc:  # reported; the other runs go on
                        r = {"variant": label, "round": rnd,
                             "error": f"{type(exc).__name__}: {exc}"}
                        print(f"[rebalance] {label} round {rnd}: {r['error']}", flush=True)
                    else:
                        print(run_line(r), flush=True)
                    runs.append(r)
    finally:
        for tree in trees.values():
            if tree is not None:
                shutil.rmtree(tree.parent, ignore_errors=True)
    summary = summarise(runs)
    refs = {label: subprocess.run(["git", "log", "-1", "--format=%h %s", ref if ref != "."
                                   else "HEAD"], cwd=ROOT, capture_output=True,
                                  text=True).stdout.strip()[:90] for label, ref, _ in variants}
    out: dict[str, Any] = {
        "name": "rebalance", "started": started, "cpus": os.cpu_count(),
        "variants": {label: {"ref": ref, "commit": refs[label], "env": extra}
                     for label, ref, extra in variants},
        "input": {"partitions": a.partitions, "open_episodes": a.episodes,
                  "sandboxes": a.sandboxes, "rate_per_s": a.rate, "steady_s": a.steady,
                  "hold_s": a.hold, "window_s": a.window},
        "measure": "latency = receive time at a read_committed replay consumer - event_time_ms "
                   "(= send time), per event, by the input partition of its sandbox; windows by "
                   "send time; 'written_*' = the replay record's Kafka timestamp - event time; "
                   "stall = longest interval without a replay record of the partition "
                   "overlapping the window",
        "summary": summary,
        "load_average_at_start": [round(x, 2) for x in load_start],
        "load_average_at_end": [round(x, 2) for x in os.getloadavg()],
        "_runs": runs, "_logs": str(work),
    }
    head = summary.get(variants[-1][0]) or {}
    if head:
        out["targets"] = [{
            "measure": f"{variants[-1][0]}: p99 latency of w1's kept partitions in the "
                       f"{a.window:g} s after a join/leave / p99 before (worst of "
                       f"{head['runs']} run(s))",
            "result": max((x for x in head["kept_p99_ratio_worst"] if x is not None),
                          default=None), "target": f"<= {GOAL_RATIO:g}",
            "met": head["goal_met_p99"]}]
    a.json.write_text(json.dumps(out, indent=2, default=str) + "\n")
    print_table(summary)
    print(f"rebalance: logs in {work}; load {out['load_average_at_start']} -> "
          f"{out['load_average_at_end']}")
    return 0 if all("error" not in r for r in runs) else 1


if __name__ == "__main__":
    raise SystemExit(main())
