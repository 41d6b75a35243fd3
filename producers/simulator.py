"""Fleet simulator: many sandboxes driven through realistic episodes, in one process, all through
the one shared producer. The workload for the demo, the tests and the benchmarks.

Each sandbox runs on its own *simulated* clock (``event_time_ms`` is set explicitly; nothing
sleeps), from an RNG seeded by ``(seed, sandbox index)``: for a given seed every sandbox's
events -- kinds, seqs, arguments, results, event ids, event times -- are the same on every run,
whatever the interleaving between sandboxes (Kafka offsets and arrival order are not).

Behaviours (knobs are fractions of episodes, or of sandboxes for crash/migrate):

- normal agents: tool calls with results, a growing trace (chunks), occasional large blobs
  (claim-checked), heartbeats every 5 min and liveness probes every 60 s of simulated time;
- ``loop``: the same call with the same result >= 25 times over >= 2.5 min (a true loop);
- ``cycle``: A, B, A, B ... with unchanged results for >= 2.5 min (a repeating cycle);
- ``nonloop``: the same call repeated until the result changes (each result distinct);
- ``crash``: the agent dies mid-episode: the episode ends TRUNCATED, or never ends and the
  sandbox is drained and RECYCLED;
- ``migrate``: mid-episode the emitter is closed without draining and a new one (new
  producer id, same state directory) continues -- several producer ids per sandbox;
- ``duplicate``: some already-acknowledged events are sent again byte for byte;
  ``shuffle_window`` > 1 shuffles send order within windows (out-of-order delivery).

Lifecycle: PROVISIONING -> ACTIVE -> (episodes) -> DRAINING -> Drained -> RECYCLED. Node
reports go to ``Topics.nodes`` and one SandboxRequest per sandbox to ``Topics.control``.

Closed loop (``wait_for_placement``, the default), as a real runtime: each sandbox sends its
SandboxRequest and waits for the scheduler's answer on ``Topics.decisions`` (read from the
offsets it had before the first request, read_committed) before it starts: ``PLACE`` starts it,
``QUEUE`` / ``ADMIT`` keep it waiting, a ``RECYCLE`` of the queued request (withdrawn) ends it
unstarted, an ``ANOMALY`` (refused) raises :class:`PlacementError`. Every wait is bounded: no
decision at all within ``first_decision_timeout_s`` (no scheduler running?) or no placement
within ``placement_timeout_s`` raises :class:`PlacementError` naming the sandbox, the request and
the decisions seen; the other sandboxes are then stopped. While waiting, node reports keep
coming every ``node_report_every_s`` (default 0.5 s), so the scheduler sees live capacity.
``wait_for_placement=False`` starts every sandbox at once, with no scheduler needed (tests of
the producer side). Waiting changes when a sandbox's events are sent, never what they are: the
event content for a seed is the same either way (the lifecycle's ``node`` stays the seeded one;
the manifest's ``placements`` record where the scheduler put each sandbox).

The manifest (JSON) records, per (task, sandbox, episode), the (seq, event_id) pairs the broker
acknowledged, the outcome, and which episodes loop, so tests can check pipeline output exactly.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import random
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from aiokafka import AIOKafkaConsumer, TopicPartition
from aiokafka.errors import KafkaError

from trajbus.bus.clients import new_consumer
from trajbus.bus.closing import close_client
from trajbus.bus.producer import get_producer
from trajbus.bus.settings import Settings
from trajbus.bus.topics import Topics
from trajbus.producers.emitter import AckInfo, SandboxEmitter
from trajbus.schemas.codec import CodecError, default_codec

log = logging.getLogger(__name__)

DEFAULT_START_MS = 1_767_225_600_000  # 2026-01-01T00:00:00Z
TOOLS = ["bash", "python", "http_get", "browser_click", "browser_type", "read_file", "write_file"]


@dataclass
class SimConfig:
    sandboxes: int = 10
    episodes: int = 3
    seed: int = 0
    tasks: list[str] = field(default_factory=lambda: ["swe-bench", "web-shop", "math-proofs"])
    tenants: list[str] = field(default_factory=lambda: ["acme", "globex", "initech"])
    nodes: int = 4
    steps_min: int = 5
    steps_max: int = 25
    loop: float = 0.1
    cycle: float = 0.05
    nonloop: float = 0.05
    crash: float = 0.05
    migrate: float = 0.1
    duplicate: float = 0.02
    shuffle_window: int = 0
    blob: float = 0.02
    blob_bytes: int = 2 * 1024 * 1024
    trace_line_bytes: int = 400
    start_ms: int = DEFAULT_START_MS
    durability: str = "os"
    concurrency: int = 256
    # > 0: nodes keep reporting every this many wall-clock seconds while the fleet runs (a live
    # scheduler marks nodes stale without reports); 0: one burst at the start (deterministic);
    # None: 0.5 when waiting for placements, else 0.
    node_report_every_s: float | None = None
    # Closed loop: each sandbox starts only once the scheduler placed it (see the module doc).
    wait_for_placement: bool = True
    first_decision_timeout_s: float = 120.0  # no decision about a request by then: an error
    placement_timeout_s: float = 600.0  # not placed by then (from the request): an error
    # Closed loop: a sandbox that ran a looping episode waits up to this long, before it
    # drains, for the scheduler's TERMINATE about it, and acknowledges it (DecisionAck), as a
    # runtime that stops the agent would; 0: never waits (it acknowledges one seen already).
    terminate_wait_s: float = 30.0


class PlacementError(RuntimeError):
    """A closed-loop sandbox could not start: no scheduling decision or no placement in time,
    or its request was refused."""


@dataclass
class EpisodeRecord:
    task: str
    sandbox: str
    episode: str
    behaviour: str
    outcome: str | None = None  # TERMINAL, TRUNCATED, or None (never ended)
    final_seq: int | None = None
    acked: list[tuple[int, str]] = field(default_factory=list)
    loop_span: tuple[int, int] | None = None  # (first_seq, last_seq) of the repetition


@dataclass
class Manifest:
    config: dict[str, Any]
    episodes: list[EpisodeRecord]
    sandbox_streams: dict[str, list[tuple[int, str]]]
    producer_ids: dict[str, list[str]]
    duplicates_sent: int
    events_acked: int
    blobs: int
    # closed loop: sandbox -> {"decisions": [kinds in order], "node", "waited_s"}
    placements: dict[str, dict[str, Any]] = field(default_factory=dict)
    # closed loop: sandbox -> event id of the scheduler's TERMINATE it acknowledged
    terminate_acks: dict[str, str] = field(default_factory=dict)

    @property
    def loops(self) -> list[EpisodeRecord]:
        return [e for e in self.episodes if e.behaviour in ("loop", "cycle")]

    def to_json(self) -> dict[str, Any]:
        return {
            "config": self.config,
            "episodes": [asdict(e) for e in self.episodes],
            "sandbox_streams": self.sandbox_streams,
            "producer_ids": self.producer_ids,
            "loops": [{"task": e.task, "sandbox": e.sandbox, "episode": e.episode,
                       "kind": e.behaviour, "first_seq": e.loop_span[0] if e.loop_span else None,
                       "last_seq": e.loop_span[1] if e.loop_span else None}
                      for e in self.loops],
            "duplicates_sent": self.duplicates_sent,
            "events_acked": self.events_acked,
            "blobs": self.blobs,
            "placements": self.placements,
            "terminate_acks": self.terminate_acks,
        }

    def write(self, path: str | Path) -> None:
        p = Path(path)
        p.parent.mkdir(parents=True, exist_ok=True)
        tmp = p.with_suffix(p.suffix + ".tmp")
        tmp.write_text(json.dumps(self.to_json(), indent=1))
        tmp.replace(p)


def load_manifest(path: str | Path) -> dict[str, Any]:
    data: dict[str, Any] = json.loads(Path(path).read_text())
    return data


class _Sandbox:
    def __init__(self, sim: _Sim, index: int) -> None:
        self.sim = sim
        cfg = sim.cfg
        self.rng = random.Random(f"{cfg.seed}:{index}")
        self.id_rng = random.Random(f"{cfg.seed}:{index}:ids")
        self.name = f"sb-{cfg.seed}-{index:05d}"
        self.task = self.rng.choice(cfg.tasks)
        self.tenant = self.rng.choice(cfg.tenants)
        self.node = f"node-{self.rng.randrange(cfg.nodes):03d}"
        self.clock = cfg.start_ms + self.rng.randrange(0, 60_000)
        self.next_hb = self.clock
        self.next_probe = self.clock
        self.incarnation = 0
        self.looped = False  # ran a looping episode (closed loop: waits for its TERMINATE)
        self.em: SandboxEmitter | None = None
        self.acked_values: list[tuple[str, bytes]] = []
        self.crash = self.rng.random() < cfg.crash
        self.migrate = self.rng.random() < cfg.migrate

    def _id(self) -> str:
        return f"{self.id_rng.getrandbits(128):032x}"

    def _on_ack(self, info: AckInfo) -> None:
        sim = self.sim
        sim.events_acked += 1
        if info.episode is None:
            sim.sandbox_streams[self.name].append((info.seq, info.event_id))
        else:
            sim.acked[(self.task, self.name, info.episode)].append((info.seq, info.event_id))
        if sim.cfg.duplicate > 0 and not info.resent and len(self.acked_values) < 64:
            self.acked_values.append((info.topic, info.value))

    async def _open(self) -> SandboxEmitter:
        cfg = self.sim.cfg
        pid = f"{self.name}/p{self.incarnation}"
        self.sim.producer_ids[self.name].append(pid)
        shuffle = (cfg.shuffle_window, random.Random(f"{cfg.seed}:{self.name}:shuffle:"
                                                     f"{self.incarnation}")) \
            if cfg.shuffle_window > 1 else None
        em = SandboxEmitter(
            self.name, self.task, settings=self.sim.settings, producer_id=pid,
            tenant=self.tenant, state_dir=self.sim.state_root / self.name,
            env={"OPENAI_API_KEY": f"sk-sim-{self.name}-secret-value-000000"},
            queue_policy="spill", durability="os" if cfg.durability == "os" else "fsync",
            on_ack=self._on_ack, shuffle=shuffle, id_factory=self._id,
        )
        self.em = await em.start()
        return self.em

    def tick(self, lo_ms: int, hi_ms: int) -> int:
        self.clock += self.rng.randint(lo_ms, hi_ms)
        return self.clock

    async def _periodic(self) -> None:
        em = self.em
        assert em is not None
        while self.clock >= self.next_hb:
            await em.heartbeat(event_time_ms=self.next_hb)
            self.next_hb += self.sim.settings.scheduler.heartbeat_interval_ms
        while self.clock >= self.next_probe:
            ok = self.rng.random() > 0.02
            await em.liveness(ok, target=f"{self.name}:8080", latency_ms=self.rng.randint(1, 40),
                              error=None if ok else "connection refused",
                              event_time_ms=self.next_probe)
            self.next_probe += 60_000

    async def run(self) -> None:
        try:
            await self._run()
        except BaseException:
            if self.em is not None:  # stopped (another sandbox failed) or failed: no leftovers
                with contextlib.suppress(Exception):
                    await self.em.abort()
            raise

    async def _run(self) -> None:
        cfg = self.sim.cfg
        placements = self.sim.placements
        if placements is None:
            await self.sim.request(self)
        else:
            waiter = placements.expect(self.name, f"req-{self.name}")
            await self.sim.request(self)
            if not await placements.wait(waiter, cfg):
                return  # withdrawn while queued: it never starts
        em = await self._open()
        await em.lifecycle("PROVISIONING", node=self.node, event_time_ms=self.tick(0, 500))
        await em.lifecycle("ACTIVE", node=self.node, event_time_ms=self.tick(500, 3000))
        crash_at = self.rng.randrange(cfg.episodes) if self.crash else -1
        migrate_at = self.rng.randrange(cfg.episodes) if self.migrate else -1
        for n in range(cfg.episodes):
            r = self.rng.random()
            behaviour = ("loop" if r < cfg.loop else
                         "cycle" if r < cfg.loop + cfg.cycle else
                         "nonloop" if r < cfg.loop + cfg.cycle + cfg.nonloop else "normal")
            if n == crash_at:
                behaviour = "crash"
            rec = EpisodeRecord(self.task, self.name, f"{n:05d}", behaviour)
            self.sim.episodes.append(rec)
            self.looped = self.looped or behaviour in ("loop", "cycle")
            ended = await self._episode(rec, migrate=(n == migrate_at))
            if not ended:
                break  # crashed without EpisodeEnd: the sandbox is recycled
        assert self.em is not None
        em = self.em  # reopened by a migration, if any
        if placements is not None and self.looped:
            decision_id = await placements.termination(self.name, cfg.terminate_wait_s)
            if decision_id is not None:
                self.sim.terminate_acks[self.name] = decision_id
                await em.acknowledge(decision_id, detail="simulated runtime: agent stopped",
                                     event_time_ms=self.tick(100, 1000))
        await em.lifecycle("DRAINING", reason="recycle", event_time_ms=self.tick(100, 1000))
        report = await em.drain(self.sim.settings.producer.drain_deadline_s)
        for rec in self.sim.episodes:
            if rec.sandbox == self.name and rec.episode in report.final_seqs:
                rec.final_seq = report.final_seqs[rec.episode]
        await em.lifecycle("RECYCLED", event_time_ms=self.tick(100, 1000))
        await em.close(60)
        await self.sim.resend_duplicates(self)

    async def _episode(self, rec: EpisodeRecord, migrate: bool) -> bool:
        cfg = self.sim.cfg
        em = self.em
        assert em is not None
        ep = rec.episode
        await em.start_episode(ep, tenant=self.tenant, policy_version=int(ep) // 2,
                               context={"dataset": f"ds-{self.task}"},
                               event_time_ms=self.tick(200, 2000))
        trace_off = 0
        steps = self.rng.randint(cfg.steps_min, cfg.steps_max)
        migrate_step = self.rng.randrange(steps) if migrate else -1
        crash_step = self.rng.randrange(max(1, steps)) if rec.behaviour == "crash" else -1

        async def call(tool: str, args: dict[str, Any], result: Any, gap: tuple[int, int]
                       ) -> int:
            nonlocal trace_off
            em2 = self.em
            assert em2 is not None
            cid = await em2.tool_call(ep, tool, args, event_time_ms=self.tick(*gap))
            dur = self.rng.randint(5, 3000)
            seq = em2.next_seq(ep)
            await em2.tool_result(ep, cid, tool, result, duration_ms=dur,
                                  event_time_ms=self.tick(dur, dur))
            line = (json.dumps({"tool": tool, "args": args, "result": result}) + "\n").encode()
            line = line + b"." * max(0, self.rng.randint(0, cfg.trace_line_bytes) - len(line))
            await em2.trace_chunk(ep, line, file_offset=trace_off, content_type="application/jsonl",
                                  event_time_ms=self.clock)
            trace_off += len(line)
            if self.rng.random() < cfg.blob:
                blob = self.rng.randbytes(cfg.blob_bytes)
                await em2.trace_chunk(ep, blob, file_offset=trace_off, content_type="image/png",
                                      event_time_ms=self.clock)
                trace_off += len(blob)
                self.sim.blobs += 1
            await self._periodic()
            return seq

        for step in range(steps):
            if step == migrate_step:
                await self._migrate()
            if step == crash_step:
                if self.rng.random() < 0.5:
                    em3 = self.em
                    assert em3 is not None
                    await em3.end_episode(ep, "TRUNCATED", reason="agent process crashed",
                                          event_time_ms=self.tick(100, 1000))
                    rec.outcome = "TRUNCATED"
                    return True
                return False
            if rec.behaviour in ("loop", "cycle", "nonloop") and step == steps // 2:
                await self._repeat(rec, call)
            tool = self.rng.choice(TOOLS)
            await call(tool, {"cmd": f"{tool} step {step}", "arg": self.rng.randint(0, 10**6),
                              "timestamp": self.clock},
                       {"ok": True, "out": f"output {self.rng.getrandbits(32):08x}"}, (500, 8000))
        em = self.em
        assert em is not None
        await em.end_episode(ep, "TERMINAL", reward=round(self.rng.random(), 3),
                             event_time_ms=self.tick(100, 2000))
        rec.outcome = "TERMINAL"
        return True

    async def _repeat(self, rec: EpisodeRecord,
                      call: Callable[..., Any]) -> None:
        first: int | None = None
        last = 0
        if rec.behaviour == "loop":
            for _ in range(25):  # 25 x 6 s = 150 s, unchanged result
                last = await call("browser_click", {"selector": "#submit"},
                                  {"page": "checkout", "changed": False}, (6000, 6000))
                first = last if first is None else first
        elif rec.behaviour == "cycle":
            for _ in range(24):  # A,B,A,B... 48 calls x 3.2 s
                for sel in ("#next", "#prev"):
                    last = await call("browser_click", {"selector": sel},
                                      {"page": "list", "changed": False}, (3200, 3200))
                    first = last if first is None else first
        else:  # same call until the result changes: distinct results, not a loop
            for i in range(25):
                last = await call("http_get", {"url": "http://svc/status"},
                                  {"status": "pending", "poll": i}, (6000, 6000))
                first = last if first is None else first
        if rec.behaviour != "nonloop" and first is not None:
            rec.loop_span = (first - 1, last)  # ToolCall seqs (result is seq + 0)

    async def _migrate(self) -> None:
        em = self.em
        assert em is not None
        await em.close(0.0)  # handed over with whatever is still unacknowledged
        self.incarnation += 1
        await self._open()


@dataclass
class _Waiter:
    sandbox: str
    request_id: str
    answered: asyncio.Event
    outcome: asyncio.Future[dict[str, Any]]
    decisions: list[str] = field(default_factory=list)


class _Placements:
    """The scheduler's decisions about this fleet's requests, read from ``Topics.decisions``
    starting at the end offsets it had before the first request was sent."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.topic = Topics(settings).decisions
        self.codec = default_codec()
        self.waiters: dict[str, _Waiter] = {}
        self.placed: dict[str, dict[str, Any]] = {}
        # the scheduler's TERMINATE about each sandbox: its event id, once seen
        self.terminations: dict[str, str] = {}
        self._terminated: dict[str, asyncio.Event] = {}
        self._consumer: AIOKafkaConsumer | None = None
        self._task: asyncio.Task[None] | None = None
        self._error: BaseException | None = None

    async def start(self) -> None:
        k = self.settings.kafka
        consumer = new_consumer(
            k, client_id=f"{k.client_id}-sim-placements", group_id=None,
            enable_auto_commit=False, isolation_level="read_committed")
        await consumer.start()
        self._consumer = consumer
        try:
            producer = await get_producer(k)
            try:
                parts = await asyncio.wait_for(producer.partitions_for(self.topic),
                                               k.connect_timeout_s)
            except Exception as exc:
                raise PlacementError(
                    f"the scheduler's decisions topic {self.topic} is not available ({exc!r}): "
                    "create the topics first (trajbus simulate --create-topics)") from exc
            tps = [TopicPartition(self.topic, p) for p in sorted(parts)]
            consumer.assign(tps)
            await consumer.seek_to_end(*tps)
            for tp in tps:  # pin the start now: decisions about our requests all come later
                await asyncio.wait_for(consumer.position(tp), k.connect_timeout_s)
        except BaseException:
            await self.stop()
            raise
        self._task = asyncio.create_task(self._read(), name="sim-placements")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        if self._consumer is not None:
            await close_client(self._consumer, "placements consumer")
            self._consumer = None

    def expect(self, sandbox: str, request_id: str) -> _Waiter:
        """Register before sending the request, so no decision about it can be missed."""
        loop = asyncio.get_running_loop()
        w = _Waiter(sandbox, request_id, asyncio.Event(), loop.create_future())
        if self._error is not None:
            w.outcome.set_exception(PlacementError(f"reading {self.topic} failed: "
                                                   f"{self._error!r}"))
            w.answered.set()
        self.waiters[request_id] = w
        return w

    async def wait(self, w: _Waiter, cfg: SimConfig) -> bool:
        """True once placed; False when the request was withdrawn while queued; raises
        :class:`PlacementError` when refused or past a deadline."""
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        try:
            try:
                await asyncio.wait_for(w.answered.wait(), cfg.first_decision_timeout_s)
            except TimeoutError:
                raise PlacementError(
                    f"sandbox {w.sandbox}: no scheduling decision about request {w.request_id} "
                    f"on {self.topic} within {cfg.first_decision_timeout_s:g}s: is a scheduler "
                    "running on these topics (`trajbus worker`)? To run the fleet without one, "
                    "pass wait_for_placement=False (trajbus simulate --no-wait-for-placement)"
                ) from None
            remaining = cfg.placement_timeout_s - (loop.time() - t0)
            try:
                rec = await asyncio.wait_for(asyncio.shield(w.outcome), max(0.0, remaining))
            except TimeoutError:
                raise PlacementError(
                    f"sandbox {w.sandbox}: request {w.request_id} not placed within "
                    f"{cfg.placement_timeout_s:g}s (decisions so far: "
                    f"{', '.join(w.decisions)}); is capacity or tenant credit ever freed?"
                ) from None
        finally:
            self.waiters.pop(w.request_id, None)
        kind = rec["decision"]
        self.placed[w.sandbox] = {"decisions": list(w.decisions), "node": rec.get("node"),
                                  "waited_s": round(loop.time() - t0, 3)}
        if kind == "PLACE":
            return True
        if kind == "RECYCLE":
            return False
        raise PlacementError(f"sandbox {w.sandbox}: request {w.request_id} refused by the "
                             f"scheduler ({kind}): {rec.get('reason')}")

    async def _read(self) -> None:
        consumer = self._consumer
        assert consumer is not None
        try:
            while True:
                try:
                    batch = await consumer.getmany(timeout_ms=500)
                except KafkaError as exc:
                    # e.g. the broker restarting: keep reading (each wait has its deadline)
                    log.warning("reading %s: %r (retrying)", self.topic, exc)
                    await asyncio.sleep(0.5)
                    continue
                for recs in batch.values():
                    for r in recs:
                        self._on_decision(r.value)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # the consumer broke: fail every waiter now, not at a deadline
            self._error = exc
            for w in self.waiters.values():
                if not w.outcome.done():
                    w.outcome.set_exception(PlacementError(f"reading {self.topic} failed: "
                                                           f"{exc!r}"))
                w.answered.set()

    async def termination(self, sandbox: str, wait_s: float) -> str | None:
        """The event id of the scheduler's TERMINATE about ``sandbox``, waiting up to
        ``wait_s`` for it; None if none came."""
        ev = self._terminated.setdefault(sandbox, asyncio.Event())
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(ev.wait(), wait_s)
        return self.terminations.get(sandbox)

    def _on_decision(self, value: bytes | None) -> None:
        if not value:
            return
        try:
            d = self.codec.decode(value)
        except CodecError:
            return  # not ours to judge; the scheduler's topic is checked elsewhere
        if d.kind == "SchedulingDecision" and d.record["decision"] == "TERMINATE" and \
                str(d.header.get("producer_id", "")).endswith("scheduler"):
            sandbox = str(d.header["sandbox"])
            self.terminations.setdefault(sandbox, str(d.header["event_id"]))
            self._terminated.setdefault(sandbox, asyncio.Event()).set()
        rid = d.record.get("request_id") if d.kind == "SchedulingDecision" else None
        w = self.waiters.get(rid) if isinstance(rid, str) else None
        if w is None or w.outcome.done():
            return
        kind = str(d.record["decision"])
        w.decisions.append(kind)
        w.answered.set()
        if kind == "PLACE" or kind == "ANOMALY" or (
                kind == "RECYCLE" and (d.record.get("details") or {}).get("queued") == "true"):
            w.outcome.set_result(d.record)


