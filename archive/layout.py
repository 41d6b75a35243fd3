"""Where things live in the archive (pure functions: no I/O).

::

    events/date=YYYY-MM-DD/hour=HH/task=T/<topic>-<partition>-<first>-<last>-hHH.parquet
    index/date=YYYY-MM-DD/task=T/<same file name>.parquet
    events/.../compacted-gGGGGGGGG-hHH-NNNN.parquet     (compaction output, see manifest.py)
    _manifest/CURRENT, _manifest/g-GGGGGGGG.json      (the compaction pointer)
    conflicts/date=YYYY-MM-DD/hour=HH/task=T/<same name as events>  (conflicting copies)
    decisions/..., alerts/..., dead_letters/...         (the decision context, same layout)
    decisions_index/..., alerts_index/..., dead_letters_index/...  (their index, as index/)
    _batches/<topic>-<partition>/<first>-<last>.json    (batches being written, not committed)

* Directories are partitioned by low-cardinality values only (date, hour, task); sandbox and
  episode are *inside* files (sorted) and in the index, never directory names (the listing
  and small-file lessons of the Kafka->S3 sinks).
* Offsets are zero-padded to 20 digits so lexicographic order is offset order.
* A (topic, partition) batch ``[first, last]`` is split into one object per (date, hour, task)
  group of its rows; the name carries the batch's offset range plus the hour, so the same batch
  always maps to the same keys (re-uploading after a crash overwrites, never duplicates).
* Date and hour are UTC, from the event time (not the wall clock).
* The decision context (scheduling decisions, watchdog alerts, dead letters) is archived by
  the same machinery into its own *data areas* (:data:`DATA_AREAS`), each with the layout of
  ``events/`` and its own index area (:func:`index_area`), so the episode index of ``index/``
  holds sandbox events only.
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

DATA_AREAS: tuple[str, ...] = ("events", "decisions", "alerts", "dead_letters")
"""Areas holding archived rows (``<area>/date=D/hour=H/task=T/<name>``)."""
CONTEXT_AREAS: tuple[str, ...] = DATA_AREAS[1:]
"""The decision context: the processors' outputs archived beside ``events/``."""


def index_area(area: str) -> str:
    """The index area of a data area: ``index`` for events, ``<area>_index`` otherwise."""
    if area not in DATA_AREAS:
        raise ValueError(f"unknown archive area {area!r} (one of {', '.join(DATA_AREAS)})")
    return "index" if area == "events" else f"{area}_index"


_DATA_OF_INDEX = {index_area(a): a for a in DATA_AREAS}
INDEX_AREAS: tuple[str, ...] = tuple(_DATA_OF_INDEX)

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
    return data_key("events", date, hour, task, name)


def data_key(area: str, date: str, hour: str, task: str, name: str) -> str:
    """The key of a data object of ``area`` (one of :data:`DATA_AREAS`)."""
    _check_date_hour(date, hour)
    index_area(area)
    return f"{area}/date={date}/hour={hour}/task={validate_name('task', task)}/{name}"


def conflicts_key(date: str, hour: str, task: str, name: str) -> str:
    """Where a batch's conflicting copies go (same partitioning as ``events/``)."""
    _check_date_hour(date, hour)
    return f"{CONFLICTS}date={date}/hour={hour}/task={validate_name('task', task)}/{name}"


def index_key(date: str, task: str, name: str, area: str = "events") -> str:
    """The key of the index file of the data object ``name`` of ``area``."""
    _check_date_hour(date, "00")
    return f"{index_area(area)}/date={date}/task={validate_name('task', task)}/{name}"


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
    """The parsed key of a data object (``events/``, a context area, ``conflicts/``) or of an
    index file (``index/``, ``<area>_index/``)."""

    key: str
    area: str  # a data area, "conflicts", or an index area
    date: str
    hour: str
    task: str
    name: str
    compacted_generation: int | None  # None for archiver objects

    @property
    def data_area(self) -> str:
        """The data area this object belongs to (itself, or the one an index file indexes)."""
        return _DATA_OF_INDEX.get(self.area, self.area)

    @property
    def data_key(self) -> str:
        """The key of the data object (for an index file: the object it indexes)."""
        if self.data_area == "conflicts":
            return conflicts_key(self.date, self.hour, self.task, self.name)
        return data_key(self.data_area, self.date, self.hour, self.task, self.name)

    @property
    def events_key(self) -> str:
        """:attr:`data_key` (the name from when ``events/`` was the only data area)."""
        return self.data_key

    @property
    def index_key(self) -> str:
        """The key of the index file of this data object (conflicts have none: ``index/``)."""
        area = "events" if self.data_area == "conflicts" else self.data_area
        return index_key(self.date, self.task, self.name, area)


def parse_object_key(key: str) -> ObjectPath | None:
    """Parse a data, ``conflicts/`` or index key; None for anything else."""
    parts = key.split("/")
    try:
        if (parts[0] in DATA_AREAS or parts[0] == "conflicts") and len(parts) == 5:
            date, hour, task = (p.split("=", 1)[1] for p in parts[1:4])
            keys = [p.split("=", 1)[0] for p in parts[1:4]]
            if keys != ["date", "hour", "task"]:
                return None
        elif parts[0] in _DATA_OF_INDEX and len(parts) == 4:
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
