"""Logging of long-running processes: a Kafka client's repeated complaints, summarised.

While the broker is away, aiokafka logs every failed connection, metadata update and heartbeat:
thousands of lines a second from one worker, which bury what the operator needs
(docs/decisions/0011-summarised-client-logs.md). :class:`RepeatLimiter` lets each kind of
message through once per interval and says how many like it it held back. ``--debug`` shows
them all.
"""

from __future__ import annotations

import json
import logging
import sys
import time

CLIENT_LOGGERS = ("aiokafka", "kafka")


class RepeatLimiter(logging.Filter):
    """Passes a warning or error of the ``loggers`` once per ``interval_s`` per (logger,
    message format); the next one passed says how many were held back. Other records (INFO and
    below, other loggers) pass untouched."""

    def __init__(self, interval_s: float = 30.0, loggers: tuple[str, ...] = CLIENT_LOGGERS
                 ) -> None:
        super().__init__()
        self.interval_s = interval_s
        self.loggers = loggers
        self._seen: dict[tuple[str, str], tuple[float, int]] = {}  # -> (last passed, held)

    def filter(self, record: logging.LogRecord) -> bool:
        # INFO lines (shown with -v: group joins, assignments) are progress, not a flood;
        # tools parse them (bench_rebalance, bench_recovery)
        if record.levelno < logging.WARNING or not record.name.startswith(self.loggers):
            return True
        verdict: bool | None = getattr(record, "_trajbus_repeat_verdict", None)
        if verdict is None:  # the same verdict for every handler the record reaches
            verdict = self._decide(record)
            record._trajbus_repeat_verdict = verdict
        return verdict

    def _decide(self, record: logging.LogRecord) -> bool:
        key = (record.name, str(record.msg))
        now = time.monotonic()
        last, held = self._seen.get(key, (None, 0))
        if last is not None and now - last < self.interval_s:
            self._seen[key] = (last, held + 1)
            return False
        self._seen[key] = (now, 0)
        if held:
            record.msg = (f"{record.msg} [and {held} more like this in the last "
                          f"{now - (last or now):.0f} s]")
        return True


def limit_client_log(interval_s: float = 30.0) -> RepeatLimiter:
    """Install a :class:`RepeatLimiter` on every handler of the root logger."""
    limiter = RepeatLimiter(interval_s)
    for handler in logging.getLogger().handlers:
        handler.addFilter(limiter)
    return limiter


OPS_LOGGER = "trajbus.ops"
"""Takeovers (partitions assigned), restores and reconnections: logged at INFO also without -v."""

LOG_FORMATS = ("text", "json")
TEXT_FORMAT = "%(asctime)s %(name)s %(levelname)s %(message)s"


class JsonFormatter(logging.Formatter):
    """One JSON object per line: ``ts`` (ISO-8601 UTC), ``level``, ``logger``, ``message``,
    and ``exc`` with the traceback when there is one -- for log shippers."""

    def format(self, record: logging.LogRecord) -> str:
        out = {"ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
               + f".{int(record.msecs):03d}Z", "level": record.levelname,
               "logger": record.name, "message": record.getMessage()}
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out, ensure_ascii=False)


def setup_logging(verbose: bool, log_format: str = "text") -> None:
    """The log of a long-running process: WARNING and up (INFO with ``verbose``), plus the
    operator's events (:data:`OPS_LOGGER`) at INFO always; ``log_format`` ``text`` or
    ``json`` (one object per line)."""
    if log_format not in LOG_FORMATS:
        raise ValueError(f"log format {log_format!r}: choose text or json")
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if log_format == "json"
                         else logging.Formatter(TEXT_FORMAT))
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(logging.INFO if verbose else logging.WARNING)
    logging.getLogger(OPS_LOGGER).setLevel(logging.INFO)


__all__ = ["CLIENT_LOGGERS", "LOG_FORMATS", "OPS_LOGGER", "JsonFormatter", "RepeatLimiter",
           "limit_client_log", "setup_logging"]
