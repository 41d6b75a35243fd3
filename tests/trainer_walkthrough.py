"""The trainers' walkthrough (issue 41, "Done when"): the trainer client used as a trainer would
use it, against the real pipeline, checked against what the emitters acknowledged.

    .venv/bin/python tests/trainer_walkthrough.py --runs 5              # every scenario
    .venv/bin/python tests/trainer_walkthrough.py --only d --runs 3     # the broker outage

One private broker (``--work``/broker) serves every run; each scenario of each run has its own
topic prefix, a reorder worker (``trajbus worker``, a subprocess), a fleet of live emitters
(:class:`Fleet`, ``SandboxEmitter`` in this process: a few hundred events/s, episodes of 3-10
steps, policy version = the sandbox's episode number) and trainers, each a subprocess running
this file's ``trainer`` command (``ReplayClient`` or ``SyncReplayClient``), which writes a JSON
line per delivery, per ``ack()`` result and per checkpoint (``commit()`` returned).

Scenarios:

a. **batch loop** (README): ``SyncReplayClient``, take 8 episodes, ``break``, train, acknowledge
   the batch, ask again; and an async trainer doing the same with ``max_in_flight=2``.
b. **filters and mistakes** (in this process): a task-name typo (``missing_tasks``, the
   warning naming the tasks there are), a new group id (logged once), ``max_staleness``
   without a policy version (``ValueError``), with one (stale episodes dropped whole, never an
   empty shell), ``start=<time>`` inside live episodes (fragments marked, never complete).
c. **join, leave, SIGKILL**: trainer A; B joins, C joins, B leaves (SIGTERM), A is SIGKILLed
   and restarted, C leaves; A drains.
d. **broker outage**: two trainers with the default coalesced commits (``commit_every_ms=100``,
   one async per-episode loop, one sync batch loop), slower than the fleet so that they work
   through fetched records while the broker is stopped for ``--outage-s`` (20 s: longer than
   the session timeout), then started again.

Checks of every scenario but b (:func:`check`): every episode the emitters acknowledged is
acknowledged (``ack()`` returned True) exactly once across the trainers -- except an episode a
SIGKILLed trainer acknowledged after its last checkpoint (the documented crash window of
coalesced commits), counted apart; none is delivered again after an acknowledgement returned
(same exception); every delivered episode is complete and holds exactly the emitters'
events (no fragment, marked or not); no hang: the trainers acknowledge everything within
``--drain-timeout-s`` of the fleet's end and stop within 60 s of SIGTERM.

Results: ``<work>/results.jsonl`` (one line per scenario run), a table at the end; exit 1 if
any check failed.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import json
import logging
import os
import random
import signal
import subprocess
import sys
import threading
import time
import traceback
import uuid
from collections import Counter, defaultdict
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from support import REPO, Worker, settings_for  # noqa: E402

from trajbus.bus.settings import Settings  # noqa: E402

TASK = "walk-shop"
PARTITIONS = 3
Key = tuple[str, str]


def digest(pairs: list[tuple[int, str]]) -> str:
    """A short digest of an episode's (seq, event id) pairs in seq order."""
    return hashlib.sha1(";".join(f"{s}:{e}" for s, e in pairs).encode()).hexdigest()[:16]


# -- the trainer (a subprocess) ----------------------------------------------------------------
class _Journal:
    def __init__(self, path: Path, who: str) -> None:
        self.f = open(path, "a", buffering=1)
        self.who = who
        self.lock = threading.Lock()

    def write(self, ev: str, **kw: Any) -> None:
        with self.lock:
            self.f.write(json.dumps({"t": time.time(), "who": self.who, "pid": os.getpid(),
                                     "ev": ev, **kw}) + "\n")


def _episode_fields(ep: Any) -> dict[str, Any]:
    pairs = [(e.header["seq"], e.header["event_id"]) for e in ep.events]
    return {"key": [ep.sandbox, ep.episode], "complete": ep.complete,
            "reason": ep.fragment_reason, "n": len(pairs), "digest": digest(pairs)}


