"""Where things live in the archive (pure functions: no I/O).

::

    events/date=YYYY-MM-DD/hour=HH/task=T/<topic>-<partition>-<first>-<last>-hHH.parquet
    index/date=YYYY-MM-DD/task=T/<same file name>.parquet
    events/.../compacted-gGGGGGGGG-hHH-NNNN.parquet     (compaction output, see manifest.py)
    _manifest/CURRENT, _manifest/g-GGGGGGGG.json      (the compaction pointer)
    conflicts/date=YYYY-MM-DD/hour=HH/task=T/<same name as events>  (conflicting copies)
    _batches/<topic>-<partition>/<first>-<last>.json    (batches being written, not committed)

* Directories are partitioned by low-cardinality values only (date, hour, task); sandbox and
  episode are *inside* files (sorted) and in the index, never directory names (the listing
  and small-file lessons of the Kafka->S3 sinks).
* Offsets are zero-padded to 20 digits so lexicographic order is offset order.
* A (topic, partition) batch ``[first, last]`` is split into one object per (date, hour, task)
  group of its rows; the name carries the batch's offset range plus the hour, so the same batch
  always maps to the same keys (re-uploading after a crash overwrites, never duplicates).
* Date and hour are UTC, from the event time (not the wall clock).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from datetime import UTC, datetime

from trajbus.bus.topics import validate_name

EVENTS = "events/"
INDEX = "index/"
CONFLICTS = "conflicts/"
MANIFEST_DIR = "_manifest/"
BATCHES = "_batches/"

_BATCH_NAME = re.compile(
    r"^(?P<topic>[A-Za-z0-9._-]+)-(?P<partition>\d+)-(?P<first>\d{20})-(?P<last>\d{20})"
    r"-h(?P<hour>\d\d)\.parquet$"
)
_COMPACT_NAME = re.compile(r"^compacted-g(?P<gen>\d{8})-h(?P<hour>\d\d)-(?P<n>\d{4})\.parquet$")
_DATE = re.compile(r"^\d{4}-\d{2}-\d{2}$")


def date_hour(event_time_ms: int) -> tuple[str, str]:
    """UTC ("YYYY-MM-DD", "HH") of an event time in epoch milliseconds."""
    t = datetime.fromtimestamp(event_time_ms / 1000, tz=UTC)
    return t.strftime("%Y-%m-%d"), t.strftime("%H")


def batch_object_name(topic: str, partition: int, first: int, last: int, hour: str) -> str:
    return f"{topic}-{partition}-{first:020d}-{last:020d}-h{hour}.parquet"


def compacted_object_name(generation: int, hour: str, n: int) -> str:
    return f"compacted-g{generation:08d}-h{hour}-{n:04d}.parquet"


def events_key(date: str, hour: str, task: str, name: str) -> str:
    _check_date_hour(date, hour)
    return f"{EVENTS}date={date}/hour={hour}/task={validate_name('task', task)}/{name}"


def conflicts_key(date: str, hour: str, task: str, name: str) -> str:
    """Where a batch's conflicting copies go (same partitioning as ``events/``)."""
    _check_date_hour(date, hour)
    return f"{CONFLICTS}date={date}/hour={hour}/task={validate_name('task', task)}/{name}"


def index_key(date: str, task: str, name: str) -> str:
    _check_date_hour(date, "00")
    return f"{INDEX}date={date}/task={validate_name('task', task)}/{name}"


def batch_marker_key(topic: str, partition: int, first: int, last: int) -> str:
    return f"{BATCHES}{topic}-{partition}/{first:020d}-{last:020d}.json"


def batch_marker_prefix(topic: str, partition: int) -> str:
    return f"{BATCHES}{topic}-{partition}/"


def parse_marker_name(key: str) -> tuple[int, int]:
    """(first, last) offsets of a batch marker key."""
    stem = key.rsplit("/", 1)[-1].removesuffix(".json")
    first, last = stem.split("-")
    return int(first), int(last)


def parse_marker_key(key: str) -> tuple[str, int, int, int]:
    """(topic, partition, first, last) of a batch marker key."""
    tp, stem = key[len(BATCHES):].split("/", 1)
    topic, partition = tp.rsplit("-", 1)
    first, last = parse_marker_name(stem)
    return topic, int(partition), first, last


def batch_of(name: str) -> tuple[str, int, int, int] | None:
    """(topic, partition, first, last) of an archiver object's file name; None if compacted."""
    m = _BATCH_NAME.match(name)
    if m is None:
        return None
    return m["topic"], int(m["partition"]), int(m["first"]), int(m["last"])


def _check_date_hour(date: str, hour: str) -> None:
    if not _DATE.match(date) or not (len(hour) == 2 and hour.isdigit() and int(hour) < 24):
        raise ValueError(f"bad partition date/hour {date!r}/{hour!r}")


@dataclass(frozen=True, slots=True)
class ObjectPath:
    """The parsed key of a data (``events/``) or index (``index/``) object."""

    key: str
    area: str  # "events", "index" or "conflicts"
    date: str
    hour: str
    task: str
    name: str
    compacted_generation: int | None  # None for archiver objects

    @property
    def events_key(self) -> str:
        return events_key(self.date, self.hour, self.task, self.name)

    @property
    def index_key(self) -> str:
        return index_key(self.date, self.task, self.name)


def parse_object_key(key: str) -> ObjectPath | None:
    """Parse an ``events/``, ``conflicts/`` or ``index/`` key; None for anything else."""
    parts = key.split("/")
    try:
        if parts[0] in ("events", "conflicts") and len(parts) == 5:
            date, hour, task = (p.split("=", 1)[1] for p in parts[1:4])
            keys = [p.split("=", 1)[0] for p in parts[1:4]]
            if keys != ["date", "hour", "task"]:
                return None
        elif parts[0] == "index" and len(parts) == 4:
            if not (parts[1].startswith("date=") and parts[2].startswith("task=")):
                return None
            date, task, hour = parts[1][5:], parts[2][5:], ""
        else:
            return None
    except IndexError:
        return None
    name = parts[-1]
    m = _BATCH_NAME.match(name)
    gen: int | None = None
    if m is None:
        c = _COMPACT_NAME.match(name)
        if c is None:
            return None
        gen = int(c["gen"])
        name_hour = c["hour"]
    else:
        name_hour = m["hour"]
    if hour and hour != name_hour:
        return None
    return ObjectPath(key, parts[0], date, name_hour, task, name, gen)
