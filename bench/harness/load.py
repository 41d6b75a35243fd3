"""The end-to-end bench's load: ``--sandboxes`` SandboxEmitters (journal, fsync group commit,
the shared idempotent producer) emitting episodes of tool call/result pairs at an offered
rate (``produce``, run as ``bench_e2e.py --produce`` in a process of its own)."""

from __future__ import annotations

import argparse
import asyncio
import shutil
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from harness.trainer import now_ms

if TYPE_CHECKING:
    from trajbus.bus.settings import Settings


def settings_for(bootstrap: str, prefix: str, partitions: int) -> Settings:
    """Settings of a run's topic prefix (backpressure, not QueueFullError, at the max rate)."""
    from trajbus.bus.settings import (
        KafkaSettings,
        ProducerSideSettings,
        Settings,
        TopicSettings,
    )

    # queue_full_timeout_s: backpressure at the max rate, not QueueFullError on a loaded box
    return Settings(kafka=KafkaSettings(bootstrap_servers=bootstrap),
                    topics=TopicSettings(prefix=prefix, partitions=partitions),
                    producer=ProducerSideSettings(queue_full_timeout_s=300.0))


async def produce(args: argparse.Namespace) -> dict[str, Any]:
    """Emit ``--events`` events over ``--sandboxes`` emitters at ``--rate`` events/s (0 = as
    fast as possible), episodes of ``--steps`` tool call/result pairs. Prints JSON."""
    from trajbus.bus.producer import close_producer
    from trajbus.producers.emitter import SandboxEmitter

    settings = settings_for(args.bootstrap, args.prefix, args.partitions)
    state = Path(tempfile.mkdtemp(prefix="bench-e2e-prod-"))
    ems = [SandboxEmitter(f"{args.phase}-sb{i:04d}", args.task, settings=settings,
                          state_dir=state / str(i), durability=args.durability)
           for i in range(args.sandboxes)]
    for em in ems:
        await em.start()
    # per sandbox: (current episode, steps done, episode counter)
    cur: list[list[Any]] = [[None, 0, 0] for _ in ems]
    args_obj = {"cmd": "pytest -x tests/test_parser.py", "cwd": "/work/repo", "timeout": 60}
    result_obj = {"stdout": "3 passed in 0.41s", "rc": 0}
    rate = args.rate
    n = 0
    cpu0 = time.process_time()
    t_first = now_ms()
    t0 = time.perf_counter()
    i = 0
    while n < args.events:
        if rate > 0:  # paced: event n is due at t0 + n / rate
            ahead = t0 + n / rate - time.perf_counter()
            if ahead > 0.001:
                await asyncio.sleep(ahead)
        k = i % len(ems)
        i += 1
        em, st = ems[k], cur[k]
        if st[0] is None:
            st[0] = f"{args.phase}-ep{k}-{st[2]}"
            st[1] = 0
            st[2] += 1
            await em.start_episode(st[0])
        elif st[1] >= 2 * args.steps:
            await em.end_episode(st[0])
            st[0] = None
        elif st[1] % 2 == 0:
            await em.tool_call(st[0], "shell", args_obj, call_id=f"c{st[1]}")
            st[1] += 1
        else:
            await em.tool_result(st[0], f"c{st[1] - 1}", "shell", result_obj, duration_ms=410)
            st[1] += 1
        n += 1
    t_last_emit = now_ms()
    for k, (em, st) in enumerate(zip(ems, cur, strict=True)):  # close open episodes
        if st[0] is not None:
            await em.end_episode(st[0])
            n += 1
            cur[k][0] = None
    acked = all([await em.flush(120) for em in ems])
    t_acked = now_ms()
    cpu = time.process_time() - cpu0
    for em in ems:
        await em.close(30)
    await close_producer()
    shutil.rmtree(state, ignore_errors=True)
    return {"events": n, "t_first_emit_ms": t_first, "t_last_emit_ms": t_last_emit,
            "t_all_acked_ms": t_acked, "all_acked": acked, "cpu_s": round(cpu, 3),
            "emit_events_per_s": round(n / max(1e-9, (t_last_emit - t_first) / 1000)),
            "events_per_cpu_s": round(n / max(cpu, 1e-9))}
