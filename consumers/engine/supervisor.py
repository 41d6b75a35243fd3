"""A worker process: its processors side by side, kept running through broker restarts.

What it guarantees (docs/decisions/0012-worker-supervisor.md;
tests/kafka/test_worker_supervisor.py):

- **A broker restart does not stop a processor.** One that fails because the broker went away
  (a lost connection, a coordinator gone; aiokafka surfaces some of these as a fatal error of
  its transactional producer) is started again in this process, as a process supervisor would
  restart the worker: a fresh :class:`Runner`, rebuilt from its committed changelog and input
  offsets, so nothing is lost or repeated. At most ``RESTARTS_MAX`` restarts in
  ``RESTART_WINDOW_S`` per processor; a broker that stays away then stops the worker.
- **Any other failure stops the whole worker, promptly.** Every processor is told to stop; each
  has ``STOP_DEADLINE_S`` to settle its in-flight transaction and close its clients; the rest
  is cancelled and the first error raised. A worker is never left half-alive with one of its
  processors gone (a supervisor restarts an exited worker, not a hung one). The CLI adds a hard
  deadline on top (:func:`arm_hard_exit`) for a shutdown that hangs all the same.
"""

from __future__ import annotations

import asyncio
import contextlib
import faulthandler
import logging
import os
import sys
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from trajbus.bus.kafka import broker_went_away
from trajbus.bus.settings import Settings
from trajbus.consumers.engine import metrics
from trajbus.consumers.engine.runner import ProcessorSpec, Runner

log = logging.getLogger("trajbus.worker")

RESTARTS_MAX = 5
RESTART_WINDOW_S = 300.0
STOP_DEADLINE_S = 30.0  # for the other processors to stop after one failed
HARD_EXIT_AFTER_S = STOP_DEADLINE_S + 30.0  # the CLI's last resort (arm_hard_exit)

RunnerFactory = Callable[[Settings, ProcessorSpec, str], Runner]


