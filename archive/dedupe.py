"""Write-time deduplication: the archive holds exactly one row per event.

An *event* is identified by ``(kafka_topic, sandbox, episode, seq)`` (``episode`` null for a
sandbox's lifecycle stream); the emitters key every record by sandbox, so all copies of an
event land in the same (topic, partition). A second record with that identity is

* a **re-sent copy** when its content digest (blake2b-64 of the record bytes, the digest the
  reorder worker compares) equals the archived one's: it is dropped (``duplicate``);
* a **conflicting copy** otherwise: it is not merged and not dropped silently, it becomes a row
  of the ``conflicts/`` area (``conflict``) beside the kept first version.

The first copy in offset order wins, as in the reorder worker.

Decisions are made when a record is read (:meth:`Deduper.check`) against

1. the rows accepted but not yet flushed (kept in memory, *pinned*: bounded by the open
   batches, which are bounded by ``target_object_bytes``), and
2. every row already written to the store, loaded lazily per episode through the episode
   index (``index/date=D/task=T``) of the record's UTC day and the days either side, reading
   only the row groups the index names (columns ``seq, event_digest`` and the Kafka position).

Memory is bounded: at most ``max_keys`` seqs of flushed rows stay cached (least recently used
episodes are evicted and reloaded from the store when needed) plus the pinned rows; at most
``index_cache_entries`` (day, task) index summaries are cached.

Crash safety: a row in the store counts only if it was *committed or flushed in this
assignment*: rows of the same (topic, partition) at offsets at or after the first offset not
yet flushed (:meth:`Deduper.assigned` sets it to the committed offset) belong to an upload
that was not committed and will be overwritten by its replay, so they are ignored. Decisions
for a replayed batch therefore depend only on the rows before it, as they did the first time.

The decision context (decisions, alerts, dead letters: topics archived into other data areas,
``areas``) has no per-episode sequence: there an event is identified by
``(kafka_topic, task, sandbox, episode, event_id)`` (:func:`event_identity` stands in for the
seq; the processors derive event ids deterministically, so a re-published output has the same
id), looked up through that area's own index.

Not covered (documented in archive/README.md): two copies of one event on *different*
partitions (only if a topic's partition count changed, or a record was re-keyed) archived by
two archiver processes at the same moment.
"""

from __future__ import annotations

import functools
import hashlib
import logging
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from enum import Enum

import pyarrow.compute as pc
import pyarrow.parquet as pq

from trajbus.archive import layout
from trajbus.archive.storage import ObjectNotFoundError, ObjectStore
from trajbus.bus.digest import DIGEST_SIZE as DIGEST_SIZE  # the digest: re-exported
from trajbus.bus.digest import content_digest as content_digest

log = logging.getLogger(__name__)

DAY_MS = 86_400_000
TP = tuple[str, int]
EKey = tuple[str, str, str, str | None]  # (topic, task, sandbox, episode)
Ref = tuple[str, int, int]  # (object key, first row group, last row group)


def event_identity(event_id: str) -> int:
    """What identifies a decision-context record within its (task, sandbox, episode) in place
    of a seq: blake2b-64 of its event id (a 64-bit collision between two ids of one sandbox's
    context is ignored)."""
    return int.from_bytes(hashlib.blake2b(event_id.encode(), digest_size=8).digest(), "little")


def to_signed(digest: int) -> int:
    """The unsigned 64-bit digest as the int64 stored in ``event_digest`` (two's complement)."""
    return digest - (1 << 64) if digest >= 1 << 63 else digest


def from_signed(value: int) -> int:
    return value + (1 << 64) if value < 0 else value


@functools.lru_cache(maxsize=4096)
def day_name(day: int) -> str:
    return datetime.fromtimestamp(day * 86_400, tz=UTC).strftime("%Y-%m-%d")


class Verdict(Enum):
    NEW = "new"
    DUPLICATE = "duplicate"
    CONFLICT = "conflict"


@dataclass(slots=True)
class _Episode:
    seqs: dict[int, int] = field(default_factory=dict)  # seq -> unsigned digest (0: unknown)
    days: set[int] = field(default_factory=set)  # days whose archived rows are loaded
    refs: set[Ref] = field(default_factory=set)  # object row-group ranges already read
    pinned_upto: int = -1  # highest offset of an accepted, not yet flushed row; -1: none


