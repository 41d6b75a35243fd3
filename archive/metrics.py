"""Prometheus metrics of the archiver (exported by `trajbus archive run --metrics-port`)."""

from __future__ import annotations

import time

from prometheus_client import Counter, Gauge

BATCHES = Counter("trajbus_archiver_batches_total", "Batches written to the archive and "
                  "committed", ["group"])
OBJECTS = Counter("trajbus_archiver_objects_total", "Parquet objects written", ["group"])
ROWS = Counter("trajbus_archiver_rows_total", "Event rows archived (re-sent copies not counted)",
               ["group"])
BYTES = Counter("trajbus_archiver_bytes_total", "Bytes of Parquet objects written", ["group"])
STORE_ERRORS = Counter(
    "trajbus_archiver_store_errors_total", "Object-store calls (uploads, puts, lists, "
    "deletes) that failed: kind transient (retried, with backoff, for "
    "TRAJBUS_ARCHIVE__STORE_RETRY_S) or gave_up (the outage outlasted it: the archiver "
    "stops)", ["kind"])
NEWEST_EVENT = Gauge(
    "trajbus_archiver_newest_event_timestamp_seconds", "Event time of the newest event written "
    "to the archive and committed (0: none yet by this process)", ["group"])
FRESHNESS = Gauge(
    "trajbus_archiver_freshness_seconds", "Age (now minus event time) of the newest archived "
    "event, computed at scrape time; grows by design up to the batch rotation "
    "(TRAJBUS_ARCHIVE__MAX_OPEN_MS, 6 h) plus the time to write", ["group"])
OPEN_ROWS = Gauge("trajbus_archiver_open_rows", "Rows read and spooled, waiting in open "
                  "batches to be written", ["group"])
LAST_COMMIT = Gauge("trajbus_archiver_last_commit_timestamp_seconds", "Wall time of the "
                    "archiver's last offset commit", ["group"])


def track_freshness(group: str, newest_ms: list[int]) -> None:
    """FRESHNESS of ``group`` from ``newest_ms[0]`` (updated by the archiver), at scrape time."""
    FRESHNESS.labels(group).set_function(
        lambda: time.time() - newest_ms[0] / 1000 if newest_ms[0] else 0.0)


__all__ = ["BATCHES", "BYTES", "FRESHNESS", "LAST_COMMIT", "NEWEST_EVENT", "OBJECTS",
           "OPEN_ROWS", "ROWS", "STORE_ERRORS", "track_freshness"]
