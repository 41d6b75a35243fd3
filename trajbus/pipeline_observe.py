"""The demo's readers while the fleet runs: :func:`trainer` reads the ordered replay with
:class:`~trajbus.consumers.replay.client.ReplayClient` as a trainer would, :func:`watch`
reads the alerts, decisions and dead letters, :func:`live` prints a status line; all fill in
the run's :class:`~trajbus.pipeline_view.View`.

Guarantee: a reader that stops before the run stopped it is reported with its error
(:func:`note_reader_failures`), never a silent cause of a missing episode.
"""

from __future__ import annotations

import asyncio
import sys
import time

from trajbus.bus.clients import new_consumer
from trajbus.bus.closing import close_client
from trajbus.bus.settings import Settings
from trajbus.pipeline_view import TASKS, View
from trajbus.schemas.codec import DecodeError, default_codec


def note_reader_failures(view: View, readers: list[asyncio.Task[None]]) -> None:
    """A reader (the trainer, the watcher) that ended before the run stopped it is a problem
    of the run, with its error: never a silent reason for "never reached the trainer"."""
    for name, task in zip(("trainer", "watcher"), readers, strict=True):
        if not task.done() or task.cancelled():
            continue
        exc = task.exception()
        why = "ended early" if exc is None else f"failed: {type(exc).__name__}: {exc}"
        view.reader_failures.append(f"the {name}'s consumer {why}")


async def trainer(settings: Settings, seed: int, view: View, started: float,
                   stop: asyncio.Event) -> None:
    from trajbus.consumers.replay.client import ReplayClient

    async with ReplayClient(TASKS, f"demo-trainer-{seed}", settings) as client:
        prefix = f"sb-{seed}-"
        async for seg in client.segments():
            key = (seg.sandbox, seg.episode)
            if seg.sandbox.startswith(prefix):
                if view.first_segment_s is None:
                    view.first_segment_s = time.monotonic() - started
                events = view.open.setdefault(key, [])
                for ev in seg.events:
                    h = ev.record["header"]
                    events.append((h["seq"], h["event_id"]))
                    view.kinds[ev.kind] += 1
                if seg.gap:
                    view.gappy.add(key)
                if seg.is_last:
                    view.episodes[key] = view.open.pop(key)
                    if not seg.is_terminal:
                        view.truncated.add(key)
                    elif view.sample is None and len(events) > 8:
                        view.sample = key
            await client.ack(seg)
            if stop.is_set():
                return


async def watch(settings: Settings, topics: list[str], view: View, stop: asyncio.Event) -> None:
    codec = default_codec()
    # From the beginning: the run has topics of its own ("latest" would miss what the worker
    # wrote before this consumer was assigned its partitions).
    consumer = new_consumer(settings.kafka, *topics,
                            auto_offset_reset="earliest", isolation_level="read_committed",
                            enable_auto_commit=False, group_id=None)
    await consumer.start()
    try:
        while not stop.is_set():
            batch = await consumer.getmany(timeout_ms=300)
            for msgs in batch.values():
                for msg in msgs:
                    try:
                        d = codec.decode(msg.value)
                    except DecodeError:
                        continue
                    r = d.record
                    if d.kind == "WatchdogAlert":
                        view.alerts[r["alert"]] += 1
                        if r["alert"] == "LOOP":
                            view.loop_alerts.add((r["header"]["sandbox"], r["header"]["episode"]))
                    elif d.kind == "SchedulingDecision":
                        decision, sb = str(r["decision"]), r["header"]["sandbox"]
                        view.decisions[decision] += 1
                        view.by_sandbox.setdefault(sb, []).append(decision)
                        if decision == "RECYCLE_WITH_LOSS":
                            view.loss_details[sb] = dict(r["details"])
                        if decision == "ANOMALY":
                            view.anomalies.append(f"{sb}: {r['reason']}")
                    elif d.kind == "DeadLetter":
                        view.dead_letters[f"{r['stage']}:{r['reason_code']}"] += 1
                        if len(view.dead_letter_examples) < 5:
                            view.dead_letter_examples.append(
                                f"{r['stage']}:{r['reason_code']} {r['header']['sandbox']}/"
                                f"{r['header']['episode']}: {r['reason'][:160]}")
    finally:
        await close_client(consumer, "demo consumer")


async def live(view: View, started: float, stop: asyncio.Event) -> None:
    while not stop.is_set():
        await asyncio.sleep(1)
        decisions = " ".join(f"{k.lower()}={v}" for k, v in sorted(view.decisions.items()))
        line = (f"\r[demo] {time.monotonic() - started:5.1f}s  trainer: "
                f"{len(view.episodes)} episodes, {sum(view.kinds.values())} events | "
                f"alerts: {sum(view.alerts.values())} | decisions: {decisions or '-'} | "
                f"dead letters: {sum(view.dead_letters.values())}")
        print(line[:160].ljust(160), end="", file=sys.stderr, flush=True)