class _Sim:
    def __init__(self, settings: Settings, cfg: SimConfig, state_root: Path) -> None:
        self.settings = settings
        self.cfg = cfg
        self.state_root = state_root
        self.topics = Topics(settings)
        self.episodes: list[EpisodeRecord] = []
        self.acked: dict[tuple[str, str, str], list[tuple[int, str]]] = defaultdict(list)
        self.sandbox_streams: dict[str, list[tuple[int, str]]] = defaultdict(list)
        self.terminate_acks: dict[str, str] = {}
        self.producer_ids: dict[str, list[str]] = defaultdict(list)
        self.duplicates_sent = 0
        self.events_acked = 0
        self.blobs = 0
        self.codec = default_codec()
        self.control_seq: dict[str, int] = defaultdict(int)
        self.placements: _Placements | None = None

    async def request(self, sb: _Sandbox) -> None:
        producer = await get_producer(self.settings.kafka)
        seq = self.control_seq[sb.tenant]
        self.control_seq[sb.tenant] += 1
        rec = {"header": self._header(sb.task, sb.name, seq, sb.clock, f"sim-{sb.tenant}",
                                      f"req-{sb.name}"),
               "request_id": f"req-{sb.name}", "tenant": sb.tenant, "cpu": 2.0,
               "memory_mb": 4096, "gpu_share": 0.2 if sb.rng.random() < 0.2 else 0.0,
               "dataset": f"ds-{sb.task}", "ttl_ms": self.settings.scheduler.lease_ttl_ms}
        await (await producer.send(self.topics.control, self.codec.encode("SandboxRequest", rec),
                                   key=sb.tenant.encode()))

    @staticmethod
    def _header(task: str, sandbox: str, seq: int, t: int, pid: str, eid: str) -> dict[str, Any]:
        return {"event_id": eid, "task": task, "sandbox": sandbox, "episode": None, "seq": seq,
                "event_time_ms": t, "producer_id": pid, "policy_version": None}

    async def node_reports(self, rounds: int = 20, first_round: int = 0,
                           now_ms: int | None = None) -> None:
        producer = await get_producer(self.settings.kafka)
        rng = random.Random(f"{self.cfg.seed}:nodes:{first_round}")
        futs = []
        for r in range(first_round, first_round + rounds):
            t = (self.cfg.start_ms + r * 500) if now_ms is None else now_ms
            for n in range(self.cfg.nodes):
                node = f"node-{n:03d}"
                rec = {"header": self._header("_fleet", node, r, t, "sim-nodes",
                                              f"{rng.getrandbits(128):032x}"),
                       "node": node, "cpu_total": 64.0, "cpu_free": rng.uniform(0, 64),
                       "memory_total_mb": 262_144, "memory_free_mb": rng.randint(0, 262_144),
                       "gpu_total": 8.0, "gpu_free": round(rng.uniform(0, 8), 1),
                       "network_free_mbps": rng.uniform(100, 10_000),
                       "cached_datasets": [f"ds-{t_}" for t_ in self.cfg.tasks
                                           if rng.random() < 0.5]}
                futs.append(await producer.send(self.topics.nodes,
                                                self.codec.encode("NodeReport", rec),
                                                key=node.encode()))
        await asyncio.gather(*futs)

    async def resend_duplicates(self, sb: _Sandbox) -> None:
        if not sb.acked_values or self.cfg.duplicate <= 0:
            return
        producer = await get_producer(self.settings.kafka)
        futs = []
        rng = random.Random(f"{self.cfg.seed}:{sb.name}:dups")  # independent of interleaving
        for topic, value in sb.acked_values:
            if rng.random() < self.cfg.duplicate * 10:
                futs.append(await producer.send(topic, value, key=sb.name.encode()))
        # copies of delivered events: one the broker did not take (an outage) is not lost data
        sent = await asyncio.gather(*futs, return_exceptions=True)
        failed = [r for r in sent if isinstance(r, BaseException)]
        for r in failed:
            if not isinstance(r, KafkaError):
                raise r
        if failed:
            log.warning("%s: %d of %d duplicates not delivered (%r)", sb.name, len(failed),
                        len(sent), failed[0])
        self.duplicates_sent += len(sent) - len(failed)

    def manifest(self) -> Manifest:
        for rec in self.episodes:
            acked = dict(self.acked.get((rec.task, rec.sandbox, rec.episode), []))
            rec.acked = sorted(acked.items())
            if rec.outcome is not None and rec.acked:
                rec.final_seq = rec.acked[-1][0]
        streams = {k: sorted(dict(v).items()) for k, v in self.sandbox_streams.items()}
        placed = dict(sorted(self.placements.placed.items())) if self.placements else {}
        return Manifest(asdict(self.cfg), self.episodes, streams, dict(self.producer_ids),
                        self.duplicates_sent, self.events_acked, self.blobs, placed,
                        dict(sorted(self.terminate_acks.items())))


