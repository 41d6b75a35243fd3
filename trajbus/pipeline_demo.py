"""The whole pipeline, end to end, for `trajbus demo` (and the end-to-end test).

fleet simulator -> Kafka -> worker process (reorder, watchdog, scheduler) -> replay topics ->
trainer (ReplayClient);  Kafka -> archiver -> Parquet (.trajbus/archive) -> DuckDB.

The summary is a check, not a report. It fails (non-zero) unless:

- every episode the trainer received equals the (seq, event id) pairs the emitters had
  acknowledged, in order, once;
- the replay topics themselves (read raw, before any client-side deduplication) hold every
  acknowledged event exactly once, and carry gap markers only where an acknowledged seq is
  really missing (a crash);
- the watchdog alerted on exactly the episodes the simulator made loop;
- every sandbox's lifecycle completed: a DRAIN (or the TERMINATE that starts a looping
  sandbox's drain) and then one RECYCLE decision each (RECYCLE_WITH_LOSS only for a sandbox
  the simulator crashed on purpose, or where the log shows injected faults held downstream's
  confirmation back past the drain grace window: see :func:`_unexplained_loss`);
- there are no dead letters and no ANOMALY decisions (the simulated fleet is clean: the faults
  it plants -- crashes, migrations, re-sent duplicates, out-of-order delivery -- must all be
  absorbed);
- the archive holds every acknowledged event (episodes and sandbox-level streams) once.

:func:`run_pipeline` uses the settings it is given (topic prefix, archive location): callers
isolate runs by giving each its own prefix (``trajbus demo`` does, per run). ``faults`` adds
what the soak (``make soak``) needs: the worker SIGKILLed and restarted mid-run, the broker
restarted mid-run.

Rooms: this module runs the pipeline (:func:`run_pipeline`); :mod:`trajbus.pipeline_view`
holds what the rooms share (:class:`View`, :class:`Faults`); :mod:`trajbus.pipeline_workers`
the worker process, its supervision and the injected faults; :mod:`trajbus.pipeline_observe`
the readers during the run; :mod:`trajbus.pipeline_collect` what is read after it (the replay
topics raw, the archive, the waterfall); :mod:`trajbus.pipeline_check` the check and the
summary. Their names import from here too (the former private names as aliases).
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
from pathlib import Path

from trajbus.bus.settings import Settings
from trajbus.bus.topics import Topics
from trajbus.pipeline_check import expects_gap, never_reached, summary, unexplained_loss
from trajbus.pipeline_collect import (
    ReplayTopics,
    archive_run,
    context_on_topics,
    replay_topics,
    unstable_partitions,
    waterfall_report,
)
from trajbus.pipeline_observe import live, note_reader_failures, trainer, watch
from trajbus.pipeline_view import TASKS, Faults, View, say
from trajbus.pipeline_workers import _LOG_OFFSETS as _LOG_OFFSETS
from trajbus.pipeline_workers import inject, start_worker, supervise

__all__ = ["TASKS", "Faults", "ReplayTopics", "View", "run_pipeline"]

# the rooms' functions under their former names here
_say, _start_worker, _supervise, _inject = say, start_worker, supervise, inject
_trainer, _watch, _live, _note_reader_failures = trainer, watch, live, note_reader_failures
_replay_topics, _unstable_partitions, _archive = replay_topics, unstable_partitions, archive_run
_context_on_topics, _waterfall = context_on_topics, waterfall_report
_never_reached, _expects_gap, _unexplained_loss = never_reached, expects_gap, unexplained_loss
_summary = summary


async def run_pipeline(settings: Settings, sandboxes: int, episodes: int, seed: int, *,
                       work_root: Path = Path(".trajbus/demo"),
                       settle_timeout_s: float = 90, faults: Faults | None = None,
                       run_id: str | None = None) -> int:
    """Run the pipeline once and check it (module docstring). Returns 0 when every check
    passed. Its files (the emitters' journals, the manifest, the worker's log) go to
    ``work_root/<run_id>`` (default: the seed): a run must not find another run's journals,
    so callers that repeat a seed give each run its own ``run_id``."""
    from trajbus.bus.admin import ensure_base_topics, register_schemas
    from trajbus.bus.producer import close_producer
    from trajbus.producers.simulator import simulate

    work = work_root / (run_id or str(seed))
    work.mkdir(parents=True, exist_ok=True)
    topics = Topics(settings)
    await ensure_base_topics(settings, TASKS)
    await register_schemas(settings)
    _say(f"seed {seed}: {sandboxes} sandboxes x {episodes} episodes over tasks "
         f"{', '.join(TASKS)}; work dir {work}")

    worker_log = work / "worker.log"
    workers = [_start_worker(settings, worker_log)]
    _say(f"worker process pid {workers[0].pid} (reorder, watchdog, scheduler); log {worker_log}")
    view = View()
    started = time.monotonic()
    stop = asyncio.Event()
    watchers = [
        asyncio.create_task(_trainer(settings, seed, view, started, stop)),
        asyncio.create_task(_watch(settings, [topics.alerts, topics.decisions,
                                              topics.deadletter], view, stop)),
    ]
    live = asyncio.create_task(_live(view, started, stop))
    chaos = asyncio.create_task(_inject(settings, faults, workers, worker_log)) \
        if faults is not None else None
    supervisor = asyncio.create_task(_supervise(settings, faults, workers, worker_log, stop)) \
        if faults is not None else None
    try:
        manifest = await simulate(
            settings, sandboxes=sandboxes, episodes=episodes, seed=seed,
            manifest_path=work / "manifest.json", state_root=work / "sandboxes",
            start_ms=int(time.time() * 1000), shuffle_window=4, tasks=TASKS,
            node_report_every_s=0.5,
        )
        await close_producer()
        expected = {(e.task, e.sandbox, e.episode): e for e in manifest.episodes}
        _say(f"fleet done: {manifest.events_acked} events acknowledged, "
             f"{manifest.duplicates_sent} duplicates re-sent, {len(manifest.loops)} looping "
             f"episodes planted")
        # The trainer has everything when every acknowledged episode arrived (recycled
        # sandboxes' unfinished episodes arrive truncated after the recycle grace).
        if chaos is not None:
            await chaos  # every planned fault happened before the run is judged
        sandbox_ids = {e.sandbox for e in manifest.episodes} | set(manifest.sandbox_streams)
        deadline = time.monotonic() + settle_timeout_s
        while time.monotonic() < deadline:
            if all((s, ep) in view.episodes for (_, s, ep) in expected) and \
                    len(view.loop_alerts) >= len(manifest.loops) and \
                    all(_recycled(view.by_sandbox.get(sb, [])) for sb in sandbox_ids):
                break
            if any(t.done() for t in watchers):
                break  # a reader stopped: what it missed is judged (and why, said) below
            await asyncio.sleep(0.5)
    finally:
        stop.set()
        _note_reader_failures(view, watchers)
        extra = [t for t in (chaos, supervisor) if t is not None]
        for t in [*watchers, live, *extra]:
            t.cancel()
        await asyncio.gather(*watchers, live, *extra, return_exceptions=True)
        for worker in workers:
            worker.terminate()
            try:
                worker.wait(timeout=30)
            except subprocess.TimeoutExpired:
                worker.kill()
    print(file=sys.stderr)

    replay = await _replay_topics(settings)
    archive_summary = await _archive(settings)
    waterfall = await _waterfall(settings, view, work)
    return _summary(expected, manifest, view, replay, archive_summary, waterfall,
                    time.monotonic() - started, faults,
                    drain_window_s=settings.scheduler.drain_grace_ms / 1000)


def _recycled(decisions: list[str]) -> bool:
    return "RECYCLE" in decisions or "RECYCLE_WITH_LOSS" in decisions

