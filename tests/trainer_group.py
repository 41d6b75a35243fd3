"""Trainers of one group joining and leaving at random moments while replay topics are written
live at 1,000-2,000 events/s (issue 41, item 2), checked against the producer's manifest.

The producer writes what the reorder worker writes for live episodes: one task's replay topic,
many episodes open at once (their segments interleaved in every partition), segments of 1-3
events, keyed by ``sandbox/episode``, in transactions every ~100 ms (a commit marker after
each). Its manifest is every episode's events in seq order (``"<kind>:<event id>"``).

Each trainer reads ``episodes()``, trains a little (a few ms), and acknowledges; it records
every delivery (complete or not, and why) and every ``ack()`` result. Members join and leave
(``stop()``) at random moments; after the producer is done one member stays until every
episode of the manifest is acknowledged. The checks (:func:`violations`):

- every episode of the manifest is acknowledged exactly once across the group (an ``ack()``
  that returned True; a client whose ``ack`` returns None counts as True);
- no episode is delivered to a member after an acknowledgement of it returned;
- every delivered episode that says ``complete`` holds exactly the manifest's events;
- an episode the client does not mark complete is counted by reason (none is expected here:
  every member starts from the group's commit).

Used by tests/kafka/test_trainer_group.py (one run each) and tests/trainer_group_drill.py
(--runs N).
"""

from __future__ import annotations

import asyncio
import random
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from aiokafka import AIOKafkaProducer
from replay_support import create_replay_topic

from trajbus.bus.settings import Settings
from trajbus.bus.topics import episode_record_key
from trajbus.consumers.replay.client import Episode, ReplayClient, SyncReplayClient
from trajbus.consumers.replay.core import SegmentOut, segment_record
from trajbus.schemas import models as m
from trajbus.schemas.codec import default_codec

TASK = "group-drill"
Key = tuple[str, str]


def _episode_events(sandbox: str, episode: str, steps: int, t0: int) -> list[bytes]:
    def header(seq: int) -> m.Envelope:
        return m.Envelope(event_id=f"{episode}-{seq}", task=TASK, sandbox=sandbox,
                          episode=episode, seq=seq, event_time_ms=t0 + seq, producer_id="drill")

    evs = [m.EpisodeStart(header=header(0)).encode()]
    seq = 0
    for s in range(steps):
        seq += 1
        evs.append(m.ToolCall(header=header(seq), call_id=f"c{s}", tool="exec",
                              args_hash=f"{s:064x}").encode())
        seq += 1
        evs.append(m.ToolResult(header=header(seq), call_id=f"c{s}", tool="exec",
                                status=m.ToolStatus.OK, result_hash=f"{s:064x}").encode())
    evs.append(m.EpisodeEnd(header=header(seq + 1), outcome=m.EpisodeOutcome.TERMINAL).encode())
    return evs


@dataclass
class _Open:
    key: Key
    events: list[bytes]
    next_seq: int = 0
    seg_index: int = 0


