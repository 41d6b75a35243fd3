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
import json
import os
import random
import re
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from harness.drain import DrainWatch, run_measured  # noqa: E402
from harness.events import displace_late, event_templates, write_schemas  # noqa: E402
from harness.figures import median  # noqa: E402
from harness.kafka import (  # noqa: E402
    copy_topic,
    create_topics,
    end_offsets,
    produce_records,
    read_topic,
)
from harness.trees import export_ref, git_describe, git_dirty  # noqa: E402
from peers.quix import QUIX_VENV, peer_quix, quix_python  # noqa: E402
from peers.reorder_loop import peer_aiokafka, peer_confluent  # noqa: E402

TARGET_RATIO = 0.7
VARIANTS = ("trajbus", "confluent-txn", "confluent", "aiokafka-txn", "aiokafka", "quix-eos")
BASELINE = "confluent-txn"
TASKS = ("swe-bench", "web-shop", "terminal", "math")


# -- the backlog -------------------------------------------------------------------------------


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
        displace_late(evs, rng, disorder)
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
        watch = DrainWatch(a.bootstrap, f"{prefix}.reorder", f"{prefix}.sandbox.events", target)
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
        watch = DrainWatch(a.bootstrap, name, f"{src}.sandbox.events", target_src)
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


def round_ratios(runs: list[dict[str, Any]], base: list[dict[str, Any]]) -> dict[str, Any]:
    """events per CPU-second of ``runs`` / ``base``, round by round (valid pairs only), and
    their median."""
    per_round = [x["events_per_cpu_s"] / b["events_per_cpu_s"]
                 for x, b in zip(runs, base, strict=False)
                 if x.get("valid") and b.get("valid") and x.get("events_per_cpu_s")
                 and b.get("events_per_cpu_s")]
    m = median(per_round)
    return {"median_of_round_ratios": None if m is None else round(m, 3),
            "per_round": [round(x, 3) for x in per_round]}


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
        ratios[f"{v} / {BASELINE}"] = round_ratios(runs, base)
    for v, runs in rounds.items():  # the working tree against another ref, round by round
        if v.startswith("trajbus@") and "trajbus" in rounds:
            ratios[f"trajbus / {v}"] = round_ratios(rounds["trajbus"], runs)
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
