"""Many emitters in one process (issue 18, item 4): CPU of N emitters at 1 event/s each.

    python bench/bench_many_emitters.py --json out.json [--bootstrap HOST:PORT]
        [--emitters 1000] [--rate 1.0] [--seconds 25] [--rounds 1] [--trajbus-ref REF ...]
        [--no-working-tree] [--baseline] [--emit-only] [--durability os] [--send-round-ms MS]
        [--timer-slack-max-ms MS]

One child process per measurement runs ``--emitters`` :class:`SandboxEmitter` s on one event
loop (fsync durability, the process's shared producer, one state directory each), each
emitting one ToolCall every ``1 / --rate`` seconds (phases spread over the period), for
``--warmup`` seconds and then ``--seconds`` measured seconds. Reported per run: the process's
**share of a core** over the measured window (user + sys from ``os.times()`` / wall), its
split into user and sys, **events per CPU-second**, events emitted and acknowledged in the
window, emit latency (call to return: "durable on return" waits for the journal's fsync) and,
at the end, the **journal bytes on disk per emitter** (mean and max over the emitters' segment
files) and how many events were still unacknowledged then.

``--trajbus-ref REF`` adds a variant: the same child run with the package of git ``REF``
(exported with ``git archive`` and laid out as installed, first on PYTHONPATH), alternating
with the working tree's code round by round (``--rounds``), so both see the same load on a
shared box (``--no-working-tree``: only the refs, e.g. to keep others' uncommitted edits out).
``--baseline`` adds, per round, the same callers with a no-op instead of an emit (what 1,000
tasks waking once a second cost by themselves; the summary subtracts it) and ``--emit-only``
the emit calls with sending paused. Goal (issue 18): 1,000 emitters at 1 event/s each <= 0.1
of a core.

With ``--bootstrap`` it uses that broker, otherwise it starts its own (``LocalBroker``, free
ports, temporary data directory).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
GOAL_CORE_SHARE = 0.1


def _journal_bytes(state: Path) -> list[int]:
    out = []
    for d in sorted(state.iterdir()):
        total = 0
        for p in (d / "journal").glob("seg-*.log"):
            try:
                total += p.stat().st_size
            except FileNotFoundError:
                pass
        out.append(total)
    return out


async def _child(a: argparse.Namespace) -> dict[str, Any]:
    import trajbus.producers.emitter as emitter_mod
    from trajbus.bus.producer import close_producer
    from trajbus.bus.topics import Topics
    from trajbus.producers.emitter import SandboxEmitter
    from trajbus.producers.testing import create_topics, make_settings

    extra: dict[str, Any] = {} if a.send_round_ms is None else {"send_round_ms": a.send_round_ms}
    if a.journal_sync is not None:
        extra["journal_sync"] = a.journal_sync
    if a.timer_slack_max_ms is not None:
        extra["timer_slack_max_ms"] = a.timer_slack_max_ms
    if a.send_round_max_ms is not None:
        extra["send_round_max_ms"] = a.send_round_max_ms
    settings = make_settings(a.bootstrap, a.prefix, partitions=a.partitions, **extra)
    await create_topics(settings, [Topics(settings).sandbox_events])
    state = Path(tempfile.mkdtemp(prefix="bench-many-emitters-"))
    loop = asyncio.get_running_loop()
    ems: list[Any] = []
    for i in range(a.emitters):
        em = SandboxEmitter(f"many-{i}", "bench", settings=settings, state_dir=state / f"{i:05d}",
                            durability=a.durability)
        await em.start()
        ems.append(em)
    await asyncio.gather(*(em.start_episode("e") for em in ems))
    assert all(await asyncio.gather(*(em.flush(60) for em in ems)))

    period = 1.0 / a.rate
    t_start = loop.time() + 0.5
    t_measure = t_start + a.warmup
    t_end = t_measure + a.seconds
    window: dict[str, Any] = {}
    emitted = [0]
    latencies: list[float] = []
    args = {"path": "/workspace/src/main.py", "line": 42, "text": "x" * 40}

    if a.mode == "emit-only":  # sending paused: the emit calls alone
        for em in ems:
            em._sender.cancel()

    async def drive(i: int, em: Any) -> None:
        call = None if a.mode == "noop" else em.tool_call
        nxt = t_start + period * i / len(ems)
        while nxt < t_end:
            delay = nxt - loop.time()
            if delay > 0:
                await asyncio.sleep(delay)
            t = loop.time()
            if call is not None:
                await call("e", "edit_file", args)
            if t >= t_measure:
                emitted[0] += 1
                if len(latencies) < 200_000:
                    latencies.append(loop.time() - t)
            nxt += period

    async def marks() -> None:
        await asyncio.sleep(max(0.0, t_measure - loop.time()))
        window["t0"], window["c0"] = time.perf_counter(), os.times()
        window["m0"] = time.thread_time()
        window["acked0"] = sum(em.acked_count for em in ems)
        await asyncio.sleep(max(0.0, t_end - loop.time()))
        window["t1"], window["c1"] = time.perf_counter(), os.times()
        window["m1"] = time.thread_time()
        window["acked1"] = sum(em.acked_count for em in ems)

    await asyncio.gather(marks(), *(drive(i, em) for i, em in enumerate(ems)))
    wall = window["t1"] - window["t0"]
    c0, c1 = window["c0"], window["c1"]
    user, system = c1.user - c0.user, c1.system - c0.system
    cpu = user + system
    unacked_end = sum(em.pending_count for em in ems)
    sender: dict[str, Any] = {}
    shared = getattr(emitter_mod, "shared_sender", None)  # None: a commit before the sender
    if shared is not None:
        sh = shared()
        sender = {"rounds": sh.rounds, "sync_rounds": sh.sync_rounds,
                  "journals_synced": getattr(sh, "journals_synced", getattr(sh, "syncs", None)),
                  # None: a commit before the journals' group commit
                  "syncfs_calls": getattr(sh, "syncfs_calls", None),
                  "fdatasyncs": getattr(sh, "fdatasyncs", None),
                  "slow_sync_rounds": getattr(sh, "slow_sync_rounds", None),
                  # None: a commit before the loop thread's timer slack, or none applied
                  "timer_slack_ns": getattr(sh, "timer_slack_ns", None)}
    jb = _journal_bytes(state)  # before close: what a running node holds
    ok = (a.mode == "emit" and all(await asyncio.gather(*(em.flush(60) for em in ems))))
    for em in ems:
        await (em.close(10) if a.mode == "emit" else em.abort())
    await close_producer()
    shutil.rmtree(state, ignore_errors=True)
    latencies.sort()

    def pct(p: float) -> float:
        return round(latencies[min(len(latencies) - 1, int(p * len(latencies)))] * 1000, 2) \
            if latencies else 0.0

    return {
        "emitters": a.emitters, "rate_per_emitter": a.rate, "seconds": round(wall, 2),
        "mode": a.mode, "durability": a.durability,
        "send_round_ms": settings.producer.send_round_ms,
        "send_round_max_ms": getattr(settings.producer, "send_round_max_ms", None),
        "journal_sync": getattr(settings.producer, "journal_sync", "file"),
        "core_share": round(cpu / wall, 4),
        "user_share": round(user / wall, 4),
        "sys_share": round(system / wall, 4),
        # the event loop's thread; the rest is the thread pool's journal syncs
        "loop_thread_share": round((window["m1"] - window["m0"]) / wall, 4),
        "events": emitted[0], "acked": window["acked1"] - window["acked0"],
        "events_per_cpu_s": round(emitted[0] / cpu) if cpu else None,
        "us_cpu_per_event": round(cpu / emitted[0] * 1e6, 1) if emitted[0] else None,
        "emit_latency_ms": {"p50": pct(0.5), "p99": pct(0.99), "max": pct(1.0)},
        "journal_bytes_per_emitter": {"mean": round(statistics.fmean(jb)), "max": max(jb)},
        "unacked_at_end": unacked_end, "all_acked_after": ok,
        "shared_sender": sender,
        "code": str(Path(emitter_mod.__file__ or "?").parent),
    }


def run_child(a: argparse.Namespace, bootstrap: str, tree: Path | None,
              mode: str = "emit") -> dict[str, Any]:
    out = Path(tempfile.mkstemp(prefix="bench-many-emitters-", suffix=".json")[1])
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", "--bootstrap", bootstrap,
           "--prefix", f"bme-{uuid.uuid4().hex[:8]}", "--emitters", str(a.emitters),
           "--rate", str(a.rate), "--seconds", str(a.seconds), "--warmup", str(a.warmup),
           "--partitions", str(a.partitions), "--mode", mode, "--durability", a.durability,
           "--json", str(out)]
    if a.send_round_ms is not None:
        cmd += ["--send-round-ms", str(a.send_round_ms)]
    if a.journal_sync is not None:
        cmd += ["--journal-sync", a.journal_sync]
    if a.timer_slack_max_ms is not None:
        cmd += ["--timer-slack-max-ms", str(a.timer_slack_max_ms)]
    if a.send_round_max_ms is not None:
        cmd += ["--send-round-max-ms", str(a.send_round_max_ms)]
    env = dict(os.environ)
    if tree is not None:
        env["PYTHONPATH"] = str(tree)
    load0 = os.getloadavg()[0]
    proc = subprocess.run(cmd, env=env, cwd=tree or ROOT, capture_output=True, text=True,
                          timeout=a.seconds + a.warmup + 600)
    if proc.returncode != 0:
        return {"error": f"exit {proc.returncode}", "stderr": proc.stderr[-2000:]}
    res: dict[str, Any] = json.loads(out.read_text())
    out.unlink(missing_ok=True)
    if tree is not None and not res["code"].startswith(str(tree)):
        return {"error": f"ran {res['code']}, not the code in {tree}", "stderr": ""}
    res["load_average_1m"] = [round(load0, 2), round(os.getloadavg()[0], 2)]
    return res


def run_rounds(a: argparse.Namespace, bootstrap: str,
               variants: list[tuple[str, Path | None, str]],
               runs: dict[str, list[dict[str, Any]]]) -> None:
    """Every variant once per round (every other round in reverse order), each a child
    process; its figures appended to ``runs`` and printed."""
    for r in range(a.rounds):
        order = variants if r % 2 == 0 else variants[::-1]
        for name, tree, mode in order:
            res = run_child(a, bootstrap, tree, mode)
            res["round"] = r + 1
            runs[name].append(res)
            if "error" in res:
                print(f"[{name}] round {r + 1}: {res['error']}\n{res['stderr']}",
                      flush=True)
                continue
            print(f"[{name}] round {r + 1}: {res['emitters']} emitters at "
                  f"{res['rate_per_emitter']:g}/s: {res['core_share']:.3f} of a core "
                  f"(user {res['user_share']:.3f}, sys {res['sys_share']:.3f}), "
                  f"{res['events_per_cpu_s'] or 0:,} events/CPU-s, "
                  f"{res['us_cpu_per_event']} us "
                  f"CPU/event, emit p50/p99 {res['emit_latency_ms']['p50']}/"
                  f"{res['emit_latency_ms']['p99']} ms, journal "
                  f"{res['journal_bytes_per_emitter']['mean']:,} B/emitter (max "
                  f"{res['journal_bytes_per_emitter']['max']:,}), unacked at end "
                  f"{res['unacked_at_end']}, load {res['load_average_1m']}", flush=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--bootstrap", help="use this broker (default: start a local one)")
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--emitters", type=int, default=1000)
    ap.add_argument("--rate", type=float, default=1.0, help="events/s per emitter")
    ap.add_argument("--seconds", type=float, default=25.0, help="measured seconds")
    ap.add_argument("--warmup", type=float, default=5.0)
    ap.add_argument("--partitions", type=int, default=6)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--trajbus-ref", action="append", default=[], metavar="REF",
                    help="also run the code of this git ref, alternating with the working tree")
    ap.add_argument("--no-working-tree", action="store_true",
                    help="run only the --trajbus-ref variants (the tree may hold others' edits)")
    ap.add_argument("--baseline", action="store_true",
                    help="each round also runs the callers with a no-op instead of an emit (the "
                         "cost of 1,000 tasks waking once a second), subtracted in the summary")
    ap.add_argument("--emit-only", action="store_true",
                    help="each round also runs the first variant's code with sending paused "
                         "(the emit calls alone: redaction, canonical JSON, Avro, journal "
                         "append)")
    ap.add_argument("--send-round-ms", type=float, default=None,
                    help="settings.producer.send_round_ms (default: the setting's default)")
    ap.add_argument("--send-round-max-ms", type=float, default=None,
                    help="settings.producer.send_round_max_ms for every variant (default: the "
                         "setting's default)")
    ap.add_argument("--journal-sync", choices=["filesystem", "file"], default=None,
                    help="settings.producer.journal_sync (default: the setting's default, "
                         "filesystem): compare the two on the journals' filesystem")
    ap.add_argument("--timer-slack-max-ms", type=float, default=None,
                    help="settings.producer.timer_slack_max_ms for every variant (0: leave "
                         "the loop thread's timer slack alone; default: the settings' 50)")
    ap.add_argument("--durability", choices=["fsync", "os"], default="fsync",
                    help="the emitters' durability (os: no journal fdatasync; to see its cost)")
    ap.add_argument("--mode", choices=["emit", "noop", "emit-only"], default="emit",
                    help=argparse.SUPPRESS)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--prefix", default="bme", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        res = asyncio.run(_child(a))
        assert a.json is not None
        a.json.write_text(json.dumps(res))
        return 0

    # the repository first on sys.path here, not in the child, whose imports must come from
    # the tree on its PYTHONPATH
    from harness.broker import broker_for
    from harness.trees import export_ref

    sys.path.insert(0, str(ROOT))
    trees = {ref: export_ref(ref) for ref in a.trajbus_ref}
    variants: list[tuple[str, Path | None, str]] = []
    if not a.no_working_tree:
        variants.append(("working tree", None, "emit"))
    variants += [(f"@{ref}", tree, "emit") for ref, tree in trees.items()]
    first = next(iter(trees.values()), None) if a.no_working_tree else None
    if a.emit_only:
        variants.append(("emit calls only (sending paused)", first, "emit-only"))
    if a.baseline:
        variants.append(("no-op callers (baseline)", first, "noop"))
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name, _, _ in variants}
    try:
        with broker_for(a.bootstrap, "bench-many-emitters") as bootstrap:
            run_rounds(a, bootstrap, variants, runs)
    finally:
        for tree in trees.values():
            shutil.rmtree(tree.parent, ignore_errors=True)
    ok = {n: [r for r in rs if "error" not in r] for n, rs in runs.items()}
    cur = ok[variants[0][0]]
    best = min((r["core_share"] for r in cur), default=None)
    worst = max((r["core_share"] for r in cur), default=None)
    res_all: dict[str, Any] = {
        "emitters": a.emitters, "rate_per_emitter": a.rate, "seconds": a.seconds,
        "cpus": os.cpu_count(), "runs": runs,
        "targets": [{"measure": f"{a.emitters} emitters at {a.rate:g} event/s each, share of a "
                                "core (worst round)", "result": worst,
                     "target": f"<= {GOAL_CORE_SHARE}",
                     "met": worst is not None and worst <= GOAL_CORE_SHARE}],
    }
    print(f"{variants[0][0]}: share of a core {best}-{worst} (goal <= {GOAL_CORE_SHARE})")
    base = ok.get("no-op callers (baseline)") or []
    if base:
        b = statistics.fmean(r["core_share"] for r in base)
        res_all["baseline_core_share"] = round(b, 4)
        res_all["own_core_share"] = {}
        for name, rs in ok.items():
            if rs and rs[0].get("mode") != "noop":
                shares = [r["core_share"] for r in rs]
                own = [round(x - b, 4) for x in shares]
                res_all["own_core_share"][name] = own
                print(f"{name}: mean {statistics.fmean(shares):.3f} of a core; minus the no-op "
                      f"callers' {b:.3f}: {statistics.fmean(own):.3f} "
                      f"({min(own):.3f}-{max(own):.3f})")
    if a.json:
        a.json.write_text(json.dumps(res_all, indent=2) + "\n")
    return 0 if cur else 1


if __name__ == "__main__":
    sys.exit(main())
