"""The trainer's side of the end-to-end bench: a ReplayClient in a background task recording
each event's receipt (``Trainer``, per-phase ``Sink``), a probe of the input topic beside the
worker (``InputProbe``), each event followed through the stages (``stage_split``), one phase's
figures (``phase_report``), and the warm-up episode through the whole path (``warm_up``).
The phase of an event is its episode id's prefix (``r2000-...``)."""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import statistics
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from harness.figures import percentile

if TYPE_CHECKING:
    from trajbus.bus.settings import Settings


def now_ms() -> float:
    return time.time() * 1000.0


@dataclass
class Sink:
    """Per-phase receipts of the trainer."""

    latencies_ms: list[float] = field(default_factory=list)
    # the same latency split at the replay record's timestamp (when the worker wrote it):
    # emitter + input topic + worker until the send, then transaction commit + trainer fetch
    to_worker_ms: list[float] = field(default_factory=list)
    to_trainer_ms: list[float] = field(default_factory=list)
    events: int = 0
    segments: int = 0
    first_ms: float = 0.0
    last_ms: float = 0.0
    episodes_done: int = 0
    # per event, for the split by stage with --probe-input: (episode, seq, event time,
    # replay record timestamp, receipt time)
    receipts: list[tuple[str, int, float, float, float]] = field(default_factory=list)


