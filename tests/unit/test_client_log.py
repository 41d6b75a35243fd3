"""A worker's log stays readable while the broker is away (bus/logs.py).

A trial of 2026-12-02: during a broker outage one worker logged 300 to 8,000 aiokafka lines a
second (27 MB in a minute), even without -v. Each kind of client message now passes once per
interval, the next one saying how many like it were held back; trajbus's own lines all pass.
"""

from __future__ import annotations

import logging

import pytest

from trajbus.bus import logs


class _Collect(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(f"{record.name}: {record.getMessage()}")


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    now = [1000.0]
    monkeypatch.setattr(logs.time, "monotonic", lambda: now[0])
    return now


def test_a_flood_of_client_errors_is_summarised_and_trajbus_lines_all_pass(clock) -> None:
    limiter = logs.RepeatLimiter(interval_s=30)
    first, second = _Collect(), _Collect()
    for handler in (first, second):
        handler.addFilter(limiter)
    conn = logging.getLogger("aiokafka.conn.test-limiter")
    ours = logging.getLogger("trajbus.runner.test-limiter")
    for log in (conn, ours):
        log.propagate = False
        log.setLevel(logging.INFO)
        for handler in (first, second):
            log.addHandler(handler)
    try:
        for i in range(500):
            conn.error("Unable connect to node with id %s: %s", 1, f"refused {i}")
            clock[0] += 0.01  # 100 a second for 5 s
        ours.warning("reorder lost the broker; restarting it")
        ours.warning("reorder lost the broker; restarting it")
        for group in ("g1", "g2"):  # progress (-v), parsed by the benchmarks: every line
            conn.info("Setting newly assigned partitions %s for group %s", "{0}", group)
        clock[0] += 30
        conn.error("Unable connect to node with id %s: %s", 1, "refused again")
    finally:
        for log in (conn, ours):
            for handler in (first, second):
                log.removeHandler(handler)
    for handler in (first, second):  # both handlers of the root see the same lines
        assert handler.lines == [
            "aiokafka.conn.test-limiter: Unable connect to node with id 1: refused 0",
            "trajbus.runner.test-limiter: reorder lost the broker; restarting it",
            "trajbus.runner.test-limiter: reorder lost the broker; restarting it",
            "aiokafka.conn.test-limiter: Setting newly assigned partitions {0} for group g1",
            "aiokafka.conn.test-limiter: Setting newly assigned partitions {0} for group g2",
            "aiokafka.conn.test-limiter: Unable connect to node with id 1: refused again "
            "[and 499 more like this in the last 35 s]",
        ]
