"""Prometheus metrics of the stream processors (exported by `trajbus worker --metrics-port`)."""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram, start_http_server

from trajbus.bus.deadletter import DEAD_LETTERS
from trajbus.bus.ops import CONSUMER_LAG

EVENTS_IN = Counter("trajbus_events_in_total", "Records consumed", ["processor", "topic"])
EVENTS_OUT = Counter("trajbus_events_out_total", "Records produced", ["processor", "topic"])
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
CONFLICTS = Counter("trajbus_reorder_conflicts_total", "Conflicting duplicates: a seq already "
                    "emitted arrived again with different content (dead-lettered "
                    "conflicting_duplicate; the first version is kept)")
TRANSACTIONS = Counter(
    "trajbus_transactions_total", "Kafka transactions of the processors (a batch's outputs, "
    "state and input offsets), by outcome: committed; aborted (it failed and was aborted: "
    "nothing of it is visible, its inputs are processed again); failed (it failed and could "
    "not be aborted, e.g. the broker went away: left for the broker to abort)",
    ["processor", "outcome"])
RESTORE_SECONDS = Histogram(
    "trajbus_restore_seconds", "Time to rebuild a processor's state from its changelog after "
    "an assignment", ["processor"], buckets=(0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300))
RESTORED_RECORDS = Counter("trajbus_restored_state_records_total",
                           "State records read from the changelog by restores", ["processor"])
ASSIGNED_PARTITIONS = Gauge("trajbus_assigned_partitions", "Input partitions assigned to this "
                            "worker's processor", ["processor"])

__all__ = [
    "ALERTS", "ASSIGNED_PARTITIONS", "BATCH_SECONDS", "CONFLICTS", "CONSUMER_LAG",
    "DEAD_LETTERS", "DECISIONS", "EVENTS_IN", "EVENTS_OUT", "GAPS", "LATE",
    "PROCESSOR_RESTARTS", "REORDER_BUFFERED", "REORDER_HELD", "RESTORED_RECORDS",
    "RESTORE_SECONDS", "TRANSACTIONS", "start_http_server",
]
