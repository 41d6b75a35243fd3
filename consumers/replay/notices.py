"""What the trainer client says about waits that are not errors.

A task-name typo would make a trainer wait for ever, a group-id typo would make it re-read
everything, and a trainer restarted after a crash waits out its previous run's session: none
of these is an error, so each is said once (or rarely), at WARNING
(docs/decisions/0020-trainer-notices.md):

* **a task without a replay topic** (:func:`watch_subscription`): after
  :data:`MISSING_TASK_WARN_AFTER_S` the named tasks that still have no replay topic are
  logged with the tasks that have one (``list_tasks()``) and the close matches among them; then
  at most every :data:`MISSING_TASK_WARN_EVERY_S`; and once more when they appear. A
  subscription by pattern (``ALL_TASKS``, ``task_pattern``) that matches no topic likewise.
* **a new group** (:func:`new_group_message`): a group with no committed offset that starts
  from ``"resume"`` reads every partition from its earliest retained record: logged once at
  start, with the existing groups of similar names (a typo's likely intent).
* **a wait to join the group** (:func:`watch_join`): not joined after
  :data:`JOIN_WAIT_LOG_AFTER_S`, the client logs the members the group still counts (the
  trainer's previous run, killed, stays a member until its session times out: 10 s) and what
  shortens the wait (``group_instance_id``: static membership); then once more when joined.

The decisions are pure functions of what was observed (names, timings passed in); the two
watchers are the shell, run as tasks of the client and cancelled at its ``stop()``.
"""

from __future__ import annotations

import asyncio
import difflib
import logging
import re
from collections.abc import Awaitable, Callable, Iterable
from typing import Any

log = logging.getLogger("trajbus.consumers.replay.client")

MISSING_TASK_WARN_AFTER_S = 30.0
"""How long a subscription waits for a task's replay topic before it says so."""
MISSING_TASK_WARN_EVERY_S = 300.0
JOIN_WAIT_LOG_AFTER_S = 3.0
"""How long a client waits to join its group before it says what it waits for."""
SESSION_TIMEOUT_S = 10.0  # aiokafka's session_timeout_ms default (the client keeps it)


def close_matches(name: str, candidates: Iterable[str]) -> list[str]:
    return difflib.get_close_matches(name, sorted(set(candidates)), n=3, cutoff=0.6)


def missing_message(group_id: str, missing: list[str], pattern_only: bool, existing: list[str],
                    waited_s: float) -> str:
    """The warning for tasks still without a replay topic after ``waited_s`` (``missing``:
    the named tasks; ``pattern_only``: a pattern subscription that matches none)."""
    have = ", ".join(existing) if existing else "none"
    if pattern_only:
        what = "no task's replay topic matches the subscription"
    else:
        hints = []
        for task in missing:
            near = close_matches(task, existing)
            if near:
                hints.append(f"{task!r}: did you mean {' or '.join(map(repr, near))}?")
        what = (f"task(s) {missing} have no replay topic"
                + (f" ({'; '.join(hints)})" if hints else ""))
    return (f"replay client {group_id}: {what} after {waited_s:.0f} s; the client waits for "
            f"them (a topic created later is read within 5 s). Tasks with a replay topic "
            f"now (list_tasks()): {have}")


def new_group_message(group_id: str, start: object, committed: dict[Any, Any],
                      groups: Iterable[str]) -> str | None:
    """The notice for a group that has committed nothing, started from ``"resume"``; None
    otherwise."""
    if start != "resume" or committed:
        return None
    near = [g for g in close_matches(group_id, groups) if g != group_id]
    hint = (f"; existing groups with similar names: {', '.join(near)}" if near
            else "")
    return (f"replay client {group_id}: consumer group {group_id!r} has no committed offsets: "
            f"it reads every partition from its earliest retained record (a new group; if "
            f"you meant to resume an existing one, check the group id{hint})")


