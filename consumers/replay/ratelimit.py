"""A trainer's log during a broker outage: one line per state change, a summary every N s.

Without it an idle trainer writes about 30 aiokafka log lines a second of outage
(docs/decisions/0011-summarised-client-logs.md): every failed connection, metadata refresh and
heartbeat, at WARNING or ERROR, through the trainer's own logging (a library cannot count on
the CLI's ``limit_client_log``). While a trainer client runs, the Kafka client's messages go
through :class:`OutageLog`:

* connected, the first WARNING/ERROR of the Kafka client turns the state to *failing*: one
  line says so, quoting that message;
* failing, the Kafka client's messages (all levels) are held back; every
  :data:`SUMMARY_EVERY_S` one line says for how long, how many, and the most frequent;
* failing, once no connection to a broker address is failing any more (the reconnect
  backoff's record, ``bus/reconnect.py``) and the client has been quiet for
  :data:`QUIET_S`, one line says it works again, after how long and what was held back.

So an outage of T seconds logs 2 + T / SUMMARY_EVERY_S lines. A process whose ``aiokafka``
logger is set to DEBUG (the user asked for everything) is left alone.

:class:`OutageLog` is the pure core (time passed in); :func:`attach` / :func:`detach` put
the filter on the Kafka client's loggers while at least one trainer client runs, and
:func:`tick` is called about once a second by each running client.
"""

from __future__ import annotations

import logging
import threading
import time
import weakref
from collections import Counter
from dataclasses import dataclass, field

log = logging.getLogger("trajbus.consumers.replay.client")

SUMMARY_EVERY_S = 30.0
QUIET_S = 3.0
CLIENT_LOGGERS = ("aiokafka", "kafka")


@dataclass
class OutageLog:
    """Connected or failing, from the Kafka client's messages and ticks (pure: ``now`` is
    passed in). Each method returns the lines to log."""

    summary_every_s: float = SUMMARY_EVERY_S
    quiet_s: float = QUIET_S
    failing: bool = False
    since: float = 0.0
    last_failure: float = 0.0
    last_summary: float = 0.0
    held: Counter[str] = field(default_factory=Counter)
    held_total: int = 0

    def message(self, now: float, text: str, kind: str, problem: bool) -> list[str]:
        """A Kafka client message: ``text`` as logged, ``kind`` its format (what groups
        repeats), ``problem`` True for WARNING and above."""
        if not self.failing:
            if not problem:
                return []
            self.failing = True
            self.since = self.last_failure = self.last_summary = now
            self.held.clear()
            self.held_total = 0
            return [f"Kafka client failing ({text}); retrying -- its messages are held back "
                    f"and summarised every {self.summary_every_s:.0f} s until it works again"]
        if problem:
            self.last_failure = now
        self.held[kind] += 1
        self.held_total += 1
        return self._summary(now)

    def tick(self, now: float, failing_addresses: int) -> list[str]:
        """About once a second: ``failing_addresses``, the broker addresses whose last
        connection attempt failed."""
        if not self.failing:
            return []
        if failing_addresses == 0 and now - self.last_failure >= self.quiet_s:
            self.failing = False
            return [f"Kafka client working again after {now - self.since:.0f} s "
                    f"({self.held_total} of its messages held back)"]
        return self._summary(now)

    def _summary(self, now: float) -> list[str]:
        if now - self.last_summary < self.summary_every_s:
            return []
        self.last_summary = now
        top = "; ".join(f"{n} x {kind!r}" for kind, n in self.held.most_common(2))
        line = (f"Kafka client still failing after {now - self.since:.0f} s: "
                f"{sum(self.held.values())} messages held back in the last "
                f"{self.summary_every_s:.0f} s" + (f" (most: {top})" if top else ""))
        self.held.clear()
        return [line]


class _Gate(logging.Filter):
    def __init__(self) -> None:
        super().__init__()
        self.core = OutageLog(SUMMARY_EVERY_S, QUIET_S)
        self.lock = threading.Lock()

    def filter(self, record: logging.LogRecord) -> bool:
        problem = record.levelno >= logging.WARNING
        if not problem and not self.core.failing:
            return True  # progress (joins, assignments) while all is well
        with self.lock:
            lines = self.core.message(time.monotonic(), record.getMessage(), str(record.msg),
                                      problem)
        for line in lines:
            log.warning("%s", line)
        return False

    def tick(self) -> None:
        with self.lock:
            now = time.monotonic()
            lines = self.core.tick(now, _failing_addresses(now))
        for line in lines:
            log.warning("%s", line)


def _failing_addresses(now: float) -> int:
    from trajbus.bus.reconnect import BACKOFF

    return BACKOFF.failing_addresses(now)


_lock = threading.Lock()
_gate: _Gate | None = None
_users: weakref.WeakSet[object] = weakref.WeakSet()  # a client dropped unclosed stops counting
_loggers: list[logging.Logger] = []


def _client_loggers() -> list[logging.Logger]:
    names = [n for n in list(logging.root.manager.loggerDict)
             if n.split(".")[0] in CLIENT_LOGGERS]
    return [logging.getLogger(n) for n in sorted(set(names) | set(CLIENT_LOGGERS))]


def _remove_gate() -> None:
    global _gate, _loggers
    if _gate is not None:
        for logger in _loggers:
            logger.removeFilter(_gate)
    _gate, _loggers = None, []


def attach(user: object) -> None:
    """A trainer client starts: the first one puts a fresh gate on the Kafka client's loggers
    (unless ``aiokafka`` logs at DEBUG). A gate left by clients that were dropped without
    closing is replaced, so an outage they saw does not leak into this one's log."""
    global _gate, _loggers
    with _lock:
        if not _users:
            _remove_gate()
        _users.add(user)
        if _gate is not None or logging.getLogger("aiokafka").isEnabledFor(logging.DEBUG):
            return
        _gate = _Gate()
        _loggers = _client_loggers()
        for logger in _loggers:
            logger.addFilter(_gate)


def detach(user: object) -> None:
    """A trainer client stopped: the last one takes the gate off."""
    with _lock:
        _users.discard(user)
        if not _users:
            _remove_gate()


def tick() -> None:
    gate = _gate
    if gate is not None:
        gate.tick()