def trainer_main(args: argparse.Namespace) -> int:
    """A trainer: ``--mode stream`` (async, acknowledges each episode after training on it) or
    ``batch`` (``--client sync|async``: take ``--batch`` episodes, break, train, acknowledge the
    batch, ask again). Every ``--checkpoint-s`` it calls ``commit()`` and logs a checkpoint.
    SIGTERM: finish the current step, stop the client, exit 0."""
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    # the evidence of a failed run: each acknowledgement, commit and partition taken
    logging.getLogger("trajbus.consumers.replay.client").setLevel(logging.DEBUG)
    settings = settings_for(args.bootstrap, args.prefix, partitions=PARTITIONS)
    journal = _Journal(Path(args.journal), args.name)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    journal.write("start", mode=args.mode, client=args.client)
    rng = random.Random(args.seed)
    kw: dict[str, Any] = dict(commit_every_ms=args.commit_every_ms)
    if args.max_in_flight:
        kw["max_in_flight"] = args.max_in_flight
    try:
        if args.client == "sync":
            stats = _trainer_sync(args, settings, journal, stop, rng, kw)
        else:
            stats = asyncio.run(_trainer_async(args, settings, journal, stop, rng, kw))
    except BaseException as exc:
        journal.write("error", error=f"{type(exc).__name__}: {exc}",
                      tb=traceback.format_exc(limit=8))
        raise
    journal.write("stats", stats=stats)
    return 0


def _trainer_sync(args: argparse.Namespace, settings: Settings, journal: _Journal,
                  stop: threading.Event, rng: random.Random, kw: dict[str, Any]
                  ) -> dict[str, int]:
    from trajbus.consumers.replay.client import SyncReplayClient

    last_cp = time.monotonic()
    with SyncReplayClient(TASK, args.group, settings, **kw) as client:
        while not stop.is_set():
            batch = []
            for ep in client.episodes(idle_timeout=0.5):
                journal.write("delivered", **_episode_fields(ep))
                batch.append(ep)
                if len(batch) >= args.batch or stop.is_set():
                    break
            time.sleep(rng.uniform(0, args.train_ms / 1000) * max(1, len(batch)))
            for ep in batch:
                journal.write("ack", key=[ep.sandbox, ep.episode], result=client.ack(ep))
            if time.monotonic() - last_cp >= args.checkpoint_s:
                client.commit()
                journal.write("checkpoint")
                last_cp = time.monotonic()
        stats = dict(client.stats)
    return stats


async def _trainer_async(args: argparse.Namespace, settings: Settings, journal: _Journal,
                         stop: threading.Event, rng: random.Random, kw: dict[str, Any]
                         ) -> dict[str, int]:
    from trajbus.consumers.replay.client import ReplayClient

    last_cp = time.monotonic()

    async def checkpoint() -> None:
        nonlocal last_cp
        if time.monotonic() - last_cp >= args.checkpoint_s:
            await client.commit()
            journal.write("checkpoint")
            last_cp = time.monotonic()

    async with ReplayClient(TASK, args.group, settings, **kw) as client:
        while not stop.is_set():
            if args.mode == "stream":
                async for ep in client.episodes(idle_timeout=0.5):
                    journal.write("delivered", **_episode_fields(ep))
                    await asyncio.sleep(rng.uniform(0, args.train_ms / 1000))
                    journal.write("ack", key=[ep.sandbox, ep.episode],
                                  result=await client.ack(ep))
                    await checkpoint()
                    if stop.is_set():
                        break
                await checkpoint()
            else:
                batch = []
                async for ep in client.episodes(idle_timeout=0.5):
                    journal.write("delivered", **_episode_fields(ep))
                    batch.append(ep)
                    if len(batch) >= args.batch or stop.is_set():
                        break
                await asyncio.sleep(rng.uniform(0, args.train_ms / 1000) * max(1, len(batch)))
                for ep in batch:
                    journal.write("ack", key=[ep.sandbox, ep.episode],
                                  result=await client.ack(ep))
                await checkpoint()
        return dict(client.stats)


@dataclass
class Trainer:
    """A trainer subprocess of the walkthrough (see :func:`trainer_main`)."""

    name: str
    settings: Settings
    group: str
    journal: Path
    log: Path
    mode: str = "stream"
    client: str = "async"
    batch: int = 8
    train_ms: float = 10.0
    commit_every_ms: float = 100.0
    max_in_flight: int = 0
    checkpoint_s: float = 1.0
    seed: int = 0
    proc: subprocess.Popen[bytes] | None = None
    killed: bool = False

    def start(self) -> Trainer:
        cmd = [sys.executable, str(Path(__file__).resolve()), "trainer",
               "--bootstrap", self.settings.kafka.bootstrap_servers,
               "--prefix", self.settings.topics.prefix, "--group", self.group,
               "--name", self.name, "--journal", str(self.journal), "--mode", self.mode,
               "--client", self.client, "--batch", str(self.batch),
               "--train-ms", str(self.train_ms), "--commit-every-ms", str(self.commit_every_ms),
               "--max-in-flight", str(self.max_in_flight),
               "--checkpoint-s", str(self.checkpoint_s), "--seed", str(self.seed)]
        out = open(self.log, "ab")
        self.proc = subprocess.Popen(cmd, stdout=out, stderr=out, cwd=REPO)
        return self

    def sigkill(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(timeout=10)
        self.killed = True

    def ready(self) -> bool:
        """It has started its client loop (logged "start"): SIGTERM is handled from then on."""
        return self.proc is not None and any(
            x["ev"] == "start" and x["pid"] == self.proc.pid for x in read_journal(self.journal))

    def stop(self, timeout: float = 60.0) -> float | None:
        """SIGTERM (once it is ready, a bounded wait: a loaded machine starts Python slowly)
        and wait; the seconds it took, None if it had to be killed (a hang)."""
        assert self.proc is not None
        deadline = time.monotonic() + timeout
        while not self.ready() and self.proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
        t0 = time.monotonic()
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=10)
            return None
        return time.monotonic() - t0