async def wait_for_events(sinks: dict[str, Sink], phase: str, events: int,
                          timeout: float) -> bool:
    """Whether the phase's sink received ``events`` events within ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if sinks.get(phase, Sink()).events >= events:
            return True
        await asyncio.sleep(0.05)
    return False


def replay_client(settings: Settings, task: str, group: str, max_in_flight: int,
                  commit_every_ms: float) -> Any:
    """A ReplayClient with the given commit policy: 0 = its default (every ack returns once
    committed), N = commits in the background at most once per N ms (a crash re-delivers
    at most the acknowledged-but-uncommitted tail, which the trainer's dedupe drops)."""
    from trajbus.consumers.replay.client import ReplayClient

    return ReplayClient([task], group, settings, max_in_flight=max_in_flight,
                        commit_every_ms=commit_every_ms)


def trainer_name(commit_every_ms: float) -> str:
    return "stock" if commit_every_ms == 0 else f"commit{int(commit_every_ms)}ms"


class InputProbe:
    """``--probe-input``: a read_committed consumer of the input topic beside the worker, to
    split the latency before the worker: event creation -> the Kafka record's create time
    (the emitter: journal, fsync, its send loop) and create time -> fetched by a consumer
    (the producer's linger and in-flight queue, the broker, the fetch). Each input record is
    kept by (episode, seq), so :func:`stage_split` follows every event through each stage."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        # phase -> (episode, seq) -> (input record timestamp, fetched by the probe)
        self.seen: dict[str, dict[tuple[str, int], tuple[float, float]]] = {}
        self.task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        from aiokafka import AIOKafkaConsumer, TopicPartition

        from trajbus.bus.topics import Topics

        topic = Topics(self.settings).sandbox_events
        consumer = AIOKafkaConsumer(bootstrap_servers=self.settings.kafka.bootstrap_servers,
                                    isolation_level="read_committed", enable_auto_commit=False)
        await consumer.start()
        tps = [TopicPartition(topic, p)
               for p in range(self.settings.topics.partitions)]
        consumer.assign(tps)
        await consumer.seek_to_end(*tps)
        self.task = asyncio.create_task(self._run(consumer))

    async def _run(self, consumer: Any) -> None:
        from trajbus.schemas.codec import default_codec

        codec = default_codec()
        try:
            while True:
                batch = await consumer.getmany(timeout_ms=200)
                t = now_ms()
                for msgs in batch.values():
                    for m in msgs:
                        if m.key == b"_tick":
                            continue
                        h = codec.decode(m.value).header
                        ep = h.get("episode") or "-"
                        self.seen.setdefault(ep.split("-", 1)[0], {})[(ep, h["seq"])] = (
                            m.timestamp - h["event_time_ms"], t - m.timestamp)
        finally:
            await consumer.stop()

    def report(self, phase: str) -> dict[str, Any]:
        seen = self.seen.get(phase, {}).values()
        a, b = [x for x, _ in seen], [y for _, y in seen]
        return {"event_to_record_create": {"p50": round(percentile(a, 50), 1),
                                           "p99": round(percentile(a, 99), 1)},
                "record_create_to_fetched": {"p50": round(percentile(b, 50), 1),
                                             "p99": round(percentile(b, 99), 1)}}

    async def stop(self) -> None:
        if self.task is not None:
            self.task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self.task


STAGES = ("emitter", "input_to_replay_record", "replay_record_to_trainer")


STAGE_NOTES = {
    "emitter": "emit call -> input record's timestamp (journal write + group fsync, the "
               "shared sender's round, the producer's append)",
    "input_to_replay_record": "input record -> replay record's timestamp (producer linger "
                              "and ack, worker fetch, its batch, the previous transaction)",
    "replay_record_to_trainer": "replay record -> the trainer holds it (the transaction's "
                                "commit and markers, read_committed fetch, the client)",
    "input_fetchable": "(beside) input record -> fetched by a read_committed probe consumer",
}


def stage_split(sink: Sink, probe: InputProbe, phase: str) -> dict[str, Any]:
    """Each event followed through the stages (joined by (episode, seq) with the probe's
    input records): p50/p99 of every stage, and where the slowest 1 % of events (end to end
    >= its p99) spent their time (mean ms per stage)."""
    seen = probe.seen.get(phase, {})
    rows: list[tuple[float, float, float, float, float]] = []
    for ep, seq, t_event, t_replay, t_recv in sink.receipts:
        got = seen.get((ep, seq))
        if got is None:
            continue
        emit, fetchable = got
        t_input = t_event + emit
        rows.append((t_recv - t_event, emit, t_replay - t_input, t_recv - t_replay, fetchable))
    if not rows:
        return {}
    cols = list(zip(*rows, strict=True))
    names = ("end_to_end", *STAGES, "input_fetchable")
    out: dict[str, Any] = {"events_joined": len(rows)}
    for name, col in zip(names, cols, strict=True):
        out[name] = {"p50": round(percentile(list(col), 50), 1),
                     "p99": round(percentile(list(col), 99), 1)}
    cut = percentile(list(cols[0]), 99)
    tail = [r for r in rows if r[0] >= cut]
    out["slowest_1pct_mean_ms"] = {
        name: round(statistics.fmean(r[i] for r in tail), 1)
        for i, name in enumerate(names) if name != "input_fetchable"}
    return out


class Trainer:
    """A ReplayClient in a background task; each segment goes to the sink of its phase (the
    episode id's prefix) and is acknowledged."""

    def __init__(self, settings: Settings, task: str,
                 commit_every_ms: float = 0, group_suffix: str = "") -> None:
        group = f"{settings.topics.prefix}.trainer.{task}" + (
            f".{group_suffix}" if group_suffix else "")
        self.client = replay_client(settings, task, group, 100_000, commit_every_ms)
        self.sinks: dict[str, Sink] = {}
        self.task: asyncio.Task[None] | None = None
        self.cpu0 = 0.0
        self.keep_receipts = False  # set with --probe-input (the split by stage)

    async def start(self) -> None:
        await self.client.start()
        self.task = asyncio.create_task(self._run())
        consumer = self.client._consumer
        assert consumer is not None
        for _ in range(200):  # wait for the group join: no start-up delay in the latencies
            if consumer.assignment():
                break
            await asyncio.sleep(0.05)

    async def _run(self) -> None:
        async for seg in self.client.segments():
            t = now_ms()
            phase = seg.episode.split("-", 1)[0]
            sink = self.sinks.setdefault(phase, Sink())
            if not sink.first_ms:
                sink.first_ms = t
            sink.last_ms = t
            sink.segments += 1
            sink.events += len(seg.events)
            sink.latencies_ms.extend(t - ev.record["header"]["event_time_ms"]
                                     for ev in seg.events)
            if seg.timestamp_ms:
                sink.to_worker_ms.extend(seg.timestamp_ms - ev.record["header"]["event_time_ms"]
                                         for ev in seg.events)
                sink.to_trainer_ms.extend([t - seg.timestamp_ms] * len(seg.events))
                if self.keep_receipts:
                    sink.receipts.extend(
                        (seg.episode, ev.record["header"]["seq"],
                         ev.record["header"]["event_time_ms"], seg.timestamp_ms, t)
                        for ev in seg.events)
            if seg.is_last:
                sink.episodes_done += 1
            await self.client.ack(seg)

    async def wait_for(self, phase: str, events: int, timeout: float) -> bool:
        return await wait_for_events(self.sinks, phase, events, timeout)

    async def stop(self) -> None:
        if self.task is not None:
            self.task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self.task
        await self.client.stop()


async def warm_up(settings: Settings, trainer: Trainer | dict[str, Trainer],
                  task: str) -> None:
    """One short episode through the whole path (topics, worker assignment, transactions)."""
    from trajbus.producers.emitter import SandboxEmitter

    state = Path(tempfile.mkdtemp(prefix="bench-e2e-warm-"))
    ep = f"warm-{task}"
    async with SandboxEmitter(f"warm-{task}-sb", task, settings=settings, state_dir=state,
                              durability="os") as em:
        await em.start_episode(ep)
        await em.tool_call(ep, "shell", {"cmd": "true"})
        await em.end_episode(ep)
        await em.flush(60)
    shutil.rmtree(state, ignore_errors=True)
    for t in (trainer.values() if isinstance(trainer, dict) else [trainer]):
        if not await t.wait_for("warm", 3, 120):
            raise RuntimeError("warm-up episode did not reach the trainer in 120 s "
                               "(is the worker running? see its log)")


def phase_report(rate: int | None, prod: dict[str, Any], complete: bool, sink: Sink,
                 middle: tuple[str, float], end: tuple[str, float],
                 extra: dict[str, Any]) -> dict[str, Any]:
    """One phase's figures, the same shape for trajbus (worker -> trainer) and the peer
    (loop -> consumer): throughput, latency and its split at the middle stage's output, CPU."""
    (mid, mid_cpu), (last, last_cpu) = middle, end
    total = prod["events"]
    span_s = max(1e-9, (sink.last_ms - prod["t_first_emit_ms"]) / 1000)
    lat = sink.latencies_ms

    def p50_p99(xs: list[float]) -> dict[str, float]:
        return {q: round(percentile(xs, v), 1) for q, v in (("p50", 50), ("p99", 99))}

    return {
        "offered_events_per_s": rate or "max",
        "events_emitted": total, "events_delivered": sink.events, "complete": complete,
        **extra,
        "emit_events_per_s": prod["emit_events_per_s"],
        "end_to_end_events_per_s": round(sink.events / span_s),
        "latency_ms": {"p50": round(percentile(lat, 50), 1), "p90": round(percentile(lat, 90), 1),
                       "p99": round(percentile(lat, 99), 1), "max": round(max(lat, default=0), 1),
                       "mean": round(statistics.fmean(lat), 1) if lat else None},
        "latency_split_ms": {
            f"event_to_{mid}_output": p50_p99(sink.to_worker_ms),
            f"{mid}_output_to_{last}": p50_p99(sink.to_trainer_ms),
        },
        "cpu_s": {"producer": prod["cpu_s"], mid: round(mid_cpu, 2), last: round(last_cpu, 2)},
        "events_per_cpu_s": {"producer": prod["events_per_cpu_s"],
                             mid: round(total / mid_cpu) if mid_cpu else None,
                             last: round(total / last_cpu) if last_cpu else None},
    }
