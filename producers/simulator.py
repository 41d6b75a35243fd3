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

Rooms: this module holds :func:`simulate` and the fleet (``_Sim``: requests, node reports,
duplicates, the manifest); :mod:`.simulator_sandbox` one sandbox's script;
:mod:`.simulator_placements` the closed loop (the scheduler's decisions read back);
:mod:`.simulator_manifest` the configuration and the manifest. Their names import from here.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
from collections import defaultdict
from dataclasses import asdict
from pathlib import Path
from typing import Any

from aiokafka.errors import KafkaError

from trajbus.bus.producer import get_producer
from trajbus.bus.settings import Settings
from trajbus.bus.topics import Topics
from trajbus.schemas.codec import default_codec

from .simulator_manifest import (
    DEFAULT_START_MS,
    EpisodeRecord,
    Manifest,
    SimConfig,
    load_manifest,
)
from .simulator_placements import PlacementError, Placements, PlacementWaiter
from .simulator_sandbox import TOOLS, SimSandbox

__all__ = [
    "DEFAULT_START_MS",
    "TOOLS",
    "EpisodeRecord",
    "Manifest",
    "PlacementError",
    "SimConfig",
    "load_manifest",
    "simulate",
]

# the former names of the fleet's rooms
_Sandbox, _Placements, _Waiter = SimSandbox, Placements, PlacementWaiter

log = logging.getLogger(__name__)


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
        self.placements: Placements | None = None

    async def request(self, sb: SimSandbox) -> None:
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

    async def resend_duplicates(self, sb: SimSandbox) -> None:
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
            await SimSandbox(sim, i).run()

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
        sim.placements = Placements(settings)
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