# -- the fleet (emitters, a subprocess) ---------------------------------------------------------
async def _fleet_async(args: argparse.Namespace) -> int:
    """``n`` sandboxes emitting episodes of 3-10 tool call/result pairs, one step every
    ``step_s``, until SIGTERM (each then ends its episode and closes, waiting for acks). Every
    event the broker acknowledged is a line of ``--manifest``; the last line says whether
    every emitter closed with everything acknowledged."""
    from trajbus.producers.emitter import SandboxEmitter

    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    settings = settings_for(args.bootstrap, args.prefix, partitions=PARTITIONS)
    out = open(args.manifest, "a", buffering=1)
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    rng = random.Random(args.seed)
    closed: list[bool] = []

    async def run(i: int) -> None:
        sandbox = f"{args.prefix}-sb-{i}"

        def on_ack(info: Any) -> None:
            if info.episode is not None:
                out.write(json.dumps([sandbox, info.episode, info.seq, info.event_id]) + "\n")

        em = SandboxEmitter(sandbox, TASK, settings=settings,
                            state_dir=Path(args.state_dir) / sandbox, durability="os",
                            queue_policy="spill", on_ack=on_ack)
        await em.start()
        ep_n = 0
        try:
            while not stop.is_set():
                episode = f"{sandbox}-ep-{ep_n}"
                await em.start_episode(episode, policy_version=ep_n)
                ep_n += 1
                for s in range(rng.randint(3, 10)):
                    cid = await em.tool_call(episode, "bash", {"cmd": f"step {s}"})
                    await em.tool_result(episode, cid, "bash", {"out": f"{s}"})
                    await asyncio.sleep(args.step_s)
                await em.end_episode(episode)
        finally:
            closed.append(await em.close(120))

    await asyncio.gather(*(run(i) for i in range(args.n)))
    out.write(json.dumps({"closed_ok": all(closed)}) + "\n")
    return 0