async def simulate(settings: Settings, sandboxes: int = 10, episodes: int = 3, seed: int = 0,
                   *, manifest_path: str | Path | None = None,
                   state_root: str | Path | None = None, **knobs: Any) -> Manifest:
    """Run the simulated fleet to completion and return (and optionally write) its manifest.
    ``knobs`` are :class:`SimConfig` fields (loop, cycle, nonloop, crash, migrate, duplicate,
    shuffle_window, blob, wait_for_placement, ...). Topics must exist. With
    ``wait_for_placement`` (the default) a scheduler must be running on these topics; raises
    :class:`PlacementError` when a sandbox gets no placement in time."""
    cfg = SimConfig(sandboxes=sandboxes, episodes=episodes, seed=seed, **knobs)
    root = Path(state_root) if state_root is not None else settings.state_dir / f"sim-{seed}"
    sim = _Sim(settings, cfg, root)
    every = cfg.node_report_every_s
    if every is None:
        every = 0.5 if cfg.wait_for_placement else 0.0
    await sim.node_reports()
    sem = asyncio.Semaphore(cfg.concurrency)

    async def one(i: int) -> None:
        async with sem:
            await _Sandbox(sim, i).run()

    async def keep_reporting() -> None:
        # Periodic status: a report the broker cannot take (an outage) is superseded by the
        # next one, so it is skipped, never fatal to the fleet (a 20 s outage ended a run).
        r = 20
        failing = False
        while True:
            await asyncio.sleep(every)
            try:
                await sim.node_reports(1, first_round=r, now_ms=int(time.time() * 1000))
            except KafkaError as exc:
                if not failing:
                    log.warning("node reports not delivered (%r); skipping them until the "
                                "broker takes them again", exc)
                failing = True
            else:
                if failing:
                    log.warning("node reports delivered again")
                failing = False
            r += 1

    if cfg.wait_for_placement:
        sim.placements = _Placements(settings)
        await sim.placements.start()
    reporter = asyncio.create_task(keep_reporting()) if every > 0 else None
    tasks = [asyncio.create_task(one(i)) for i in range(sandboxes)]
    try:
        await asyncio.gather(*tasks)
    finally:
        for t in tasks:  # one sandbox failed: stop the others too
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if reporter is not None:
            reporter.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await reporter
        if sim.placements is not None:
            await sim.placements.stop()
    m = sim.manifest()
    if manifest_path is not None:
        m.write(manifest_path)
    return m
