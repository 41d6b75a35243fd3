"""What a pipeline demo run shares between its rooms: the tasks it runs, :class:`View` (what
the downstream readers saw, updated live while the fleet runs), :class:`Faults` (what the
soak injects, and what the run recorded of it) and :func:`say` (the run's progress lines,
on stderr).
"""

from __future__ import annotations

import sys
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

TASKS = ["swe-bench", "web-shop", "math-proofs"]


@dataclass
class View:
    """What the downstream consumers saw, updated live."""

    episodes: dict[tuple[str, str], list[tuple[int, str]]] = field(default_factory=dict)
    open: dict[tuple[str, str], list[tuple[int, str]]] = field(default_factory=dict)
    truncated: set[tuple[str, str]] = field(default_factory=set)
    gappy: set[tuple[str, str]] = field(default_factory=set)
    kinds: Counter[str] = field(default_factory=Counter)
    first_segment_s: float | None = None
    alerts: Counter[str] = field(default_factory=Counter)
    loop_alerts: set[tuple[str, str | None]] = field(default_factory=set)
    decisions: Counter[str] = field(default_factory=Counter)
    by_sandbox: dict[str, list[str]] = field(default_factory=dict)  # decisions, in order
    # details of each RECYCLE_WITH_LOSS, by sandbox (what was lost, when the grace window ended)
    loss_details: dict[str, dict[str, str]] = field(default_factory=dict)
    anomalies: list[str] = field(default_factory=list)
    dead_letters: Counter[str] = field(default_factory=Counter)
    dead_letter_examples: list[str] = field(default_factory=list)
    sample: tuple[str, str] | None = None  # one finished episode, for the waterfall
    # the readers (trainer, watcher) that stopped before the run ended, and why
    reader_failures: list[str] = field(default_factory=list)


@dataclass
class Faults:
    """Faults injected during a run (the soak). Times count from the fleet's start."""

    kill_worker_after_s: float | None = None  # SIGKILL the worker, then start it again
    restart_broker_after_s: float | None = None
    # stops and restarts it (or, on a cluster, injects a node fault); may say what it did
    restart_broker: Callable[[], Awaitable[str | None]] | None = None
    log: list[str] = field(default_factory=list)  # what was injected, when
    # A worker (re)started while the broker is down exits at once by design (fail fast at
    # start-up); the run supervises it as a deployment would, restarting it after such an
    # exit. Any other exit is a failure of the run.
    unexpected_exits: list[str] = field(default_factory=list)
    longest_outage_s: float = 0.0  # the longest broker restart injected


def say(msg: str) -> None:
    print(f"[demo] {msg}", file=sys.stderr, flush=True)