def join_wait_message(group_id: str, waited_s: float, members: list[dict[str, str]],
                      static: bool) -> str:
    """What a client not yet in its group after ``waited_s`` waits for."""
    if members:
        who = ", ".join(f"{m.get('client_id', '?')}@{m.get('client_host', '?')}"
                        + (f" (instance {m['group_instance_id']})"
                           if m.get("group_instance_id") else "")
                        for m in members)
        why = (f"the group still counts {len(members)} member(s): {who}; one that is gone "
               f"(this trainer's previous run, killed?) is waited for until its session "
               f"times out ({SESSION_TIMEOUT_S:.0f} s)")
    else:
        why = "the group is rebalancing (or its coordinator is not reachable yet)"
    advice = ("" if static else "; a trainer restarted with the same group_instance_id= "
              "(static membership) takes its previous run's place without this wait")
    return (f"replay client {group_id}: waiting {waited_s:.0f} s to join the group: "
            f"{why}{advice}")


async def watch_subscription(group_id: str, tasks: list[str], pattern: str,
                             topic_names: Callable[[], Awaitable[list[str]]],
                             task_of: Callable[[str], str | None],
                             warn_after_s: float | None = None,
                             warn_every_s: float | None = None) -> None:
    """Warn while named tasks have no replay topic (or the pattern matches none); say when
    they appear after a warning. Runs until cancelled, or until nothing is missing."""
    after = MISSING_TASK_WARN_AFTER_S if warn_after_s is None else warn_after_s
    every = MISSING_TASK_WARN_EVERY_S if warn_every_s is None else warn_every_s
    loop = asyncio.get_running_loop()
    started = loop.time()
    await asyncio.sleep(after)
    warned: list[str] | None = None
    matcher = re.compile(pattern)
    while True:
        try:
            names = await topic_names()
        except Exception as exc:  # the broker away: the outage says so itself
            log.debug("replay client %s: topic list failed (%s)", group_id, exc)
            await asyncio.sleep(min(every, 30.0))
            continue
        existing = sorted({t for n in names if (t := task_of(n)) is not None
                           and not t.startswith("debug-")})
        present = {task_of(n) for n in names if matcher.fullmatch(n)}
        missing = [t for t in tasks if t not in present]
        pattern_only = not tasks and not present
        if not missing and not pattern_only:
            if warned is not None:
                log.warning("replay client %s: %s now ha%s a replay topic: reading it",
                            group_id, warned or "the subscription",
                            "s" if len(warned) == 1 else "ve")
            return
        log.warning("%s", missing_message(group_id, missing, pattern_only, existing,
                                          loop.time() - started))
        warned = missing
        await asyncio.sleep(every)


def members_of(description: Any) -> list[dict[str, str]]:
    """The members of a DescribeGroups response (aiokafka's raw response), as dicts."""
    try:
        obj = description.to_object()
        groups = obj.get("groups") or []
        members = groups[0].get("members") or [] if groups else []
        return [{k: str(v) for k, v in m.items()
                 if k in ("member_id", "group_instance_id", "client_id", "client_host")
                 and v is not None}
                for m in members]
    except Exception:
        return []


async def watch_join(group_id: str, joined: Callable[[], bool], subscribed: Callable[[], bool],
                     members: Callable[[], Awaitable[list[dict[str, str]]]], static: bool,
                     log_after_s: float | None = None) -> None:
    """Log once if the client has not joined its group after ``log_after_s`` (what it waits
    for), and once more when it has. Nothing while no topic matches the subscription (there
    is nothing to join for yet: :func:`watch_subscription` says that)."""
    after = JOIN_WAIT_LOG_AFTER_S if log_after_s is None else log_after_s
    loop = asyncio.get_running_loop()
    started = loop.time()
    while not joined():
        if loop.time() - started >= after:
            break
        await asyncio.sleep(0.1)
    else:
        return
    if not subscribed():
        return
    try:
        who = await asyncio.wait_for(members(), 5.0)
    except Exception:
        who = []
    if joined():
        return
    log.warning("%s", join_wait_message(group_id, loop.time() - started, who, static))
    while not joined():
        await asyncio.sleep(0.1)
    log.warning("replay client %s: joined the group after %.1f s", group_id,
                loop.time() - started)
