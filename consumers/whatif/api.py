"""``whatif(log_source, rules) -> Diff``: the library entry point (for notebooks and tools).

Two runs over the same recorded log -- one with the recorded rules (the settings as
configured), one with the changed rules -- then the self-check of the first against what was
recorded, and the diff of the second against the first.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from typing import Any

from trajbus.bus.settings import Settings, get_settings
from trajbus.consumers.whatif.diff import Diff, diff_runs
from trajbus.consumers.whatif.rules import Rules
from trajbus.consumers.whatif.run import (
    PipelineRun,
    Progress,
    run_pipeline,
    self_check,
    substitute_alerts,
)
from trajbus.consumers.whatif.source import LogFilter, RecordedLog, read_kafka_log

__all__ = ["whatif", "whatif_async"]


def whatif(log_source: RecordedLog | Settings | None, rules: Rules | Mapping[str, Any], *,
           settings: Settings | None = None, where: LogFilter | None = None,
           progress: Progress | None = None) -> Diff:
    """What ``rules`` would have decided differently over a past log.

    ``log_source``: a :class:`RecordedLog`, or the :class:`Settings` whose Kafka topics to read
    (None: :func:`get_settings`). ``rules``: :class:`Rules` or ``{"watchdog.loop_min_repeats":
    15, ...}``. ``settings``: the recorded rules (default: those of ``log_source``, or
    :func:`get_settings`). ``where``: the part of the log the diff and self-check cover.
    Raises a :class:`~trajbus.bus.errors.UserError` for a question the log cannot answer
    (unknown rule or sandbox, empty range). From a running event loop (a notebook) use
    :func:`whatif_async`."""
    if not isinstance(log_source, RecordedLog):
        src = log_source or settings or get_settings()
        log = asyncio.run(read_kafka_log(src))
        settings = settings or src
    else:
        log = log_source
    return _whatif(log, rules, settings or get_settings(), where or LogFilter(), progress)


async def whatif_async(settings: Settings, rules: Rules | Mapping[str, Any], *,
                       where: LogFilter | None = None, timeout_s: float = 300.0) -> Diff:
    """:func:`whatif` over the Kafka topics of ``settings``, from a running event loop (the
    cores run in a thread)."""
    log = await read_kafka_log(settings, timeout_s=timeout_s)
    return await asyncio.to_thread(_whatif, log, rules, settings, where or LogFilter(), None)


def _whatif(log: RecordedLog, rules: Rules | Mapping[str, Any], settings: Settings,
            where: LogFilter, progress: Progress | None) -> Diff:
    changed = rules if isinstance(rules, Rules) else Rules.of(rules)
    log.require(where, settings)
    whatif_settings = changed.apply(settings)

    def stage(label: str) -> Progress | None:
        if progress is None:
            return None
        return lambda name, done, total: progress(f"{label} {name}", done, total)

    baseline = run_pipeline(log, settings, progress=stage("recorded rules:"))
    check = self_check(log, baseline, where)
    if not changed.changes:
        after = baseline
    elif _watchdog_changed(changed):
        watchdog = run_pipeline(log, whatif_settings, only=("watchdog",),
                                progress=stage("changed rules:"))
        alerts = substitute_alerts(log, settings, baseline, watchdog)
        after = watchdog.plus(run_pipeline(log, whatif_settings, only=("scheduler",),
                                           scheduler_alerts=alerts,
                                           progress=stage("changed rules:")))
    else:  # the watchdog decides as recorded: only the scheduler runs again
        kept = PipelineRun(baseline.by_producer("watchdog"))
        after = kept.plus(run_pipeline(log, whatif_settings, only=("scheduler",),
                                       progress=stage("changed rules:")))
    return diff_runs(baseline.outputs, after.outputs, where,
                     rules=changed.describe(settings), self_check=check,
                     inputs=dict(baseline.records), events=baseline.events + after.events,
                     seconds=baseline.seconds + after.seconds)


def _watchdog_changed(rules: Rules) -> bool:
    return any(k.startswith("watchdog.") for k in rules.changes)
