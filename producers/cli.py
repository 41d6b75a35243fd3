"""Producer-side commands, wired into ``trajbus`` by ``trajbus/cli.py`` via :func:`register`:

- ``trajbus tail-traces DIR --sandbox ID --task T [--once] [--poll-ms MS]``
- ``trajbus simulate [--sandboxes N] [--episodes M] [--seed S] [--manifest PATH] ...``
  (closed loop: each sandbox waits for the scheduler's placement; ``--no-wait-for-placement``
  starts them all at once without a scheduler)
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import sys
from typing import Any

from trajbus.bus.producer import close_producer
from trajbus.bus.settings import get_settings


def register(subparsers: Any) -> None:
    """Add the producer commands to an ``argparse`` subparsers object."""
    p = subparsers.add_parser("tail-traces", help="publish a sandbox's trace directory to Kafka")
    p.add_argument("dir", help="trace directory, e.g. /dev/shm/<runtime>-trace")
    p.add_argument("--sandbox", required=True, help="the sandbox whose traces these are")
    p.add_argument("--task", required=True, help="the sandbox's task")
    p.add_argument("--once", action="store_true", help="one pass, then drain and exit")
    p.add_argument("--poll-ms", type=int, default=200,
                   help="how often to look for new trace bytes, in ms (default 200)")
    p.add_argument("--chunk-size", type=int, default=None,
                   help="bytes per TraceChunk event (default: TRAJBUS_PRODUCER__CHUNK_SIZE)")
    p.add_argument("--state-dir", default=None,
                   help="emitter state (journal); default <settings.state_dir>/<sandbox>")
    p.set_defaults(func=_tail_traces)

    s = subparsers.add_parser("simulate", help="drive a simulated sandbox fleet (workload)")
    s.add_argument("--sandboxes", type=int, default=10,
                   help="simulated sandboxes (default 10)")
    s.add_argument("--episodes", type=int, default=3, help="episodes per sandbox (default 3)")
    s.add_argument("--seed", type=int, default=0,
                   help="random seed: the same seed gives the same fleet (default 0)")
    s.add_argument("--manifest", default=None, help="write the acknowledged-events manifest here")
    s.add_argument("--state-root", default=None,
                   help="directory for the emitters' journals "
                   "(default: <TRAJBUS_STATE_DIR>/sim-SEED)")
    s.add_argument("--create-topics", action="store_true", help="create missing topics first")
    for knob, default, what in (
            ("loop", 0.1, "episodes whose agent repeats one call"),
            ("cycle", 0.05, "episodes whose agent repeats a cycle of calls"),
            ("nonloop", 0.05, "look-alike episodes whose results keep changing (no loop)"),
            ("crash", 0.05, "sandboxes that crash mid-episode"),
            ("migrate", 0.1, "sandboxes that migrate to another node"),
            ("duplicate", 0.02, "events sent twice"),
            ("blob", 0.02, "trace chunks large enough for a claim-check blob")):
        s.add_argument(f"--{knob}", type=float, default=default,
                       help=f"fraction of {what} (default {default})")
    s.add_argument("--shuffle-window", type=int, default=0,
                   help="deliver events out of order within windows of this many events "
                   "(default 0: in order)")
    s.add_argument("--no-wait-for-placement", dest="wait_for_placement", action="store_false",
                   help="start every sandbox at once instead of waiting for the scheduler's "
                        "placement (closed loop, the default, needs a running scheduler)")
    s.set_defaults(func=_simulate)


def _tail_traces(args: argparse.Namespace) -> int:
    from trajbus.producers.emitter import SandboxEmitter
    from trajbus.producers.tailer import TraceTailer

    async def main() -> int:
        settings = get_settings()
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            with contextlib.suppress(NotImplementedError):
                loop.add_signal_handler(sig, stop.set)
        em = SandboxEmitter(args.sandbox, args.task, settings=settings, env=dict(os.environ),
                            state_dir=args.state_dir)
        await em.start()
        try:
            tailer = TraceTailer(em, args.dir, chunk_size=args.chunk_size, poll_ms=args.poll_ms)
            await tailer.run(once=args.once, stop=stop)
            report = await em.drain()
            print(json.dumps({"bytes": tailer.bytes_sent, "resets": tailer.resets,
                              "complete": report.complete,
                              "unflushed": report.unflushed_count}))
            return 0 if report.complete else 1
        finally:
            await em.close()
            await close_producer()

    return asyncio.run(main())


def _simulate(args: argparse.Namespace) -> int:
    from trajbus.bus.admin import ensure_base_topics
    from trajbus.producers.simulator import simulate

    async def main() -> int:
        settings = get_settings()
        try:
            if args.create_topics:
                await ensure_base_topics(settings)
            m = await simulate(
                settings, args.sandboxes, args.episodes, args.seed,
                manifest_path=args.manifest, state_root=args.state_root, loop=args.loop,
                cycle=args.cycle, nonloop=args.nonloop, crash=args.crash, migrate=args.migrate,
                duplicate=args.duplicate, blob=args.blob, shuffle_window=args.shuffle_window,
                wait_for_placement=args.wait_for_placement)
        finally:
            await close_producer()
        print(json.dumps({"episodes": len(m.episodes), "events_acked": m.events_acked,
                          "loops": len(m.loops), "duplicates_sent": m.duplicates_sent,
                          "blobs": m.blobs, "manifest": args.manifest}))
        return 0

    return asyncio.run(main())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="trajbus-producers")
    register(parser.add_subparsers(dest="cmd", required=True))
    args = parser.parse_args(argv)
    rc: int = args.func(args)
    return rc


if __name__ == "__main__":
    sys.exit(main())