class Fleet:
    """The emitters' subprocess (:func:`_fleet_async`) and its manifest."""

    def __init__(self, settings: Settings, dir_: Path, n: int, step_s: float, seed: int
                 ) -> None:
        self.settings, self.dir, self.n, self.step_s, self.seed = settings, dir_, n, step_s, seed
        self.manifest_path = dir_ / "emitted.jsonl"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> Fleet:
        cmd = [sys.executable, str(Path(__file__).resolve()), "fleet",
               "--bootstrap", self.settings.kafka.bootstrap_servers,
               "--prefix", self.settings.topics.prefix, "--state-dir", str(self.dir / "fleet"),
               "--n", str(self.n), "--step-s", str(self.step_s), "--seed", str(self.seed),
               "--manifest", str(self.manifest_path)]
        out = open(self.dir / "fleet.log", "ab")
        self.proc = subprocess.Popen(cmd, stdout=out, stderr=out, cwd=REPO)
        return self

    async def stop(self, timeout: float = 180.0) -> bool:
        """SIGTERM; True if every emitter closed with everything acknowledged."""
        assert self.proc is not None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            await asyncio.to_thread(self.proc.wait, timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return False
        lines = self.manifest_path.read_text().splitlines()
        return bool(lines) and json.loads(lines[-1]) == {"closed_ok": True}

    def acked(self) -> dict[Key, list[tuple[int, str]]]:
        got: dict[Key, list[tuple[int, str]]] = defaultdict(list)
        if self.manifest_path.exists():
            for line in self.manifest_path.read_text().splitlines():
                with contextlib.suppress(ValueError):
                    x = json.loads(line)
                    if isinstance(x, list):
                        got[(x[0], x[1])].append((x[2], x[3]))
        return got

    def manifest(self) -> dict[Key, str]:
        """Each acknowledged episode's digest (its events in seq order)."""
        return {k: digest(sorted(v)) for k, v in self.acked().items()}


# -- reading the trainers' journals and checking them -------------------------------------------
def read_journal(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        with contextlib.suppress(ValueError):
            out.append(json.loads(line))
    return out


def acked_true(lines: list[dict[str, Any]]) -> Counter[Key]:
    return Counter(tuple(x["key"]) for x in lines if x["ev"] == "ack" and x["result"])


def check(manifest: dict[Key, str], lines: list[dict[str, Any]], killed_pids: set[int]
          ) -> dict[str, Any]:
    """What the trainers' journals break (see the module docstring) and what they did."""
    lines = sorted(lines, key=lambda x: x["t"])
    last_cp: dict[int, float] = {}
    for x in lines:
        if x["ev"] == "checkpoint":
            last_cp[x["pid"]] = x["t"]
    acks: dict[Key, list[dict[str, Any]]] = defaultdict(list)
    for x in lines:
        if x["ev"] == "ack" and x["result"]:
            acks[tuple(x["key"])].append(x)  # type: ignore[index]

    def crash_window(a: dict[str, Any]) -> bool:  # acked by a trainer later SIGKILLed, after
        return a["pid"] in killed_pids and a["t"] > last_cp.get(a["pid"], 0.0)  # its checkpoint

    never = sorted(k for k in manifest if not acks.get(k))
    twice, crash_again = [], []
    for k, got in acks.items():
        if len(got) > 1:
            if len(got) == 2 and crash_window(got[0]):
                crash_again.append(k)
            else:
                twice.append(k)
    after_ack = set()
    for x in lines:
        if x["ev"] != "delivered":
            continue
        k = tuple(x["key"])
        first = acks.get(k)  # type: ignore[arg-type]
        if first and x["t"] > first[0]["t"] and not crash_window(first[0]):
            after_ack.add(k)
    delivered = [x for x in lines if x["ev"] == "delivered"]
    fragments = Counter(x["reason"] or "unmarked" for x in delivered if not x["complete"])
    wrong = sorted({tuple(x["key"]) for x in delivered
                    if x["complete"] and x["digest"] != manifest.get(tuple(x["key"]))})
    unknown = sorted(k for k in acks if k not in manifest)
    errors = [x["error"] for x in lines if x["ev"] == "error"]
    stats: Counter[str] = Counter()
    for x in lines:
        if x["ev"] == "stats":
            stats.update({k: v for k, v in x["stats"].items() if v})

    def show(keys: Any) -> list[str]:
        return [f"{s}/{e}" for s, e in sorted(keys)][:10]

    return {
        "episodes": len(manifest), "deliveries": len(delivered),
        "acks_true": sum(len(v) for v in acks.values()),
        "acks_false": sum(1 for x in lines if x["ev"] == "ack" and not x["result"]),
        "n_never_acknowledged": len(never), "never_acknowledged": show(never),
        "n_acknowledged_twice": len(twice), "acknowledged_twice": show(twice),
        "n_delivered_after_ack": len(after_ack), "delivered_after_ack": show(after_ack),
        "n_fragments": sum(fragments.values()), "fragments": dict(fragments),
        "n_complete_but_wrong": len(wrong), "complete_but_wrong": show(wrong),
        "n_unknown": len(unknown), "trainer_errors": errors[:5], "n_trainer_errors": len(errors),
        "crash_window_reacked": len(crash_again),
        "client_stats": {k: stats[k] for k in ("acks_lost_in_rebalance", "acks_lost_at_stop",
                                              "commits_retried_after_rebalance",
                                              "acks_after_partition_moved",
                                              "flow_control_waits", "duplicates_dropped",
                                              "skipped_already_acked") if stats[k]},
    }


FAIL_KEYS = ("n_never_acknowledged", "n_acknowledged_twice", "n_delivered_after_ack",
             "n_fragments", "n_complete_but_wrong", "n_unknown", "n_trainer_errors")


# -- scenarios ----------------------------------------------------------------------------------
@dataclass
class Result:
    run: int
    scenario: str
    seed: int
    ok: bool = False
    seconds: float = 0.0
    report: dict[str, Any] = field(default_factory=dict)
    failures: list[str] = field(default_factory=list)
    timeline: list[str] = field(default_factory=list)


class Scene:
    """One scenario's world: topics, a reorder worker, a fleet, trainers, a journal."""

    def __init__(self, broker: Any, work: Path, run: int, scenario: str, seed: int,
                 fleet_n: int = 6, step_s: float = 0.02) -> None:
        self.broker = broker
        self.prefix = f"wk{run}{scenario}{uuid.uuid4().hex[:5]}"
        self.dir = work / self.prefix
        self.dir.mkdir(parents=True, exist_ok=True)
        self.settings = settings_for(broker.bootstrap, self.prefix, partitions=PARTITIONS)
        self.group = f"{self.prefix}-trainers"
        self.journal = self.dir / "trainers.jsonl"
        self.rng = random.Random(seed)
        self.seed = seed
        self.fleet = Fleet(self.settings, self.dir, fleet_n, step_s, seed)
        self.worker: Worker | None = None
        self.trainers: list[Trainer] = []
        self.t0 = time.monotonic()
        self.timeline: list[str] = []

    def note(self, what: str) -> None:
        self.timeline.append(f"{time.monotonic() - self.t0:.1f}s {what}")
        print(f"    {self.timeline[-1]}", flush=True)

    async def setup(self) -> None:
        from trajbus.bus.admin import ensure_base_topics, register_schemas

        await ensure_base_topics(self.settings, [TASK])
        await register_schemas(self.settings)
        self.worker = Worker(self.settings, "reorder", worker_id="w1",
                             log_path=self.dir / "worker.log").start()
        self.fleet.start()
        deadline = time.monotonic() + 120  # a loaded machine starts Python slowly
        while not self.fleet.acked() and time.monotonic() < deadline:
            assert self.fleet.proc is not None and self.fleet.proc.poll() is None, \
                "the fleet exited at start"
            await asyncio.sleep(0.2)
        self.t0 = time.monotonic()

    def trainer(self, name: str, **kw: Any) -> Trainer:
        t = Trainer(name, self.settings, self.group, self.journal, self.dir / f"{name}.log",
                    seed=self.rng.randrange(1 << 30), **kw).start()
        self.trainers.append(t)
        self.note(f"start {name} ({t.mode}, {t.client}, commit_every_ms={t.commit_every_ms})")
        return t

    async def finish(self, result: Result, drain_timeout_s: float) -> None:
        """Stop the fleet, wait (bounded) until the trainers acknowledged every episode, stop
        them, check."""
        closed_ok = await self.fleet.stop()
        manifest = self.fleet.manifest()
        self.note(f"fleet stopped ({len(manifest)} episodes acknowledged by the emitters)")
        if not closed_ok:
            result.failures.append("an emitter closed with events not acknowledged")
        if not manifest:
            result.failures.append("the fleet had no episode acknowledged")
        deadline = time.monotonic() + drain_timeout_s
        while time.monotonic() < deadline:
            acked = acked_true(read_journal(self.journal))
            if all(acked[k] for k in manifest):
                break
            if not any(t.proc is not None and t.proc.poll() is None for t in self.trainers):
                break
            await asyncio.sleep(0.5)
        else:
            result.failures.append(f"hang: not every episode acknowledged within "
                                   f"{drain_timeout_s:.0f} s of the fleet's end")
        self.note("drained")
        await asyncio.sleep(3)  # a late second delivery shows up
        for t in self.trainers:
            if t.proc is not None and t.proc.poll() is None:
                took = await asyncio.to_thread(t.stop)
                if took is None:
                    result.failures.append(f"hang: trainer {t.name} did not stop within 60 s")
            elif t.proc is not None and not t.killed and t.proc.returncode != 0:
                result.failures.append(f"trainer {t.name} exited {t.proc.returncode}")
        self.note("trainers stopped")
        killed = {x["pid"] for x in read_journal(self.journal) if x["ev"] == "start"
                  and any(t.killed and t.proc is not None and t.proc.pid == x["pid"]
                          for t in self.trainers)}
        report = check(manifest, read_journal(self.journal), killed)
        result.report.update(report)
        for k in FAIL_KEYS:
            if report[k]:
                result.failures.append(f"{k}={report[k]}")

    def close(self) -> None:
        if self.fleet.proc is not None and self.fleet.proc.poll() is None:
            self.fleet.proc.kill()
        for t in self.trainers:
            if t.proc is not None and t.proc.poll() is None:
                t.proc.kill()
        if self.worker is not None:
            self.worker.stop()


async def scenario_a(scene: Scene, result: Result, args: argparse.Namespace) -> None:
    """The README's batch loop, sync and async (max_in_flight=2, smaller than a batch)."""
    scene.trainer("batch-sync", mode="batch", client="sync", batch=8, train_ms=5)
    await asyncio.sleep(4)
    scene.trainer("batch-async", mode="batch", client="async", batch=8, train_ms=5,
                  max_in_flight=2)
    await asyncio.sleep(args.duration_s)
    await scene.finish(result, args.drain_timeout_s)


async def scenario_c(scene: Scene, result: Result, args: argparse.Namespace) -> None:
    """Members joining and leaving; one SIGKILLed and restarted."""
    d = args.duration_s / 5
    jitter = scene.rng.uniform
    a = scene.trainer("A", mode="stream", client="async", train_ms=5)
    await asyncio.sleep(d * jitter(0.6, 1.2))
    b = scene.trainer("B", mode="batch", client="sync", batch=6, train_ms=5)
    await asyncio.sleep(d * jitter(0.6, 1.2))
    scene.trainer("C", mode="stream", client="async", train_ms=5)
    await asyncio.sleep(d * jitter(0.6, 1.2))
    took = await asyncio.to_thread(b.stop)
    scene.note(f"B left (SIGTERM, {took if took is None else round(took, 1)} s)")
    if took is None:
        result.failures.append("hang: B did not stop within 60 s")
    await asyncio.sleep(d * jitter(0.3, 0.8))
    a.sigkill()
    scene.note("A SIGKILLed")
    await asyncio.sleep(jitter(1, 3))
    scene.trainer("A2", mode="stream", client="async", train_ms=5)
    await asyncio.sleep(d * jitter(0.6, 1.2))
    c = scene.trainers[2]
    took = await asyncio.to_thread(c.stop)
    scene.note(f"C left (SIGTERM, {took if took is None else round(took, 1)} s)")
    if took is None:
        result.failures.append("hang: C did not stop within 60 s")
    await scene.finish(result, args.drain_timeout_s)


async def scenario_d(scene: Scene, result: Result, args: argparse.Namespace) -> None:
    """A broker outage longer than the session timeout while trainers with the default
    coalesced commits work through a backlog they fetched: the trainers start once the fleet
    has run a while, the broker stops a few seconds later."""
    await asyncio.sleep(scene.rng.uniform(6, 9))
    # no checkpoint (commit() waits for the broker): they acknowledge through the outage
    scene.trainer("D1", mode="stream", client="async", train_ms=args.outage_train_ms,
                  checkpoint_s=1e9)
    scene.trainer("D2", mode="batch", client="sync", batch=8, train_ms=args.outage_train_ms,
                  checkpoint_s=1e9)
    await asyncio.sleep(scene.rng.uniform(8, 12))  # joined, settled, into the backlog
    before = acked_true(read_journal(scene.journal))
    kind = args.outage_kind
    if kind == "alternate":
        kind = ("stop", "kill")[result.run % 2 == 0]
    scene.note(f"broker {kind} for {args.outage_s:.0f} s ({sum(before.values())} acks so far)")
    await asyncio.to_thread(scene.broker.stop if kind == "stop" else scene.broker.kill)
    await asyncio.sleep(args.outage_s)
    during = sum(acked_true(read_journal(scene.journal)).values()) - sum(before.values())
    await asyncio.to_thread(scene.broker.start, 120)
    scene.note(f"broker started ({during} acks during the outage)")
    result.report["acks_during_outage"] = during
    await asyncio.sleep(max(5.0, args.duration_s - 10))
    await scene.finish(result, args.drain_timeout_s)


async def scenario_b(scene: Scene, result: Result, args: argparse.Namespace) -> None:
    """Filters and mistakes, in this process, on live data."""
    from trajbus.consumers.replay import notices
    from trajbus.consumers.replay.client import ReplayClient

    fails = result.failures
    settings = scene.settings
    await asyncio.sleep(6)  # a few episodes in the replay topic
    got: dict[str, Any] = {}

    class Grab(logging.Handler):
        def __init__(self) -> None:
            super().__init__(logging.WARNING)
            self.lines: list[str] = []

        def emit(self, record: logging.LogRecord) -> None:
            self.lines.append(record.getMessage())

    grab = Grab()
    logging.getLogger("trajbus").addHandler(grab)
    old_after = notices.MISSING_TASK_WARN_AFTER_S
    notices.MISSING_TASK_WARN_AFTER_S = 2.0
    try:
        # 1. a task-name typo: missing_tasks says so, a warning names the tasks there are
        typo = TASK.replace("shop", "shpo")
        async with ReplayClient(typo, f"{scene.group}-typo", settings) as client:
            got["missing_tasks"] = await client.missing_tasks()
            got["list_tasks"] = await client.list_tasks()
            async for _ in client.episodes(idle_timeout=4):
                fails.append("typo: an episode of a task that does not exist")
        if got["missing_tasks"] != [typo] or TASK not in got["list_tasks"]:
            fails.append(f"typo: missing_tasks {got['missing_tasks']}, list_tasks "
                         f"{got['list_tasks']}")
        if not any(typo in line and TASK in line for line in grab.lines):
            fails.append(f"typo: no warning naming {typo!r} and {TASK!r}: {grab.lines[-5:]}")
        # 2. max_staleness without a policy version: an error at once
        try:
            ReplayClient(TASK, f"{scene.group}-st", settings, max_staleness=1)
            fails.append("max_staleness without current_policy_version accepted")
        except ValueError:
            got["staleness_without_version"] = "ValueError"
        # 3. staleness with a version (policy version = the sandbox's episode number): stale
        # episodes dropped whole, never an empty shell; a new group's start logged once
        grab.lines.clear()
        version = 3
        seen: list[tuple[int, int]] = []
        async with ReplayClient(TASK, f"{scene.group}-fresh", settings, max_staleness=1,
                                current_policy_version=lambda: version) as client:
            until = time.monotonic() + 8  # live data never idles: a bounded read
            async for ep in client.episodes(idle_timeout=3):
                if time.monotonic() > until:
                    break
                pv = min(e.header.get("policy_version") or 0 for e in ep.events) \
                    if ep.events else -1
                seen.append((len(ep.events), pv))
                await client.ack(ep)
            got["stale_dropped"] = client.stats["stale_episodes_dropped"]
        shells = [s for s in seen if s[0] == 0]
        stale_handed = [s for s in seen if s[1] < version - 1]
        got["fresh_delivered"] = len(seen)
        if shells or stale_handed or not got["stale_dropped"]:
            fails.append(f"staleness: {len(shells)} empty episodes, {len(stale_handed)} stale "
                         f"ones handed out, {got['stale_dropped']} dropped")
        new_group = [line for line in grab.lines if "no committed offsets" in line]
        if len(new_group) != 1:
            fails.append(f"new group: {len(new_group)} warnings, want 1")
        # 4. start=<time> inside live episodes: fragments are marked, never "complete"
        delivered: list[tuple[Key, str, bool]] = []
        async with ReplayClient(TASK, f"{scene.group}-t", settings,
                                start=int(time.time() * 1000) - 1500) as client:
            until = time.monotonic() + 8
            async for ep in client.episodes(idle_timeout=3):
                if time.monotonic() > until:
                    break
                pairs = [(e.header["seq"], e.header["event_id"]) for e in ep.events]
                delivered.append(((ep.sandbox, ep.episode), digest(pairs), ep.complete))
                await client.ack(ep)
        got["start_time_marked_fragments"] = sum(1 for *_, c in delivered if not c)
    finally:
        notices.MISSING_TASK_WARN_AFTER_S = old_after
        logging.getLogger("trajbus").removeHandler(grab)
    await scene.fleet.stop()
    manifest = scene.fleet.manifest()
    wrong = [k for k, d, complete in delivered if complete and manifest.get(k) != d]
    if wrong:
        fails.append(f"start=<time>: {len(wrong)} episodes said complete but were not")
    result.report = got


SCENARIOS = {"a": scenario_a, "b": scenario_b, "c": scenario_c, "d": scenario_d}


async def run_scenario(broker: Any, work: Path, run: int, name: str, seed: int,
                       args: argparse.Namespace) -> Result:
    result = Result(run, name, seed)
    started = time.monotonic()
    scene = Scene(broker, work, run, name, seed,
                  step_s=args.outage_step_s if name == "d" else 0.02)
    try:
        await scene.setup()
        await asyncio.wait_for(SCENARIOS[name](scene, result, args),
                               args.duration_s + args.drain_timeout_s + 300)
    except Exception:
        result.failures.append("scenario raised: " + traceback.format_exc(limit=6))
    finally:
        scene.close()
        from trajbus.bus.producer import close_producer

        await close_producer()
    result.timeline = scene.timeline
    result.ok = not result.failures
    result.seconds = round(time.monotonic() - started, 1)
    return result


def table(results: list[Result]) -> str:
    lines = ["run scen result  episodes deliveries acks_true acks_false never twice "
             "after_ack fragments wrong crash_reacked seconds"]
    for r in results:
        p = r.report
        lines.append(" ".join(str(x) for x in (
            r.run, r.scenario, "PASS" if r.ok else "FAIL", p.get("episodes", "-"),
            p.get("deliveries", "-"), p.get("acks_true", "-"), p.get("acks_false", "-"),
            p.get("n_never_acknowledged", "-"), p.get("n_acknowledged_twice", "-"),
            p.get("n_delivered_after_ack", "-"), p.get("n_fragments", "-"),
            p.get("n_complete_but_wrong", "-"), p.get("crash_window_reacked", "-"),
            r.seconds)))
    return "\n".join(lines)


async def main_async(args: argparse.Namespace) -> int:
    from trajbus.infra.broker import LocalBroker, free_port

    work = Path(args.work).resolve()
    work.mkdir(parents=True, exist_ok=True)
    # this process's own clients (admin clients) log to a file: an outage is noisy
    logging.basicConfig(filename=str(work / "walkthrough.log"), level=logging.INFO,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    broker = LocalBroker(work / "broker", port=free_port(), controller_port=free_port())
    broker.start(timeout=180)
    results: list[Result] = []
    only = [s for s in args.only.split(",") if s]
    try:
        for run in range(1, args.runs + 1):
            for name in only:
                seed = args.seed * 1000 + run * 10 + ord(name) - ord("a")
                print(f"[walk] run {run}/{args.runs} scenario {name} seed {seed}", flush=True)
                r = await run_scenario(broker, work, run, name, seed, args)
                results.append(r)
                with open(work / "results.jsonl", "a") as f:
                    f.write(json.dumps({**asdict(r), "date": time.strftime("%F %T")}) + "\n")
                print(f"[walk] run {run} {name}: {'PASS' if r.ok else 'FAIL'} in "
                      f"{r.seconds}s {json.dumps(r.report)}", flush=True)
                for f_ in r.failures:
                    print(f"    FAIL {f_}", flush=True)
    finally:
        broker.stop()
    print(table(results))
    passed = sum(r.ok for r in results)
    print(f"[walk] {passed}/{len(results)} scenario runs passed")
    return 0 if passed == len(results) else 1


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "fleet":
        fp = argparse.ArgumentParser(prog="trainer_walkthrough.py fleet")
        for name in ("bootstrap", "prefix", "state-dir", "manifest"):
            fp.add_argument(f"--{name}", required=True)
        fp.add_argument("--n", type=int, default=6)
        fp.add_argument("--step-s", type=float, default=0.02)
        fp.add_argument("--seed", type=int, default=0)
        return asyncio.run(_fleet_async(fp.parse_args(sys.argv[2:])))
    if len(sys.argv) > 1 and sys.argv[1] == "trainer":
        tp = argparse.ArgumentParser(prog="trainer_walkthrough.py trainer")
        for name in ("bootstrap", "prefix", "group", "name", "journal"):
            tp.add_argument(f"--{name}", required=True)
        tp.add_argument("--mode", choices=("stream", "batch"), default="stream")
        tp.add_argument("--client", choices=("async", "sync"), default="async")
        tp.add_argument("--batch", type=int, default=8)
        tp.add_argument("--train-ms", type=float, default=10.0)
        tp.add_argument("--commit-every-ms", type=float, default=100.0)
        tp.add_argument("--max-in-flight", type=int, default=0)
        tp.add_argument("--checkpoint-s", type=float, default=1.0)
        tp.add_argument("--seed", type=int, default=0)
        return trainer_main(tp.parse_args(sys.argv[2:]))
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--seed", type=int, default=41)
    ap.add_argument("--only", default="a,b,c,d", help="scenarios, comma-separated")
    ap.add_argument("--work", default=".trajbus/trainer-walkthrough",
                    help="the broker's data, the logs, results.jsonl")
    ap.add_argument("--duration-s", type=float, default=20.0,
                    help="how long the fleet emits in scenarios a and c (d: outage + this)")
    ap.add_argument("--drain-timeout-s", type=float, default=120.0)
    ap.add_argument("--outage-s", type=float, default=20.0)
    ap.add_argument("--outage-kind", choices=("stop", "kill", "alternate"), default="alternate",
                    help="scenario d: SIGTERM (stop) or SIGKILL the broker; alternate: by run")
    ap.add_argument("--outage-train-ms", type=float, default=60.0,
                    help="scenario d: a trainer's step per episode (slower than the fleet)")
    ap.add_argument("--outage-step-s", type=float, default=0.02,
                    help="scenario d: the fleet's step interval")
    return asyncio.run(main_async(ap.parse_args()))


if __name__ == "__main__":
    sys.exit(main())
