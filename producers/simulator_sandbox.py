"""One simulated sandbox's script: :class:`SimSandbox` requests a placement (closed loop),
opens its emitter, goes PROVISIONING -> ACTIVE, runs its episodes with the behaviour drawn for
each (normal, loop, cycle, nonloop, crash; a migration to a new emitter mid-episode), answers
the scheduler's TERMINATE after a looping episode, then DRAINING -> Drained -> RECYCLED and
re-sends some acknowledged events as duplicates.

Guarantee: every event's content (kind, seq, fields, event id, event time) comes from RNGs
seeded by ``(seed, sandbox index)`` and a simulated clock (nothing sleeps), so it is the same
on every run whatever the interleaving with other sandboxes or the scheduler's timing.
"""

from __future__ import annotations

import contextlib
import json
import random
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from trajbus.producers.emitter import AckInfo, SandboxEmitter

from .simulator_manifest import EpisodeRecord

if TYPE_CHECKING:
    from .simulator import _Sim

TOOLS = ["bash", "python", "http_get", "browser_click", "browser_type", "read_file", "write_file"]


class SimSandbox:
    """One sandbox of the fleet; see the module docstring."""

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
