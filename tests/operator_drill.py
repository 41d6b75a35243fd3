"""The operators' drill (issue 37): what the tools say after a rough hour, checked exactly.

    .venv/bin/python tests/operator_drill.py --runs 5        # the issue's bar, ~3 min a run
    .venv/bin/python tests/operator_drill.py --help

Each run, with its own topic prefix on one private broker shared by all runs:

- two workers (reorder, watchdog, scheduler each), one SIGKILLed mid-run and restarted;
- two simulated fleets at once (closed loop, planted loops and cycles): one on the broker's
  clock, one whose sandboxes' clocks lag it by three hours;
- a 20 s broker outage while the fleets run (a worker that was restarting then fails fast at
  start-up, by design; the drill starts it again, as a deployment's process supervisor does);
- bad input planted on the sandbox-events topic: bytes that are not Avro, an unknown schema
  fingerprint, an id that is not allowed, and a conflicting version of an event the reorder
  already released (far behind its window).

Then, once every group has caught up, the run passes only if:

- **loops**: every planted loop has exactly one LOOP alert, and nothing else has one;
- **tools agree**: `alerts` lists each planted loop once; `watchdog explain --from-log`
  (``watchdog_history``) says the loop rule fired in each looping episode; for a sample of
  looping sandboxes `replay explain` re-runs the processors over the log with no divergence;
- **dead letters**: each planted bad record is dead-lettered, and by each stage at most once;
  nothing else is dead-lettered;
- **redrive**: re-driving the dead letters sends each redrivable source record once and
  refuses the permanent failures; a second redrive sends nothing.

Results go to ``<work>/results.jsonl`` (one line per run) and a table at the end; the exit
status is non-zero if any run failed. RELIABILITY.md records the runs.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import random
import sys
import time
import traceback
import uuid
from collections import Counter, defaultdict
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from faults_support import read_all, wait_caught_up  # noqa: E402
from support import Worker, settings_for  # noqa: E402

from trajbus.bus.settings import Settings  # noqa: E402
from trajbus.bus.topics import Topics  # noqa: E402
from trajbus.infra.broker import LocalBroker, free_port  # noqa: E402
from trajbus.schemas import models as m  # noqa: E402
from trajbus.schemas.codec import default_codec  # noqa: E402

TASKS = ["swe-bench", "web-shop"]
LAG_MS = 3 * 3_600_000
codec = default_codec()


@dataclass
class RunResult:
    run: int
    seed: int
    ok: bool
    seconds: float
    loops_planted: int = 0
    loop_alerts: int = 0
    bad_planted: int = 0
    dead_letters: int = 0
    redriven: int = 0
    failures: list[str] = field(default_factory=list)
    faults: list[str] = field(default_factory=list)


@dataclass
class Planted:
    """A bad record written to the sandbox-events topic, and where it landed."""

    what: str
    partition: int
    offset: int
    permanent: bool  # can never be processed as it is (redrive must refuse it)


async def _produce(settings: Settings, topic: str, key: str, value: bytes) -> tuple[int, int]:
    from aiokafka import AIOKafkaProducer

    producer = AIOKafkaProducer(bootstrap_servers=settings.kafka.bootstrap_servers)
    await producer.start()
    try:
        md = await producer.send_and_wait(topic, value, key=key.encode())
        return md.partition, md.offset
    finally:
        await producer.stop()


async def plant_bad_input(settings: Settings, manifest: Any) -> list[Planted]:
    topics = Topics(settings)
    planted: list[Planted] = []

    async def put(what: str, key: str, value: bytes, permanent: bool) -> None:
        p, o = await _produce(settings, topics.sandbox_events, key, value)
        planted.append(Planted(what, p, o, permanent))

    await put("not avro", "sb-junk", b"this is not avro at all", True)
    await put("unknown schema", "sb-junk", b"\xc3\x01" + bytes(8) + b"\x00\x00", True)
    t = int(time.time() * 1000)
    bad_id = m.Heartbeat(header=m.Envelope(
        event_id=uuid.uuid4().hex, task="web-shop", sandbox="sb/../../etc", seq=0,
        event_time_ms=t, producer_id="drill"))
    await put("invalid id", "sb/../../etc", bad_id.encode(), True)
    # a conflicting version of an event the reorder released long ago (seq 1 of the longest
    # acknowledged episode: far behind the reorder's window by now)
    ep = max((e for e in manifest.episodes if e.acked), key=lambda e: len(e.acked))
    seq, event_id = ep.acked[1]
    conflict = m.ToolCall(header=m.Envelope(
        event_id=event_id, task=ep.task, sandbox=ep.sandbox, episode=ep.episode, seq=seq,
        event_time_ms=t, producer_id="drill"), call_id="drill-conflict", tool="rm",
        args_hash="c" * 64)
    await put("conflicting duplicate", ep.sandbox, conflict.encode(), True)
    return planted


LOG_FORMAT = "%(asctime)s %(name)s %(levelname)s %(message)s"


async def run_once(broker: LocalBroker, run: int, seed: int, work: Path,
                   sandboxes: int, episodes: int, explain_sample: int) -> RunResult:
    from trajbus.bus.admin import ensure_base_topics, register_schemas
    from trajbus.bus.producer import close_producer
    from trajbus.producers.simulator import simulate

    started = time.monotonic()
    result = RunResult(run, seed, False, 0.0)
    prefix = f"drill{run}x{uuid.uuid4().hex[:5]}"
    settings = settings_for(broker.bootstrap, prefix, partitions=3)
    topics = Topics(settings)
    run_dir = work / prefix
    run_dir.mkdir(parents=True, exist_ok=True)
    # this process's own warnings (the simulated fleets' producers, the checks) beside the
    # workers' logs, as well as on stderr
    own_log = logging.FileHandler(run_dir / "drill.log")
    own_log.setFormatter(logging.Formatter(LOG_FORMAT))
    logging.getLogger().addHandler(own_log)
    await ensure_base_topics(settings, TASKS)
    await register_schemas(settings)
    workers = [Worker(settings, "reorder,watchdog,scheduler", worker_id=f"w{i}",
                      log_path=run_dir / f"worker{i}.log").start() for i in (1, 2)]
    rng = random.Random(seed)
    fails = result.failures

    async def supervise() -> None:
        # As a deployment's process supervisor does: a worker that exited at start-up because
        # the broker did not answer (restarted into the outage: it fails fast by design) is
        # started again. Any other exit is a failure (found after the fleets, below).
        while True:
            await asyncio.sleep(0.5)
            for i, w in enumerate(workers):
                if w.proc is None or w.proc.poll() is None or w.proc.returncode == 0:
                    continue
                assert w.log_path is not None
                tail = w.log_path.read_text(errors="replace")[-4000:]
                if "trajbus: error:" not in tail or "did not answer" not in tail:
                    continue  # not a fail-fast exit: left for the check below
                result.faults.append(f"{w.worker_id} exited at start-up (broker down) at "
                                     f"{time.monotonic() - started:.1f}s, restarted")
                workers[i] = Worker(settings, "reorder,watchdog,scheduler",
                                    worker_id=w.worker_id, log_path=w.log_path).start()

    async def faults() -> None:
        await asyncio.sleep(rng.uniform(4, 8))
        workers[0].kill()
        result.faults.append(f"SIGKILL w1 at {time.monotonic() - started:.1f}s")
        workers[0] = Worker(settings, "reorder,watchdog,scheduler", worker_id="w1",
                            log_path=run_dir / "worker1.log").start()
        await asyncio.sleep(rng.uniform(4, 8))
        at = time.monotonic() - started
        await asyncio.to_thread(broker.stop)
        await asyncio.sleep(20)
        await asyncio.to_thread(broker.start, 120)
        result.faults.append(f"broker down 20 s at {at:.1f}s")

    knobs: dict[str, Any] = dict(tasks=TASKS, loop=0.25, cycle=0.1, nonloop=0.05, crash=0.0,
                                 migrate=0.05, shuffle_window=4, placement_timeout_s=300)
    supervisor = asyncio.create_task(supervise())
    try:
        chaos = asyncio.create_task(faults())
        now = int(time.time() * 1000)
        fleets = await asyncio.gather(
            simulate(settings, sandboxes=sandboxes, episodes=episodes, seed=seed,
                     state_root=run_dir / "fleet-a", start_ms=now, **knobs),
            simulate(settings, sandboxes=sandboxes, episodes=episodes, seed=seed + 50_000,
                     state_root=run_dir / "fleet-lagging", start_ms=now - LAG_MS, **knobs))
        await chaos
        supervisor.cancel()
        await close_producer()
        planted = await plant_bad_input(settings, fleets[0])
        result.bad_planted = len(planted)
        for w in workers:  # any other exit: a failure
            if w.proc is not None and w.proc.poll() is not None:
                fails.append(f"worker {w.worker_id} exited ({w.proc.returncode})")
                w.start()
        replays = [topics.replay(t) for t in TASKS]
        await wait_caught_up(settings, f"{prefix}.reorder", topics.input_topics, timeout=240)
        await wait_caught_up(settings, f"{prefix}.watchdog", replays, timeout=240)
        await wait_caught_up(settings, f"{prefix}.scheduler",
                             [topics.sandbox_events, topics.control, topics.alerts, *replays],
                             timeout=240)
        await check(settings, fleets, planted, result, explain_sample, rng)
    except Exception:
        fails.append("run raised: " + traceback.format_exc(limit=6))
    finally:
        supervisor.cancel()
        for w in workers:
            w.stop()
        from trajbus.bus.producer import close_producer as _close

        await _close()
        logging.getLogger().removeHandler(own_log)
        own_log.close()
    result.ok = not fails
    result.seconds = round(time.monotonic() - started, 1)
    return result


async def check(settings: Settings, fleets: list[Any], planted: list[Planted],
                result: RunResult, explain_sample: int, rng: random.Random) -> None:
    from trajbus.consumers.operator.alerts import happenings
    from trajbus.consumers.operator.tools import explain, watchdog_history

    topics = Topics(settings)
    fails = result.failures
    loops = {(e.sandbox, e.episode) for f in fleets for e in f.loops}
    result.loops_planted = len(loops)
    records = await read_all(settings, [topics.alerts, topics.deadletter])
    alerts: Counter[tuple[str, str | None]] = Counter()
    dead: list[dict[str, Any]] = []
    for r in records:
        if not r.value:
            continue
        d = codec.decode(r.value)
        if d.kind == "WatchdogAlert" and d.record["alert"] == "LOOP":
            alerts[(d.header["sandbox"], d.header["episode"])] += 1
        elif d.kind == "DeadLetter":
            dead.append(d.record)
    result.loop_alerts = sum(alerts.values())
    if alerts != Counter(dict.fromkeys(loops, 1)):
        missed = sorted(loops - set(alerts))
        extra = sorted(k for k in alerts if k not in loops)
        twice = sorted(k for k, n in alerts.items() if n > 1)
        fails.append(f"loops: missed {missed}, not planted {extra}, twice {twice}")

    # the tools agree with the alerts topic
    shown = Counter((h.sandbox, h.episode) for h in await happenings(settings, 0, ["LOOP"]))
    if shown != alerts:
        fails.append(f"alerts tool: {sorted(shown.items())} != topic {sorted(alerts.items())}")
    for sandbox, episode in sorted(loops):
        hist = await watchdog_history(settings, sandbox, episode)
        verdicts = [h.verdict for h in hist]
        if not any(v.startswith("LOOP fired") for v in verdicts):
            fails.append(f"watchdog explain --from-log {sandbox}/{episode}: {verdicts}")
    for sandbox in rng.sample(sorted({s for s, _ in loops}), min(explain_sample, len(loops))):
        ex = await explain(settings, sandbox)
        if not ex.consistent:
            fails.append(f"replay explain {sandbox}: {[d.to_dict() for d in ex.divergences]}")

    # dead letters: each planted record, by each stage at most once; nothing else
    positions = {(p.partition, p.offset): p for p in planted}
    by_source: dict[tuple[int, int], Counter[str]] = defaultdict(Counter)
    for d in dead:
        pos = (d["source_partition"], d["source_offset"])
        if d["source_topic"] != topics.sandbox_events or pos not in positions:
            fails.append(f"dead letter for unplanted input: {d['stage']} {d['reason_code']} "
                         f"{d['source_topic']}:{pos}")
            continue
        by_source[pos][d["stage"]] += 1
    result.dead_letters = len(dead)
    for pos, p in positions.items():
        stages = by_source.get(pos)
        if not stages:
            fails.append(f"planted {p.what!r} at {pos}: no dead letter")
        elif any(n > 1 for n in stages.values()):
            fails.append(f"planted {p.what!r} at {pos}: dead-lettered twice by {stages}")
    await check_redrive(settings, planted, result)


async def check_redrive(settings: Settings, planted: list[Planted], result: RunResult) -> None:
    """Redrive every dead letter twice: the first sends each redrivable source record once
    and refuses the permanent ones; the second sends nothing."""
    from trajbus.consumers.operator import deadletters as dl

    want = sum(1 for p in planted if not p.permanent)
    try:
        first = await dl.redrive(settings, await dl.read_dead_letters(settings))
    except Exception as exc:  # refused as a whole
        result.failures.append(f"redrive refused: {exc}")
        return
    sent = [r for r in first if r.action == "sent"]
    result.redriven = len(sent)
    if len(sent) != want:
        what = "; ".join(f"{r.dead_letter.stage}/{r.dead_letter.reason_code} "
                         f"{r.dead_letter.source_key}: {r.dead_letter.reason[:120]}" for r in sent)
        result.failures.append(f"redrive sent {len(sent)} records, want {want} (every planted "
                               f"record is a permanent failure): {what}")
    wrong = [r for r in first if r.action not in ("sent", "refused", "same_source", "already")]
    if wrong:
        result.failures.append(f"redrive answered {[r.action for r in wrong]}")
    again = await dl.redrive(settings, await dl.read_dead_letters(settings))
    resent = [r for r in again if r.action == "sent"]
    if resent:
        result.failures.append(f"a second redrive sent {len(resent)} records again")


async def main_async(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.WARNING, format=LOG_FORMAT)
    work = Path(args.work).resolve()
    work.mkdir(parents=True, exist_ok=True)
    broker = LocalBroker(work / "broker", port=free_port(), controller_port=free_port())
    broker.start(timeout=180)
    results: list[RunResult] = []
    try:
        for run in range(1, args.runs + 1):
            seed = args.seed + run
            print(f"[drill] run {run}/{args.runs} seed {seed}", flush=True)
            r = await run_once(broker, run, seed, work, args.sandboxes, args.episodes,
                               args.explain_sample)
            results.append(r)
            with open(work / "results.jsonl", "a") as f:
                f.write(json.dumps({**asdict(r), "date": time.strftime("%F %T")}) + "\n")
            print(f"[drill] run {run}: {'PASS' if r.ok else 'FAIL'} in {r.seconds}s; "
                  f"{r.loops_planted} loops, {r.loop_alerts} LOOP alerts, "
                  f"{r.bad_planted} bad records, {r.dead_letters} dead letters, "
                  f"{r.redriven} redriven; faults: {'; '.join(r.faults)}", flush=True)
            for f in r.failures:
                print(f"    {f}", flush=True)
    finally:
        broker.stop()
    passed = sum(r.ok for r in results)
    print(f"[drill] {passed}/{len(results)} runs passed")
    return 0 if passed == len(results) else 1


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--seed", type=int, default=3700)
    ap.add_argument("--sandboxes", type=int, default=8, help="per fleet (two fleets)")
    ap.add_argument("--episodes", type=int, default=2)
    ap.add_argument("--explain-sample", type=int, default=2,
                    help="looping sandboxes per run re-run by `replay explain`")
    ap.add_argument("--work", default=".trajbus/operator-drill",
                    help="the broker's data, the workers' and the drill's logs, results.jsonl")
    return asyncio.run(main_async(ap.parse_args()))


if __name__ == "__main__":
    sys.exit(main())
