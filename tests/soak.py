"""The soak: the whole pipeline run back to back under stress, every run checked exactly.

    make soak                                   # 10 runs (the issue's bar), ~10-15 minutes
    .venv/bin/python tests/soak.py --runs 3     # fewer; --help for every knob

Each run is `trajbus demo`'s pipeline (simulated fleet with loops, crashes, migrations,
re-sent duplicates and out-of-order delivery -> worker -> trainer -> archiver) with its own
topic prefix, on ONE private broker shared by all runs, while:

- the CPU is saturated by competing busy processes (``--hogs``, default: one per core);
- the worker is SIGKILLed mid-run and restarted (every run, at a different moment);
- the broker is restarted mid-run (runs 1, 3, 5, ...) and before the run (runs 2, 4, ...).

A run passes only if the demo's check passes: every acknowledged event reached the trainer
once and in order, the replay topics hold each event once with no false gap, every planted
loop was caught and nothing else, every sandbox drained and recycled, no dead letter, no
anomaly, and the archive holds every acknowledged event once. The results go to
``.trajbus/soak/results.jsonl`` (one line per run: conditions, seconds, pass/fail) and a
table at the end; the exit status is non-zero if any run failed. RELIABILITY.md records them.

``tests/faults/test_soak_short.py`` runs one such run (worker kill + broker restart + hogs) in CI.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from cluster_faults import FAULTS, Fault

from trajbus.bus.settings import ArchiveSettings, KafkaSettings, Settings, TopicSettings
from trajbus.demo import isolated_run
from trajbus.infra.broker import LocalBroker, free_port
from trajbus.infra.cluster import LocalCluster
from trajbus.pipeline_demo import Faults, run_pipeline

REPO = Path(__file__).resolve().parents[1]


@dataclass
class RunResult:
    run: int
    seed: int
    ok: bool
    seconds: float
    faults: list[str]
    broker_restarted_before: bool
    output_tail: str = ""


async def broker_ready(settings: Settings, timeout: float = 180.0) -> None:
    """Wait until the (re)started broker serves an idempotent producer. A broker that has just
    started on a saturated box can take longer than the clients' 10 s fail-fast to hand out a
    producer id (its transaction-state topic is created on first use); the harness, like a
    deployment's readiness probe, waits for that before the next run."""
    from trajbus.bus.kafka import BrokerUnavailableError
    from trajbus.bus.producer import close_producer, get_producer

    deadline = time.monotonic() + timeout
    while True:
        try:
            await get_producer(settings.kafka)
            return
        except BrokerUnavailableError:
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(1.0)
        finally:
            await close_producer()


@contextlib.contextmanager
def cpu_hogs(n: int, niceness: int = 0) -> Iterator[list[subprocess.Popen[bytes]]]:
    """``n`` processes spinning on a core each, for the duration, at ``niceness`` (19: they
    take only the CPU that nothing else wants, so the cores stay saturated without taking
    turns from the other processes on the box)."""
    spin = f"import os\nos.nice({niceness})\nwhile True: pass"
    procs = [subprocess.Popen([sys.executable, "-c", spin]) for _ in range(n)]
    try:
        yield procs
    finally:
        for p in procs:
            p.kill()
        for p in procs:
            p.wait(timeout=10)


def hog_niceness_beside_other_tests() -> int:
    """The niceness of a CI test's hogs: 19 when other pytest-xdist workers share the machine
    (`make test`: their brokers, workers and clients already keep more runnable processes
    than cores, so the hogs only fill what they leave idle), else 0 (a test run alone: the
    hogs are the competition)."""
    return 19 if int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")) > 1 else 0


