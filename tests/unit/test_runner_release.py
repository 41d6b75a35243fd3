"""The ordered runner (the scheduler) says once that it stopped waiting for a silent partition.

A trial of 2026-12-02: after a broker restart the scheduler logged the same warning 82 times
within 0.1 s, once per record it released meanwhile, each line longer than the last (930
characters), and none said what it meant for the operator.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from types import SimpleNamespace
from typing import Any

from aiokafka import TopicPartition
from support import QuietCore, settings_for

from trajbus.consumers.engine import runner as runner_module
from trajbus.consumers.engine.runner import ProcessorSpec, Runner

EVENTS = TopicPartition("in.events", 0)
TICKS = TopicPartition("in.ticks", 0)


def _ordered_runner() -> Runner:
    spec = ProcessorSpec(name="sched", input_topics=[EVENTS.topic, TICKS.topic],
                         factory=QuietCore, ordered=True, global_state=True)
    runner = Runner(settings_for("127.0.0.1:1", "unused"), spec, "w0")
    runner._consumer = SimpleNamespace(assignment=lambda: {EVENTS, TICKS})
    return runner


def _records(tp: TopicPartition, n: int, first_ts: int) -> list[Any]:
    return [SimpleNamespace(timestamp=first_ts + i, offset=i, key=b"k", value=b"v")
            for i in range(n)]


def _silent_warnings(caplog: Any) -> list[str]:
    return [r.getMessage() for r in caplog.records if "not even a tick" in r.getMessage()]


def test_a_silent_partition_is_reported_once_per_silence(caplog: Any) -> None:
    caplog.set_level(logging.WARNING, logger="trajbus.runner")
    runner = _ordered_runner()
    long_ago = time.monotonic() - runner_module._MAX_IDLE_S - 1
    runner._empty_since[TICKS] = long_ago
    runner._pending[EVENTS] = deque(_records(EVENTS, 80, 1000))
    assert len(runner._release()) == 80
    assert len(_silent_warnings(caplog)) == 1  # 80 before
    assert "in.ticks[0]" in _silent_warnings(caplog)[0]
    runner._pending[EVENTS].extend(_records(EVENTS, 5, 2000))
    runner._release()
    assert len(_silent_warnings(caplog)) == 1  # still the same silence
    # it speaks again, then falls silent again: said again
    runner._pending[TICKS] = deque(_records(TICKS, 1, 3000))
    runner._pending[EVENTS].extend(_records(EVENTS, 1, 3001))
    runner._release()
    runner._empty_since[TICKS] = long_ago
    runner._pending[EVENTS].extend(_records(EVENTS, 3, 4000))
    runner._release()
    assert len(_silent_warnings(caplog)) == 2
