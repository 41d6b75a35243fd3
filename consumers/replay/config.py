"""What a replay client is asked to read, and how: the subscription (the replay topics of the
tasks asked for, as one topic pattern), the defaults of its options and their checks.

Guarantees: a subscription names at least one task, :data:`ALL_TASKS` or a ``task_pattern``;
every task name is valid and a ``task_pattern`` a regular expression (``ValueError``
otherwise); :data:`ALL_TASKS` never matches the operators' ``debug-*`` republish topics; an
option out of range is a ``ValueError`` before anything connects.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable

from trajbus.bus import inventory
from trajbus.bus.kafka import check_broker
from trajbus.bus.settings import Settings, get_settings
from trajbus.bus.topics import validate_name

FLOW_CONTROL_TIMEOUT_S = 300.0
"""The default ``flow_control_timeout_s``: aiokafka's ``max_poll_interval_ms``, the longest a
member may go without fetching before the group takes it out."""
DEFAULT_COMMIT_EVERY_MS = 100.0
"""The default ``commit_every_ms``: coalesced commits (see :mod:`~.client`), chosen by
bench/bench_trainer_commit.py."""
ALL_TASKS = "*"
"""``ReplayClient(ALL_TASKS, ...)``: every task's replay topic, present and future (the
operators' ``debug-*`` republish topics excepted)."""


async def list_tasks(settings: Settings | None = None, *, include_debug: bool = False
                     ) -> list[str]:
    """The tasks that have a replay topic on the broker, sorted (``debug-*`` republish tasks
    only with ``include_debug``)."""
    settings = settings or get_settings()
    await check_broker(settings.kafka)
    return await inventory.list_tasks(settings, include_debug)


def replay_topic_pattern(settings: Settings, tasks: Iterable[str] | str,
                         task_pattern: str | None = None) -> str:
    """The regex of the replay topics a client reads: the named tasks, every task
    (:data:`ALL_TASKS`), and/or the tasks whose whole name matches ``task_pattern``."""
    names = [tasks] if isinstance(tasks, str) else list(tasks)
    alternatives: list[str] = []
    for task in names:
        if task == ALL_TASKS:
            alternatives.append(r"(?!debug-).+")
        else:
            alternatives.append(re.escape(validate_name("task", task)))
    if task_pattern is not None:
        try:
            re.compile(task_pattern)
        except re.error as exc:
            raise ValueError(f"task_pattern {task_pattern!r} is not a regular expression: "
                             f"{exc}") from None
        alternatives.append(f"(?:{task_pattern})")
    if not alternatives:
        raise ValueError("subscribe to at least one task, ALL_TASKS ('*') or a task_pattern")
    prefix = re.escape(f"{settings.topics.prefix}.replay.")
    return f"^{prefix}(?:{'|'.join(alternatives)})$"


def check_options(max_in_flight: int, flow_control_timeout_s: float | None,
                  max_staleness: int | None,
                  current_policy_version: Callable[[], int] | None) -> None:
    """Raise ``ValueError`` for options a :class:`~.client.ReplayClient` cannot run with."""
    if max_in_flight < 1:
        raise ValueError(f"max_in_flight must be at least 1, not {max_in_flight!r}")
    if flow_control_timeout_s is not None and flow_control_timeout_s <= 0:
        raise ValueError("flow_control_timeout_s must be positive (None: wait for ever), "
                         f"not {flow_control_timeout_s!r}")
    if max_staleness is not None:
        if max_staleness < 0:
            raise ValueError(f"max_staleness must be 0 or more, not {max_staleness!r}")
        if current_policy_version is None:
            raise ValueError(
                f"max_staleness={max_staleness} needs the trainer's policy version: pass "
                "current_policy_version=<a callable returning the version being trained "
                "now>, e.g. current_policy_version=lambda: trainer.policy_version")