async def soak_run(settings: Settings, broker: LocalBroker | LocalCluster, run: int,
                   seed: int, *, sandboxes: int, episodes: int, work_root: Path,
                   restart_mid_run: bool, rng: random.Random, outage_s: float = 0.0,
                   node_fault: Fault | None = None) -> RunResult:
    """One checked pipeline run with a worker SIGKILL and a broker restart mid-run (the
    broker held down at least ``outage_s``) or, on a cluster, ``node_fault``."""
    import io
    from contextlib import redirect_stdout

    def stop_wait_start() -> None:
        broker.stop()
        time.sleep(outage_s)  # a worker thread: the pipeline's event loop runs on meanwhile
        broker.start(120)

    run_settings = isolated_run(settings, seed)

    async def restart_broker() -> str | None:
        if node_fault is not None:
            assert isinstance(broker, LocalCluster)
            return await node_fault(broker, run_settings, rng)
        await asyncio.to_thread(stop_wait_start)
        return None

    faults = Faults(kill_worker_after_s=rng.uniform(1.0, 8.0),
                    restart_broker_after_s=rng.uniform(2.0, 10.0) if restart_mid_run else None,
                    restart_broker=restart_broker if restart_mid_run else None)
    out = io.StringIO()
    t0 = time.monotonic()
    try:
        with redirect_stdout(out):
            code = await run_pipeline(run_settings, sandboxes, episodes, seed,
                                      work_root=work_root, settle_timeout_s=300, faults=faults)
    except Exception:  # a run that blows up is a failed run, recorded; the soak goes on
        import traceback

        code = 1
        out.write(traceback.format_exc())
    text = out.getvalue()
    print(text, flush=True)
    return RunResult(run, seed, code == 0, round(time.monotonic() - t0, 1), faults.log,
                     False, text[-3000:] if code else "")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="soak", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=10, help="pipeline runs (default 10)")
    ap.add_argument("--sandboxes", type=int, default=40, help="sandboxes per run (default 40)")
    ap.add_argument("--episodes", type=int, default=3, help="episodes per sandbox (default 3)")
    ap.add_argument("--hogs", type=int, default=os.cpu_count() or 2,
                    help="busy processes competing for the CPU (default: one per core)")
    ap.add_argument("--hog-niceness", type=int, default=0, metavar="N",
                    help="the hogs' niceness (default 0; 19: they only fill idle CPU)")
    ap.add_argument("--outage-s", type=float, default=0.0,
                    help="hold the broker down at least this long in a mid-run restart "
                         "(default 0: as long as a restart takes); longer than the 30 s drain "
                         "window makes the scheduler recycle draining sandboxes with loss, "
                         "which the check accepts only where the log shows it")
    ap.add_argument("--nodes", type=int, default=1,
                    help="run on a local cluster of this many nodes (3: production's shape, "
                         "replication factor 3, min.insync.replicas 2); every run then gets a "
                         "node fault (--fault) at a random moment instead of a broker restart")
    ap.add_argument("--fault", default="random", choices=[*FAULTS, "cycle"],
                    help="with --nodes: the node fault of every run (default random: SIGKILL a "
                         "random node, start it 10 s later; cycle: each kind in turn; see "
                         "tests/cluster_faults.py)")
    ap.add_argument("--repeat-each", type=int, default=1, metavar="N",
                    help="with --fault cycle: N runs in a row of each kind (the fault suite: "
                         "--fault cycle --repeat-each 3 --runs 24)")
    ap.add_argument("--seed", type=int, default=None,
                    help="first run's seed (default: from the clock; printed)")
    ap.add_argument("--work", type=Path, default=REPO / ".trajbus" / "soak",
                    help="work directory: broker data, run logs, results.jsonl")
    args = ap.parse_args(argv)
    return asyncio.run(_soak(args))