class Worker:
    """Runs one :class:`Runner` per processor spec until stopped, idle, or failed."""

    def __init__(self, settings: Settings, specs: list[ProcessorSpec], worker_id: str, *,
                 runner_factory: RunnerFactory = Runner,
                 on_stop: Callable[[str], object] | None = None) -> None:
        self.settings = settings
        self.specs = specs
        self.worker_id = worker_id
        self.runner_factory = runner_factory
        self.on_stop = on_stop  # told once, with the reason, when the worker begins to stop
        self.current: dict[str, Runner] = {}
        self.processed: dict[str, int] = {spec.name: 0 for spec in specs}
        self.restarts: dict[str, int] = {spec.name: 0 for spec in specs}
        self._stop_reason: str | None = None

    def ready(self) -> tuple[bool, dict[str, Any]]:
        """For /readyz: every processor's runner connected, assigned and restored."""
        detail: dict[str, Any] = {}
        ok = self._stop_reason is None
        for spec in self.specs:
            runner = self.current.get(spec.name)
            if runner is None:
                detail[spec.name] = {"started": False}
                ok = False
                continue
            r_ok, r_detail = runner.ready()
            detail[spec.name] = {**r_detail, "restarts": self.restarts[spec.name]}
            ok = ok and r_ok
        return ok, {"worker_id": self.worker_id, "processors": detail,
                    **({"stopping": self._stop_reason} if self._stop_reason else {})}

    def stop(self, reason: str = "asked to stop") -> None:
        """Tell every processor to finish its batch, commit and stop (a signal's handler)."""
        if self._stop_reason is None:
            self._stop_reason = reason
            if self.on_stop is not None:
                self.on_stop(reason)
        for runner in self.current.values():
            runner.stopping.set()

    async def run(self, until_idle: float | None = None) -> dict[str, int]:
        """Run every processor; returns the records each processed. Raises the first
        failure that is not a broker going away (after the others stopped)."""
        tasks = [asyncio.create_task(self._keep_running(spec, until_idle), name=spec.name)
                 for spec in self.specs]
        try:
            done, pending = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
        except asyncio.CancelledError:
            for task in tasks:
                task.cancel()
            raise
        failed = [t for t in done if not t.cancelled() and t.exception() is not None]
        if not failed:
            return dict(self.processed)
        error = failed[0].exception()
        assert error is not None
        self.stop(f"processor {failed[0].get_name()} failed ({type(error).__name__}: {error})")
        if pending:
            _, late = await asyncio.wait(pending, timeout=STOP_DEADLINE_S)
            if late:
                log.warning("processors %s did not stop within %.0f s; cancelling them",
                            sorted(t.get_name() for t in late), STOP_DEADLINE_S)
                for task in late:
                    task.cancel()
                await asyncio.wait(late, timeout=5.0)
        # the others' failures are the same outage, logged by each ("stopped: ..."): seen here,
        # so none prints "Task exception was never retrieved" at exit
        for task in tasks:
            if task.done():
                _retrieve(task)
            else:
                task.add_done_callback(_retrieve)
        raise error

    async def _keep_running(self, spec: ProcessorSpec, until_idle: float | None) -> None:
        recent: deque[float] = deque()
        while True:
            runner = self.runner_factory(self.settings, spec, self.worker_id)
            self.current[spec.name] = runner
            if self._stop_reason is not None:
                return
            try:
                await runner.run(until_idle=until_idle, recovering=bool(recent))
                return
            except Exception as exc:
                now = time.monotonic()
                while recent and now - recent[0] > RESTART_WINDOW_S:
                    recent.popleft()
                # Start-up fails fast (a broker that never answered says what to set); only a
                # processor that was running, or already recovering, is started again.
                if (self._stop_reason is not None or not broker_went_away(exc)
                        or not (runner.started or recent) or len(recent) >= RESTARTS_MAX):
                    # the user sees one line (trajbus.cli); with -v the log keeps where it
                    # came from
                    log.info("%s stopped: %s: %s", spec.name, type(exc).__name__, exc,
                             exc_info=True)
                    raise
                # the normal way through a broker restart: a traceback only with --debug
                log.debug("%s lost the broker", spec.name, exc_info=True)
                recent.append(now)
                self.restarts[spec.name] += 1
                metrics.PROCESSOR_RESTARTS.labels(spec.name).inc()
                log.warning("%s lost the broker (%s: %s); restarting it from its committed "
                            "state (restart %d; at most %d in %.0f s)", spec.name,
                            type(exc).__name__, exc, len(recent), RESTARTS_MAX,
                            RESTART_WINDOW_S)
            finally:
                self.processed[spec.name] += runner.processed


def _retrieve(task: asyncio.Task[None]) -> None:
    if not task.cancelled():
        task.exception()


def _print_pending_tasks() -> None:
    """Every pending asyncio task's stack (on the loop's thread): what a stop waits for."""
    tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
    print(f"trajbus: the worker is still stopping; its {len(tasks)} pending asyncio tasks:",
          file=sys.stderr, flush=True)
    for task in tasks:
        task.print_stack(limit=20, file=sys.stderr)
    sys.stderr.flush()


def arm_hard_exit(reason: str, after_s: float = HARD_EXIT_AFTER_S) -> threading.Timer:
    """Exit the process (code 1) if it is still alive ``after_s`` from now, printing why and
    every thread's stack first (and, shortly before, every pending asyncio task's stack when
    called on the event loop). For a shutdown that hangs (a client's stop that never returns,
    a thread that does not end): a supervisor restarts an exited worker, never a hung one."""
    with contextlib.suppress(RuntimeError):  # not on a running loop: threads only
        asyncio.get_running_loop().call_later(max(0.0, after_s - 2.0), _print_pending_tasks)

    def hard_exit() -> None:
        print(f"trajbus: error: the worker did not stop within {after_s:g} s after it was "
              f"told to ({reason}); exiting now. Where each thread was:", file=sys.stderr,
              flush=True)
        faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
        sys.stderr.flush()
        os._exit(1)

    timer = threading.Timer(after_s, hard_exit)
    timer.daemon = True
    timer.start()
    return timer


__all__ = ["HARD_EXIT_AFTER_S", "RESTARTS_MAX", "RESTART_WINDOW_S", "STOP_DEADLINE_S",
           "Worker", "arm_hard_exit"]
