"""CLI: `trajbus worker` (run processors) and `trajbus replay tail` (watch a replay topic)."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import sys
import textwrap
from collections.abc import Callable
from typing import Any

from trajbus.bus.cliargs import Commands, add_actions, add_command, add_flags
from trajbus.bus.settings import Settings, get_settings

PROCESSORS = ("reorder", "watchdog", "scheduler")


def _paragraphs(*paragraphs: str) -> str:
    return "\n\n".join(textwrap.fill(p, 88) for p in paragraphs)


def register(sub: argparse._SubParsersAction) -> None:
    w = sub.add_parser(
        "worker",
        help="run stream processors (reorder, watchdog, scheduler)",
        description=_paragraphs(
            "Run one or several processors as Kafka consumer-group members. Each consumes its "
            "inputs, feeds a pure core and commits outputs, state changelog and offsets in one "
            "Kafka transaction, so a killed worker resumes with nothing lost and nothing "
            "duplicated.",
            "Start several workers with distinct --worker-id values to share partitions (the "
            "scheduler is global: one worker, the smallest --worker-id, runs it and the others "
            "stand by to take it over).",
            "A broker restart is ridden out: a processor that loses the broker is rebuilt in "
            "the process from its committed state. Any other failure stops the worker with "
            "exit code 1 (within 60 s at most, even if something hangs), for its supervisor to "
            "restart it. Without a broker at start-up it fails fast, saying what to set."),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    w.add_argument("--processors", default=",".join(PROCESSORS),
                   help=f"comma-separated subset of {', '.join(PROCESSORS)} (default: all)")
    w.add_argument("--worker-id", default=os.environ.get("TRAJBUS_WORKER_ID", "w0"),
                   help="stable id of this worker; also its transactional id suffix, so a "
                   "restarted worker fences its previous incarnation (default w0)")
    w.add_argument("--until-idle", type=float, default=None, metavar="SECONDS",
                   help="exit after no input for this long (for batch runs and tests)")
    from trajbus.bus.ops import add_ops_arguments

    add_ops_arguments(w)
    w.add_argument("-v", "--verbose", action="store_true", help="log progress")
    # Removed option, kept only to explain itself to scripts that still pass it.
    w.add_argument("--engine", default=None, help=argparse.SUPPRESS)
    w.set_defaults(func=_worker)

    r = add_command(sub, "replay", help="trainer-side replay: tail a task's replay topic",
                    description="Commands for ordered episode replay.")
    rsub = add_actions(r, "replay_command")
    t = add_command(rsub, "tail", _replay_tail,
                    help="print replay segments of a task as they arrive",
                    examples=("trajbus replay tail --task web-shop",
                              "trajbus replay tail --all-tasks --from -10m --idle-exit 30",
                              "trajbus replay tail --task web-shop --group trainer-7 --from end"))
    which = t.add_mutually_exclusive_group(required=True)
    which.add_argument("--task", action="append", default=[],
                       help="task to follow (repeatable)")
    which.add_argument("--all-tasks", action="store_true",
                       help="every task's replay topic, including ones created later (not "
                       "the debug-* republish topics)")
    t.add_argument("--group", default=None,
                   help="consumer group (default: a fresh one, reading from the beginning)")
    t.add_argument("--from", dest="start", default=None, metavar="POSITION",
                   help="where to start: beginning, end, resume (the group's committed "
                   "offsets), or a time (ISO-8601, epoch ms, -1h); default: resume with "
                   "--group, else beginning")
    add_flags(t, json="one JSON object per segment")
    t.add_argument("--idle-exit", type=float, default=None, metavar="SECONDS",
                   help="exit after no data for this long (exit 1 if a named task's replay "
                   "topic never appeared)")
    register_replay_more(rsub)


def register_replay_more(rsub: Commands) -> None:
    """Operators' replay subcommands: events, explain, republish, waterfall."""
    try:
        from trajbus.consumers.operator import cli as operator_cli
    except ModuleNotFoundError as exc:
        if exc.name != "trajbus.consumers.operator.cli":
            raise
        return
    operator_cli.register_replay(rsub)


def build_specs(settings: Settings, names: list[str]) -> list[Any]:
    from trajbus.consumers.engine import processors

    specs = []
    for name in names:
        factory = getattr(processors, f"{name}_spec", None)
        if factory is None:
            raise ValueError(f"unknown processor {name!r}; choose from {', '.join(PROCESSORS)}")
        specs.append(factory(settings))
    return specs