async def _soak(args: argparse.Namespace) -> int:
    seed0 = args.seed if args.seed is not None else int(time.time()) % 100_000
    rng = random.Random(seed0)
    work: Path = args.work
    work.mkdir(parents=True, exist_ok=True)
    results_path = work / "results.jsonl"
    cluster = args.nodes > 1
    broker: LocalBroker | LocalCluster = (
        LocalCluster(work / f"kafka-cluster-{seed0}", args.nodes, base_port=0) if cluster
        else LocalBroker(data_dir=work / f"kafka-{seed0}", port=free_port(),
                         controller_port=free_port()))
    where = (f"a {args.nodes}-node cluster on {broker.bootstrap}, node fault {args.fault}"
             if cluster else f"broker on {broker.bootstrap}")
    print(f"[soak] seed {seed0}: {args.runs} runs of {args.sandboxes} sandboxes x "
          f"{args.episodes} episodes, {args.hogs} CPU hogs (nice {args.hog_niceness}), "
          f"{where}", flush=True)
    broker.start(timeout=180)
    # the in-process clients (fleet, trainer, archiver) give a loaded broker 30 s, not 10 s
    settings = Settings(kafka=KafkaSettings(bootstrap_servers=broker.bootstrap,
                                            connect_timeout_s=30.0),
                        topics=TopicSettings(prefix="soak",
                                             replication_factor=min(args.nodes, 3)),
                        archive=ArchiveSettings(url=str(work / "archive"),
                                                spool_dir=str(work / "spool")))
    results: list[RunResult] = []
    try:
        with cpu_hogs(args.hogs, args.hog_niceness):
            for i in range(args.runs):
                restart_mid_run = cluster or i % 2 == 0
                restarted_before = False
                fault_name = (list(FAULTS)[(i // max(1, args.repeat_each)) % len(FAULTS)]
                              if args.fault == "cycle" else args.fault)
                if i > 0 and not restart_mid_run:
                    await asyncio.to_thread(broker.restart, 120)
                    restarted_before = True
                await broker_ready(settings)
                seed = seed0 + i
                print(f"[soak] run {i + 1}/{args.runs} (seed {seed}): worker SIGKILL mid-run"
                      + (f", node fault {fault_name} mid-run" if cluster
                         else ", broker restart mid-run" if restart_mid_run else "")
                      + (", broker restarted before" if restarted_before else ""), flush=True)
                res = await soak_run(settings, broker, i + 1, seed, sandboxes=args.sandboxes,
                                     episodes=args.episodes, work_root=work / "runs",
                                     restart_mid_run=restart_mid_run, rng=rng,
                                     outage_s=args.outage_s,
                                     node_fault=FAULTS[fault_name] if cluster else None)
                res.broker_restarted_before = restarted_before
                results.append(res)
                with results_path.open("a") as f:
                    f.write(json.dumps({**res.__dict__, "hogs": args.hogs,
                                        "nodes": args.nodes,
                                        "fault": fault_name if cluster else None,
                                        "outage_s": args.outage_s,
                                        "sandboxes": args.sandboxes,
                                        "episodes": args.episodes,
                                        "at": time.strftime("%Y-%m-%dT%H:%M:%SZ",
                                                            time.gmtime())}) + "\n")
                print(f"[soak] run {i + 1}: {'PASS' if res.ok else 'FAIL'} in {res.seconds}s",
                      flush=True)
    finally:
        broker.stop(timeout=30)
    passed = sum(r.ok for r in results)
    faults = (f"a node fault ({args.fault}) mid-run in every run on a {args.nodes}-node "
              "cluster" if cluster else "broker restarted mid-run in runs 1, 3, ...; before "
              "the run in runs 2, 4, ...")
    print(f"\n=== soak: {passed}/{len(results)} runs exact ({args.hogs} CPU hogs; worker "
          f"SIGKILLed in every run; {faults}) ===")
    for r in results:
        print(f"run {r.run:2d} seed {r.seed}: {'PASS' if r.ok else 'FAIL'} {r.seconds:6.1f}s  "
              + "; ".join(r.faults))
    print(f"results appended to {results_path}")
    return 0 if passed == len(results) and results else 1


if __name__ == "__main__":
    sys.exit(main())
