"""The demo's worker process, run as a deployment would: :func:`start_worker` starts
``trajbus worker`` (reorder, watchdog, scheduler) on the run's topics, appending to one log;
:func:`supervise` restarts a worker that exited at start-up because the broker (or nodes of
the cluster) were down and records any other exit as unexpected; :func:`inject` carries out
the planned faults (SIGKILL the worker, restart the broker) in time order.

Guarantee: every fault injected and every restart is recorded in :attr:`Faults.log`, and
every unexplained worker exit in :attr:`Faults.unexpected_exits`, so the check can judge them.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from pathlib import Path

from trajbus.bus.settings import Settings
from trajbus.pipeline_view import Faults, say


async def supervise(settings: Settings, faults: Faults,
                     workers: list[subprocess.Popen[bytes]], worker_log: Path,
                     stop: asyncio.Event) -> None:
    """Restart the worker after it exited at start-up because the broker was down or nodes of
    the cluster were (what a process supervisor does); record any other exit as unexpected
    (the run then fails)."""
    t0 = time.monotonic()
    while not stop.is_set():
        await asyncio.sleep(0.5)
        current = workers[-1]
        code = current.poll()
        if code is None or code == -9:  # running, or the SIGKILL that _inject is handling
            continue
        with open(worker_log, "rb") as log_file:  # what this worker wrote
            log_file.seek(_LOG_OFFSETS.get(current.pid, 0))
            tail = log_file.read().decode(errors="replace")[-8000:].strip()
        # the worker's one-line error (asyncio's shutdown warnings can follow it)
        errors = [line for line in tail.splitlines() if line.startswith("trajbus: error:")]
        # fail-fast messages at start-up: the broker is down, or nodes of the cluster are (its
        # topics cannot get their replicas; the worker waits a minute for them, then exits)
        why = ("broker down" if errors and "did not answer" in errors[-1] else
               "cluster short of brokers" if errors and " live broker" in errors[-1] else None)
        if why is not None:
            await asyncio.sleep(1.0)
            workers.append(start_worker(settings, worker_log))
            faults.log.append(f"{time.monotonic() - t0:.1f}s: worker pid {current.pid} exited "
                              f"at start-up ({why}), restarted as pid {workers[-1].pid}")
            say(faults.log[-1])
        else:
            faults.unexpected_exits.append(f"worker pid {current.pid} exited with code "
                                           f"{code}: {tail.strip()[-300:]}")
            return


async def inject(settings: Settings, faults: Faults, workers: list[subprocess.Popen[bytes]],
                  worker_log: Path) -> None:
    """Inject the planned faults, in time order, while the fleet runs."""
    t0 = time.monotonic()
    plan: list[tuple[float, str]] = []
    if faults.kill_worker_after_s is not None:
        plan.append((faults.kill_worker_after_s, "kill-worker"))
    if faults.restart_broker_after_s is not None and faults.restart_broker is not None:
        plan.append((faults.restart_broker_after_s, "restart-broker"))
    for at, what in sorted(plan):
        await asyncio.sleep(max(0.0, t0 + at - time.monotonic()))
        if what == "kill-worker":
            old = workers[-1]
            old.kill()
            await asyncio.to_thread(old.wait, 10)
            workers.append(start_worker(settings, worker_log))
            faults.log.append(f"{time.monotonic() - t0:.1f}s: worker pid {old.pid} SIGKILLed, "
                              f"restarted as pid {workers[-1].pid}")
        else:
            assert faults.restart_broker is not None
            began = time.monotonic()
            did = await faults.restart_broker()
            faults.longest_outage_s = max(faults.longest_outage_s, time.monotonic() - began)
            faults.log.append(f"{began - t0:.1f}s: {did or 'broker restarted'} (took "
                              f"{time.monotonic() - began:.1f}s)")
        say(faults.log[-1])


def start_worker(settings: Settings, log_path: Path) -> subprocess.Popen[bytes]:
    env = dict(os.environ)
    env["TRAJBUS_KAFKA__BOOTSTRAP_SERVERS"] = settings.kafka.bootstrap_servers
    env["TRAJBUS_TOPICS__PREFIX"] = settings.topics.prefix
    env["TRAJBUS_TOPICS__PARTITIONS"] = str(settings.topics.partitions)
    # the worker creates topics too (replay, state changelogs, ticks): as replicated as the
    # run's (an unreplicated changelog on a cluster stalled the worker until its node returned)
    env["TRAJBUS_TOPICS__REPLICATION_FACTOR"] = str(settings.topics.replication_factor)
    if settings.topics.min_insync_replicas is not None:
        env["TRAJBUS_TOPICS__MIN_INSYNC_REPLICAS"] = str(settings.topics.min_insync_replicas)
    out = open(log_path, "ab")
    offset = out.seek(0, os.SEEK_END)
    proc = subprocess.Popen(
        [sys.executable, "-m", "trajbus", "worker", "--worker-id", "demo", "-v"],
        env=env, stdout=out, stderr=out)
    _LOG_OFFSETS[proc.pid] = offset
    return proc


# where each worker's output begins in the shared log (the supervisor reads only its own)
_LOG_OFFSETS: dict[int, int] = {}