@dataclass
class DedupeStats:
    duplicates: int = 0
    conflicts: int = 0
    loads: int = 0  # episodes (re)loaded from the store
    evictions: int = 0


class Deduper:
    """First-copy-wins decisions per (topic, partition). Not thread-safe (the shell's thread)."""

    def __init__(self, store: ObjectStore, *, max_keys: int = 2_000_000,
                 index_cache_entries: int = 64,
                 areas: Mapping[str, str] | None = None) -> None:
        """``areas``: the data area of each topic archived outside ``events`` (a topic not
        named is in ``events``); their records are identified by event id."""
        self.store = store
        self.areas = dict(areas or {})
        self.max_keys = max_keys
        self.index_cache_entries = index_cache_entries
        self._eps: OrderedDict[tuple[str, int, str, str, str | None], _Episode] = OrderedDict()
        self._keys = 0  # seqs held by unpinned episodes... and pinned ones (all cached seqs)
        self._pinned: dict[TP, dict[tuple[str, int, str, str, str | None], _Episode]] = {}
        self._boundary: dict[TP, int] = {}  # first offset not yet flushed, per partition
        self._index: OrderedDict[tuple[str, str, str],
                                 dict[tuple[str, str | None], list[Ref]]] = OrderedDict()
        self.stats = DedupeStats()
        self._evict_blocked = False  # everything left is pinned: retry after the next flush

    # -- partition lifecycle ---------------------------------------------------------------
    def assigned(self, topic: str, partition: int, next_offset: int) -> None:
        """(Re)assignment: consumption resumes at ``next_offset`` (the committed offset).
        Forget the partition's cached state and every cached index summary (another archiver
        may have written meanwhile)."""
        self.revoked(topic, partition)
        self._boundary[(topic, partition)] = next_offset
        self._index.clear()

    def revoked(self, topic: str, partition: int) -> None:
        tp = (topic, partition)
        self._boundary.pop(tp, None)
        self._pinned.pop(tp, None)
        for k in [k for k in self._eps if k[0] == topic and k[1] == partition]:
            self._keys -= len(self._eps.pop(k).seqs)

    def flushed(self, topic: str, partition: int, last_offset: int,
                index_refs: list[tuple[str, str, str, str | None, Ref]]) -> None:
        """Rows up to ``last_offset`` are written; ``index_refs`` are the (day name, task,
        sandbox, episode, ref) of the index rows written for them."""
        tp = (topic, partition)
        self._boundary[tp] = last_offset + 1
        pinned = self._pinned.get(tp)
        if pinned:
            for k in [k for k, ep in pinned.items() if ep.pinned_upto <= last_offset]:
                pinned.pop(k).pinned_upto = -1
        area = self.areas.get(topic, "events")
        for date, task, sandbox, episode, ref in index_refs:
            cached = self._index.get((area, date, task))
            if cached is not None:
                cached.setdefault((sandbox, episode), []).append(ref)
            # the rows are in memory already: do not read them back
            ep = self._eps.get((topic, partition, task, sandbox, episode))
            if ep is not None:
                ep.refs.add(ref)
        self._evict_blocked = False
        if self._keys > self.max_keys:
            self._evict()

    # -- the decision ----------------------------------------------------------------------
    def check(self, topic: str, partition: int, offset: int, task: str, sandbox: str,
              episode: str | None, seq: int, digest: int, event_time_ms: int) -> Verdict:
        """Decide for one record; a ``NEW`` record is remembered (pinned until flushed)."""
        k = (topic, partition, task, sandbox, episode)
        ep = self._eps.get(k)
        if ep is None:
            ep = self._eps[k] = _Episode()
        else:
            self._eps.move_to_end(k)
        day = event_time_ms // DAY_MS
        if day not in ep.days:
            self._load(k, ep, day)
        have = ep.seqs.get(seq)
        if have is not None:
            if have == 0 or have == digest:
                self.stats.duplicates += 1
                return Verdict.DUPLICATE
            self.stats.conflicts += 1
            return Verdict.CONFLICT
        ep.seqs[seq] = digest
        self._keys += 1
        if ep.pinned_upto < 0:
            self._pinned.setdefault((topic, partition), {})[k] = ep
        ep.pinned_upto = offset
        if self._keys > self.max_keys and not self._evict_blocked:
            self._evict()
        return Verdict.NEW

    # -- internals -------------------------------------------------------------------------
    def _evict(self) -> None:
        """Evict least recently used unpinned episodes down to 90% of ``max_keys``."""
        low = self.max_keys * 9 // 10
        budget = len(self._eps)
        while self._keys > low and budget > 0:
            budget -= 1
            k, ep = self._eps.popitem(last=False)
            if ep.pinned_upto >= 0:  # holds unflushed rows: not reloadable, keep it
                self._eps[k] = ep
                continue
            self._keys -= len(ep.seqs)
            self.stats.evictions += 1
        self._evict_blocked = self._keys > self.max_keys

    def _load(self, k: tuple[str, int, str, str, str | None], ep: _Episode, day: int) -> None:
        """Merge the archived rows of the episode found in the index of ``day`` and the days
        either side (a conflicting copy may carry another event time)."""
        topic, partition, task, sandbox, episode = k
        area = self.areas.get(topic, "events")
        boundary = self._boundary.get((topic, partition), 1 << 62)
        loaded = False
        for d in (day - 1, day, day + 1):
            if d in ep.days:
                continue
            for attempt in range(2):
                try:
                    refs = self._index_refs(area, day_name(d), task).get((sandbox, episode),
                                                                          [])
                    for ref in refs:
                        if ref not in ep.refs:
                            self._read_ref(ep, ref, topic, partition, boundary, sandbox, episode,
                                           by_event_id=area != "events")
                            ep.refs.add(ref)
                            loaded = True
                    break
                except (FileNotFoundError, ObjectNotFoundError):
                    # compacted away under us: the index summary is stale, reload it once
                    self._index.pop((area, day_name(d), task), None)
                    if attempt == 1:
                        raise
            ep.days.add(d)
        if loaded:
            self.stats.loads += 1

    def _read_ref(self, ep: _Episode, ref: Ref, topic: str, partition: int, boundary: int,
                  sandbox: str, episode: str | None, by_event_id: bool = False) -> None:
        key, lo, hi = ref
        with self.store.open_input(key) as f:
            pf = pq.ParquetFile(f)
            names = set(pf.schema_arrow.names)
            cols = [c for c in ("sandbox", "episode", "seq", "event_id", "event_digest",
                                "kafka_topic",
                                "kafka_partition", "kafka_offset") if c in names]
            t = pf.read_row_groups(list(range(lo, hi + 1)), columns=cols)
        mask = pc.equal(t.column("sandbox"), sandbox)
        ep_col = t.column("episode")
        mask = pc.and_(mask, pc.is_null(ep_col) if episode is None
                       else pc.equal(ep_col, episode))
        t = t.filter(mask)
        digests = (t.column("event_digest").to_pylist() if "event_digest" in names
                   else [None] * t.num_rows)
        idents = ([event_identity(e or "") for e in t.column("event_id").to_pylist()]
                  if by_event_id else t.column("seq").to_pylist())
        for seq, dg, top, part, off in zip(idents, digests,
                                           t.column("kafka_topic").to_pylist(),
                                           t.column("kafka_partition").to_pylist(),
                                           t.column("kafka_offset").to_pylist(), strict=True):
            if top != topic:
                continue  # events are identified per topic
            if part == partition and off >= boundary:
                continue  # an uncommitted upload: its replay overwrites it
            if seq not in ep.seqs:
                ep.seqs[seq] = 0 if dg is None else from_signed(dg)
                self._keys += 1

    def _index_refs(self, area: str, date: str, task: str
                    ) -> dict[tuple[str, str | None], list[Ref]]:
        key = (area, date, task)
        cached = self._index.get(key)
        if cached is not None:
            self._index.move_to_end(key)
            return cached
        out: dict[tuple[str, str | None], list[Ref]] = {}
        index_area = layout.index_area(area)
        for info in self.store.list(f"{index_area}/date={date}/task={task}/"):
            p = layout.parse_object_key(info.key)
            if p is None or p.area != index_area:
                continue
            try:
                with self.store.open_input(info.key) as f:
                    t = pq.read_table(f, columns=["sandbox", "episode", "row_group_first",
                                                  "row_group_last"])
            except (FileNotFoundError, ObjectNotFoundError):
                continue  # deleted (compaction purge) while listing
            obj = p.events_key
            for sb, e, lo, hi in zip(*(t.column(c).to_pylist() for c in t.column_names),
                                     strict=True):
                out.setdefault((sb, e), []).append((obj, lo, hi))
        self._index[key] = out
        while len(self._index) > self.index_cache_entries:
            self._index.popitem(last=False)
        return out