async def produce_live(settings: Settings, rate: int, duration_s: float, seed: int,
                       sandboxes: int = 40, max_steps: int = 15) -> dict[Key, list[str]]:
    """Write live episodes to ``TASK``'s replay topic at ``rate`` events/s for ``duration_s``;
    every episode started is finished. Returns the manifest: each episode's events."""
    rng = random.Random(seed)
    topic = await create_replay_topic(settings, TASK)
    codec = default_codec()
    producer = AIOKafkaProducer(bootstrap_servers=settings.kafka.bootstrap_servers,
                                transactional_id=f"{settings.topics.prefix}-drill-{seed}")
    manifest: dict[Key, list[str]] = {}
    counter = 0
    t0 = int(time.time() * 1000)

    def new_episode(sb: int) -> _Open:
        nonlocal counter
        counter += 1
        key = (f"sb-{sb}", f"ep-{seed}-{counter}")
        events = _episode_events(key[0], key[1], rng.randint(1, max_steps), t0 + counter)
        manifest[key] = [f"{k}:{key[1]}-{i}" for i, k in enumerate(
            ["EpisodeStart"] + ["ToolCall", "ToolResult"] * ((len(events) - 2) // 2)
            + ["EpisodeEnd"])]
        return _Open(key, events)

    open_eps = {sb: new_episode(sb) for sb in range(sandboxes)}
    slot_s = 0.1
    per_slot = max(1, int(rate * slot_s))
    loop = asyncio.get_running_loop()
    started = loop.time()
    await producer.start()
    try:
        slot = 0
        while open_eps:
            producing = loop.time() - started < duration_s
            async with producer.transaction():
                sent = 0
                while sent < per_slot and open_eps:
                    sb = rng.choice(list(open_eps))
                    ep = open_eps[sb]
                    n = min(rng.choice((1, 1, 1, 2, 3)), len(ep.events) - ep.next_seq)
                    first = ep.next_seq
                    events = ep.events[first:first + n]
                    ep.next_seq += n
                    last = ep.next_seq == len(ep.events)
                    seg = SegmentOut(TASK, ep.key[0], ep.key[1], ep.seg_index, first,
                                     first + n - 1, events, None, ep.seg_index == 0, last,
                                     last, t0)
                    ep.seg_index += 1
                    await producer.send(topic, codec.encode("ReplaySegment",
                                                            segment_record(seg, "drill")),
                                        key=episode_record_key(*ep.key))
                    sent += n
                    if last:
                        if producing:
                            open_eps[sb] = new_episode(sb)
                        else:
                            del open_eps[sb]
            slot += 1
            wait = started + slot * slot_s - loop.time()
            if wait > 0:
                await asyncio.sleep(wait)
    finally:
        await producer.stop()
    return manifest


@dataclass
class Delivery:
    member: str
    key: Key
    at: float  # monotonic, when the member's loop received it
    complete: bool
    reason: str | None
    events: list[str]  # "<kind>:<event id>" in order


@dataclass
class Ack:
    member: str
    key: Key
    at: float  # monotonic, when ack() returned
    result: bool


@dataclass
class Journal:
    deliveries: list[Delivery] = field(default_factory=list)
    acks: list[Ack] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def delivered(self, member: str, ep: Episode) -> None:
        complete = getattr(ep, "complete", True)  # a client without the flag: taken as whole
        reason = getattr(ep, "fragment_reason", None)
        raw = [f"{e.kind}:{e.header['event_id']}" for e in ep.events]
        with self.lock:
            self.deliveries.append(Delivery(member, (ep.sandbox, ep.episode), time.monotonic(),
                                            bool(complete), reason, raw))

    def acked(self, member: str, ep: Episode, result: object) -> None:
        with self.lock:
            self.acks.append(Ack(member, (ep.sandbox, ep.episode), time.monotonic(),
                                 result is None or bool(result)))

    def acked_keys(self) -> Counter[Key]:
        with self.lock:
            return Counter(a.key for a in self.acks if a.result)


class Member:
    """One trainer of the group: async (:class:`ReplayClient`) or sync (a thread with
    :class:`SyncReplayClient`)."""

    def __init__(self, name: str, kind: str, settings: Settings, group: str, journal: Journal,
                 seed: int, commit_every_ms: float) -> None:
        self.name, self.kind = name, kind
        self.settings, self.group, self.journal = settings, group, journal
        self.rng = random.Random(seed)
        self.commit_every_ms = commit_every_ms
        self.leave = threading.Event()
        self.task: asyncio.Future[dict[str, int]] | None = None

    def start(self) -> None:
        if self.kind == "sync":
            self.task = asyncio.ensure_future(asyncio.to_thread(self._run_sync))
        else:
            self.task = asyncio.ensure_future(self._run_async())

    async def stop(self) -> dict[str, int]:
        self.leave.set()
        assert self.task is not None
        return await asyncio.wait_for(self.task, 120)

    def _train_s(self) -> float:
        return self.rng.uniform(0, 0.01)

    async def _run_async(self) -> dict[str, int]:
        client = ReplayClient(TASK, self.group, self.settings,
                              commit_every_ms=self.commit_every_ms)
        await client.start()
        try:
            while not self.leave.is_set():
                async for ep in client.episodes(idle_timeout=0.5):
                    self.journal.delivered(self.name, ep)
                    await asyncio.sleep(self._train_s())
                    self.journal.acked(self.name, ep, await client.ack(ep))
                    if self.leave.is_set():
                        break
        finally:
            await client.stop()
        return dict(client.stats)

    def _run_sync(self) -> dict[str, int]:
        with SyncReplayClient(TASK, self.group, self.settings,
                              commit_every_ms=self.commit_every_ms) as client:
            while not self.leave.is_set():
                for ep in client.episodes(idle_timeout=0.5):
                    self.journal.delivered(self.name, ep)
                    time.sleep(self._train_s())
                    self.journal.acked(self.name, ep, client.ack(ep))
                    if self.leave.is_set():
                        break
            return dict(client.stats)


def violations(manifest: dict[Key, list[str]], journal: Journal) -> dict[str, Any]:
    """What the run broke (empty lists: nothing) and what it did."""
    acked = journal.acked_keys()
    first_ack: dict[Key, float] = {}
    for a in sorted(journal.acks, key=lambda a: a.at):
        if a.result:
            first_ack.setdefault(a.key, a.at)
    never = sorted(k for k in manifest if acked[k] == 0)
    twice = sorted(k for k, n in acked.items() if n > 1)
    unknown = sorted(k for k in acked if k not in manifest)
    after_ack = sorted({d.key for d in journal.deliveries
                        if d.key in first_ack and d.at > first_ack[d.key]})
    wrong = sorted({d.key for d in journal.deliveries
                    if d.complete and d.events != manifest.get(d.key)})
    fragments = Counter(d.reason or "unmarked" for d in journal.deliveries if not d.complete)
    per_member = Counter(d.member for d in journal.deliveries)
    return {
        "episodes": len(manifest),
        "events": sum(len(v) for v in manifest.values()),
        "deliveries": len(journal.deliveries),
        "redeliveries": len(journal.deliveries) - len({d.key for d in journal.deliveries}),
        "acks_true": sum(acked.values()),
        "acks_false": sum(1 for a in journal.acks if not a.result),
        "marked_fragments": dict(fragments),
        "per_member": dict(per_member),
        "never_acknowledged": [f"{s}/{e}" for s, e in never][:20],
        "n_never_acknowledged": len(never),
        "acknowledged_twice": [f"{s}/{e}" for s, e in twice][:20],
        "n_acknowledged_twice": len(twice),
        "delivered_after_ack": [f"{s}/{e}" for s, e in after_ack][:20],
        "n_delivered_after_ack": len(after_ack),
        "complete_but_wrong": [f"{s}/{e}" for s, e in wrong][:20],
        "n_complete_but_wrong": len(wrong),
        "unknown": len(unknown),
    }


def failed(report: dict[str, Any]) -> list[str]:
    """The checks a report fails (empty: passed)."""
    return [name for name in ("n_never_acknowledged", "n_acknowledged_twice",
                              "n_delivered_after_ack", "n_complete_but_wrong", "unknown")
            if report[name]]


async def run_group(settings: Settings, *, members: int, seed: int, rate: int = 1500,
                    duration_s: float = 20.0, kind: str = "async", commit_every_ms: float = 0,
                    drain_timeout_s: float = 120.0) -> dict[str, Any]:
    """One run: up to ``members`` trainers join and leave at random moments while the producer
    writes for ``duration_s``; then one stays until the manifest is acknowledged."""
    rng = random.Random(seed)
    group = f"{settings.topics.prefix}-group"
    journal = Journal()
    live: list[Member] = []
    stats: list[dict[str, int]] = []
    events_log: list[str] = []
    made = 0
    loop = asyncio.get_running_loop()
    t0 = loop.time()

    def join() -> None:
        nonlocal made
        made += 1
        k = kind if kind != "mixed" else ("async", "sync")[made % 2]
        member = Member(f"m{made}-{k}", k, settings, group, journal, seed * 100 + made,
                        commit_every_ms)
        member.start()
        live.append(member)
        events_log.append(f"{loop.time() - t0:.1f}s join {member.name}")

    async def leave(member: Member) -> None:
        live.remove(member)
        events_log.append(f"{loop.time() - t0:.1f}s leave {member.name}")
        stats.append(await member.stop())

    await create_replay_topic(settings, TASK)
    join()
    produce_t0 = loop.time()
    producing = asyncio.ensure_future(produce_live(settings, rate, duration_s, seed))
    producing.add_done_callback(lambda _: produced_in.append(loop.time() - produce_t0))
    produced_in: list[float] = []
    leaving: list[asyncio.Future[None]] = []
    try:
        while not producing.done():
            await asyncio.wait([producing], timeout=rng.uniform(1.5, 5.0))
            if producing.done():
                break
            if len(live) < members and (len(live) <= 1 or rng.random() < 0.5):
                join()
            elif len(live) > 1:
                # leaving takes the member's stop(): not awaited here, the drill goes on
                leaving.append(asyncio.ensure_future(leave(rng.choice(live))))
        manifest = producing.result()
        if not live:
            join()
        deadline = loop.time() + drain_timeout_s
        while loop.time() < deadline:
            acked = journal.acked_keys()
            if all(acked[k] for k in manifest):
                break
            await asyncio.sleep(0.5)
        await asyncio.sleep(2)  # anything delivered again after the last ack shows up
    finally:
        for member in list(live):
            await leave(member)
        for f in leaving:
            await f
        if not producing.done():
            producing.cancel()
    report = violations(manifest, journal)
    report.update(events_per_s=round(report["events"] / produced_in[0]) if produced_in else 0,
                  members=members, kind=kind, rate=rate, seed=seed, duration_s=duration_s,
                  commit_every_ms=commit_every_ms, membership=events_log,
                  joins=made, elapsed_s=round(loop.time() - t0, 1),
                  client_stats={k: sum(s.get(k, 0) for s in stats)
                                for k in ("acks_after_partition_moved", "segments",
                                          "duplicates_dropped", "skipped_already_acked")
                                if any(k in s for s in stats)})
    return report


def summary(reports: list[dict[str, Any]], first: int = 1, head: bool = True) -> str:
    """A table of runs (numbered from ``first``)."""
    lines = ["run members kind commit_ms events/s joins episodes deliveries redeliv acks_true "
             "acks_false fragments never twice after_ack wrong result"] if head else []
    for i, r in enumerate(reports):
        lines.append(" ".join(str(x) for x in (
            i + first, r["members"], r["kind"], r["commit_every_ms"], r["events_per_s"],
            r["joins"], r["episodes"], r["deliveries"],
            r["redeliveries"], r["acks_true"], r["acks_false"],
            sum(r["marked_fragments"].values()), r["n_never_acknowledged"],
            r["n_acknowledged_twice"], r["n_delivered_after_ack"], r["n_complete_but_wrong"],
            "FAIL " + ",".join(failed(r)) if failed(r) else "ok")))
    return "\n".join(lines)