async def run_workers(settings: Settings, names: list[str], worker_id: str,
                      until_idle: float | None = None, *,
                      on_stop: Callable[[str], object] | None = None,
                      ops: Any = None) -> dict[str, int]:
    """Run the named processors in this process until a signal, ``until_idle`` or a failure
    (:class:`~trajbus.consumers.engine.supervisor.Worker` says what survives what)."""
    from trajbus.consumers.engine.supervisor import Worker

    worker = Worker(settings, build_specs(settings, names), worker_id, on_stop=on_stop)
    if ops is not None:  # bus.ops.OpsServer: /readyz asks the worker, /healthz the loop
        ops.ready = worker.ready
        ops.attach()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        try:
            loop.add_signal_handler(sig, worker.stop, f"signal {sig.name}")
        except (NotImplementedError, RuntimeError):  # not the main thread
            pass
    return await worker.run(until_idle=until_idle)


def _worker(args: argparse.Namespace) -> int:
    from trajbus.bus.ops import start_ops

    settings = get_settings()
    ops = start_ops(args, settings)
    if args.engine not in (None, "aiokafka"):
        print(f"error: --engine {args.engine} is no longer available: the faust engine was "
              "removed because it could lose events after a SIGKILL (README, 'Design'). "
              "Drop the option; the transactional worker is the only engine.", file=sys.stderr)
        return 2
    names = [n.strip() for n in args.processors.split(",") if n.strip()]
    from trajbus.consumers.engine.supervisor import arm_hard_exit

    # Once the worker begins to stop (a signal, a failed processor), it must be gone within a
    # deadline, so that its supervisor can start it again (engine/supervisor.py).
    counts = asyncio.run(run_workers(settings, names, args.worker_id, args.until_idle,
                                     on_stop=lambda reason: arm_hard_exit(reason), ops=ops))
    print(json.dumps({"processed": counts}), file=sys.stderr)
    return 0


def _replay_tail(args: argparse.Namespace) -> int:
    """Subscribe to trajbus.replay.TASK like a trainer would (the ReplayClient: ordered,
    deduplicated, committed after acknowledgement) and print each segment. A task whose replay
    topic does not exist yet is waited for (said once on stderr), so tail can start before the
    fleet."""
    import uuid

    from trajbus.bus.errors import existing
    from trajbus.bus.inventory import list_tasks
    from trajbus.consumers.replay.client import ALL_TASKS, ReplayClient

    group = args.group or f"trajbus-tail-{uuid.uuid4().hex[:8]}"
    tasks = [*args.task, *([ALL_TASKS] if args.all_tasks else [])]
    start = args.start or ("resume" if args.group else "earliest")
    settings = get_settings()

    async def run() -> list[str]:
        async with ReplayClient(tasks, group, settings, start=start) as client:
            missing = await client.missing_tasks()
            if missing:
                print(f"waiting for the replay topic of task(s) {', '.join(missing)} "
                      f"({existing('tasks', await list_tasks(settings))})", file=sys.stderr,
                      flush=True)
            async for seg in client.segments(idle_timeout=args.idle_exit):
                if args.json:
                    print(json.dumps({
                        "task": seg.task, "sandbox": seg.sandbox, "episode": seg.episode,
                        "segment": seg.index, "first_seq": seg.first_seq,
                        "last_seq": seg.last_seq, "events": [e.kind for e in seg.events],
                        "gap": seg.gap, "is_last": seg.is_last, "is_terminal": seg.is_terminal,
                    }), flush=True)
                else:
                    flags = " ".join(f for f, on in (("FIRST", seg.is_first),
                                                     ("LAST", seg.is_last),
                                                     ("TRUNCATED", seg.truncated)) if on)
                    gap = f" gap={seg.gap[0]}..{seg.gap[1]}" if seg.gap else ""
                    print(f"{seg.task} {seg.sandbox}/{seg.episode} #{seg.index} "
                          f"seq {seg.first_seq}..{seg.last_seq} ({len(seg.events)} events)"
                          f"{gap} {flags}".rstrip(), flush=True)
                await client.ack(seg)
            return await client.missing_tasks()

    still_missing = asyncio.run(run())
    if still_missing:
        tasks_now = asyncio.run(list_tasks(settings))
        print(f"trajbus: error: no replay topic for task(s) {', '.join(still_missing)} "
              f"appeared within {args.idle_exit:g} s; {existing('tasks', tasks_now)}",
              file=sys.stderr)
        return 1
    return 0
