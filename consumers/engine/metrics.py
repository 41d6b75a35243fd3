"""Prometheus metrics of the stream processors (exported by `trajbus worker --metrics-port`)."""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram, start_http_server

EVENTS_IN = Counter("trajbus_events_in_total", "Records consumed", ["processor", "topic"])
EVENTS_OUT = Counter("trajbus_events_out_total", "Records produced", ["processor", "topic"])
DEAD_LETTERS = Counter("trajbus_dead_letters_total", "Records sent to the dead-letter topic",
                       ["stage", "reason"])
BATCH_SECONDS = Histogram("trajbus_batch_seconds", "Processing time of one consumed batch, "
                          "including its transaction", ["processor"])
REORDER_BUFFERED = Gauge("trajbus_reorder_buffered_events", "Events buffered out of order")
REORDER_HELD = Gauge("trajbus_reorder_held_events", "Events held for the per-sandbox open-"
                     "episode limit until every input topic has been read up to them")
GAPS = Counter("trajbus_reorder_gaps_total", "Gaps closed by timeout")
LATE = Counter("trajbus_reorder_late_total", "Events that arrived after their gap was closed")
ALERTS = Counter("trajbus_watchdog_alerts_total", "Watchdog alerts", ["alert"])
PROCESSOR_RESTARTS = Counter(
    "trajbus_processor_restarts_total", "Processors restarted in-process after losing the "
    "broker (rebuilt from their committed state)", ["processor"])
DECISIONS = Counter("trajbus_scheduler_decisions_total", "Scheduling decisions", ["decision"])

__all__ = [
    "ALERTS", "BATCH_SECONDS", "DEAD_LETTERS", "DECISIONS", "EVENTS_IN", "EVENTS_OUT", "GAPS",
    "LATE", "PROCESSOR_RESTARTS", "REORDER_BUFFERED", "REORDER_HELD", "start_http_server",
]
