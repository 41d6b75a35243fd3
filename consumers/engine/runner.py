"""The imperative shell shared by every stream processor (reorder, watchdog, scheduler).

A processor is a pure core behind a :class:`Processor` adapter. The runner feeds it records
and persists its outputs and state with Kafka transactions:

    consume batch -> core.handle(...) -> outputs + dirty state + input offsets
                  -> ONE transaction: output records, state changelog records, offsets

Guarantee: a batch's outputs, the state they leave behind and the input offsets that produced
them become visible together or not at all (consumers of our outputs read ``read_committed``).
A worker killed at any point restarts from the last committed offsets with the state of that
same moment, so it re-derives exactly the outputs that were lost, never a second copy of a
committed one. (Across a rebalance between two *live* workers, a fenced-out zombie can still
commit once more; every output carries a deterministic event id and downstream dedupes by
(episode, seq), so such a duplicate is recognisable and dropped.)

Time: cores never read the clock. Each runner's ticker publishes :class:`Tick` events into its
input partitions, so ticks are part of the log and an offline replay makes the same decisions.

Why not a faust agent: faust-streaming's ``exactly_once`` logs and swallows transaction errors
(STACK-NOTES.md, faust #517/#177), its timers cannot be driven by a test, and an earlier faust
engine lost events after a SIGKILL (README, "Design"). This loop is explicit aiokafka with the
same table-plus-changelog recovery model.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import ctypes.util
import gc
import logging
import re
import threading
import time
from collections import deque
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, NamedTuple, Protocol

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, ConsumerRebalanceListener, TopicPartition
from aiokafka.cluster import ClusterMetadata
from aiokafka.coordinator.assignors.range import RangePartitionAssignor
from aiokafka.coordinator.protocol import (
    ConsumerProtocolMemberAssignment,
    ConsumerProtocolMemberMetadata,
)
from aiokafka.errors import (
    KafkaConnectionError,
    KafkaError,
    KafkaTimeoutError,
    UnknownTopicOrPartitionError,
)

from trajbus.bus.admin import (
    TOPIC_SETUP_PATIENCE_S,
    ensure_topics,
    leave_group_as_static_member,
)
from trajbus.bus.closing import close_client
from trajbus.bus.kafka import (
    BrokerUnavailableError,
    broker_went_away,
    check_broker,
    connection_options,
    lasting_delivery_error,
    retry_while_broker_restarts,
    sender_crash,
)
from trajbus.bus.ops import export_lag
from trajbus.bus.producer import producer_options
from trajbus.bus.settings import Settings
from trajbus.bus.topics import Topics, TopicSpec
from trajbus.consumers.engine import metrics
from trajbus.schemas.models import Envelope, Tick

log = logging.getLogger("trajbus.runner")
# What an operator must see without -v (takeovers, reconnections): INFO even when the rest of
# the worker's log is at WARNING (consumers/engine/cli.py).
ops_log = logging.getLogger("trajbus.ops")
TICK_KEY = b"_tick"
_MAX_IDLE_S = 10.0
PASS_MARKERS_AFTER_S = 2.0
"""An input partition's position is committed past what holds no record (a transaction's
commit marker, aborted records) after this long without input other than ticks (see
``_commit_passed``)."""
_STATS_S = 10.0
_STATS = ("batches", "records", "outputs", "changelog", "poll_s", "handle_s", "txn_s",
          "txn_max_ms", "age_ms", "age_max_ms", "between_polls_max_ms")


class InRecord(NamedTuple):
    """One input record (a tuple: built once per record, at a third of a frozen dataclass's
    cost)."""

    topic: str
    partition: int
    offset: int
    key: bytes | None
    value: bytes
    timestamp_ms: int


@dataclass(frozen=True, slots=True)
class OutRecord:
    topic: str
    key: bytes | None
    value: bytes
    partition: int | None = None


class Processor(Protocol):
    """A pure core plus its encoding. One instance serves one input partition (or all of them
    for a global processor such as the scheduler).

    Optional: ``handle_batch(records) -> list[OutRecord]``, the records of one transaction
    in log order; the runner calls it instead of :meth:`handle` when present, so an adapter
    can coalesce outputs (the reorder adapter writes one segment per episode per batch)."""

    def handle(self, record: InRecord) -> list[OutRecord]: ...

    def tick(self, now_ms: int) -> list[OutRecord]: ...

    def take_dirty(self) -> dict[str, bytes | None]: ...

    def restore(self, key: str, blob: bytes | None) -> None: ...


@dataclass
class ProcessorSpec:
    """How to run one processor kind."""

    name: str  # "reorder", "watchdog", "scheduler"
    input_topics: list[str]
    factory: Callable[[], Processor]
    output_topics: Callable[[], Iterable[TopicSpec]] = lambda: ()
    global_state: bool = False  # True: one core for every partition (requires one worker)
    input_pattern: str | None = None  # also consume topics matching this regex
    tick_topics: list[str] | None = None  # where the ticker writes (default: input_topics)
    # True: records of all input partitions are processed in one deterministic order, merged
    # by record timestamp (the order `trajbus replay explain` re-creates from the log).
    ordered: bool = False
    extra_topics: list[TopicSpec] = field(default_factory=list)


# A restore reads the whole changelog partition: the compacted part (the live keys, and the
# tombstones of deleted keys, kept delete.retention.ms after the cleaner first reached them),
# the closed segments the cleaner has not reached yet, and the active segment, which Kafka never
# compacts. Kafka's defaults (1 GiB / 7 days segments, tombstones a day) made a restore after
# hours of history read millions of records (bench/bench_restore_history.py: 0.9-3.7 million,
# 10-25 s, for 20,000 open episodes at load A; SCALING.md section 8). So: segments as small as
# the largest record batch allows (changelog_configs raises SEGMENT_FLOOR_BYTES to that batch
# plus 1 MiB: a batch must fit in a segment, and a state record may be as large as the topic's
# max.message.bytes; ~10 MiB with the default 8 MiB records), rolled at the latest after 10
# minutes, cleaned once 10% is dirty (with a compacted part this small, any closed segment is)
# and at most 15 minutes after a write; tombstones go 3 minutes after their first cleaning,
# ~30x the longest restore measured under load (SCALING.md section 8: 16 MiB segments and 10
# minutes of tombstones left the worst case, a kill right after a roll, at 5.2 s). Existing
# changelogs keep the configs they were created with (ensure_topics does not alter them):
# `kafka-configs --alter` to apply these.
SEGMENT_FLOOR_BYTES = 4 * 1024 * 1024
CHANGELOG_CONFIGS = {
    "segment.ms": str(10 * 60_000),
    "segment.bytes": str(SEGMENT_FLOOR_BYTES),
    "min.cleanable.dirty.ratio": "0.1",
    "max.compaction.lag.ms": str(15 * 60_000),
    "delete.retention.ms": str(3 * 60_000),
}


def changelog_configs(max_batch_bytes: int) -> dict[str, str]:
    """:data:`CHANGELOG_CONFIGS`, with segments large enough for the largest record batch the
    runner may write (the broker refuses a batch larger than a segment)."""
    seg = max(int(CHANGELOG_CONFIGS["segment.bytes"]), max_batch_bytes + 1024 * 1024)
    return {**CHANGELOG_CONFIGS, "segment.bytes": str(seg)}


# How long a restore waits for a transaction pending on a state partition to complete. A
# committed transaction's markers land in milliseconds; one pending longer belongs to an owner
# that died mid-transaction (RELIABILITY.md, finding P).
RESTORE_PENDING_TXN_WAIT_S = 5.0
# A restore whose reads get no answer for this long gives up (the broker is gone for good, or
# for longer than a restart); the worker's supervisor restarts the processor.
RESTORE_STALL_S = 60.0
CLIENT_CLOSE_S = 15.0
# On a stop, how long the in-flight transaction may take to complete, and the ticker's
# producer to close. With the broker away neither ever would: the transaction is then left to
# the broker to abort (its offsets were not committed, so the next owner processes its inputs
# again, exactly once) and the undelivered ticks are dropped (the next tick tells the time).
# A worker told to stop during an outage exits in seconds, not at the hard deadline.
SETTLE_ON_STOP_S = 10.0
TICKER_CLOSE_S = 2.0
CANCEL_WAIT_S = 2.0  # for a cancelled transaction or close to end before it is left behind


async def _give_up(task: asyncio.Future[Any]) -> None:
    """Cancel ``task`` and wait for it at most ``CANCEL_WAIT_S``: a cancelled transaction or
    client close can go on waiting for a broker that is away (an abort). Its outcome is moot,
    and must not be logged as "exception was never retrieved" when it ends later."""
    def retrieve(t: asyncio.Future[Any]) -> None:
        if not t.cancelled():
            t.exception()

    task.cancel()
    task.add_done_callback(retrieve)
    await asyncio.wait({task}, timeout=CANCEL_WAIT_S)


#: How long one offset lookup may wait for a partition's leader before it is asked again with
#: fresh metadata: aiokafka's own lookup waits out request_timeout_ms (30 s) when the leader it
#: knows is shutting down or dead, so a restore during a rolling restart stalled 42 s.
OFFSET_LOOKUP_TRY_S = 5.0


async def _offsets_riding_out_failover(
        lookup: Callable[[list[TopicPartition]], Awaitable[dict[TopicPartition, int]]],
        tps: list[TopicPartition], consumer: AIOKafkaConsumer) -> dict[TopicPartition, int]:
    """``lookup(tps)`` (a consumer's beginning/end offsets), tried again with fresh metadata
    every ``OFFSET_LOOKUP_TRY_S`` while partition leaders move; a lookup still unanswered
    after ``TOPIC_SETUP_PATIENCE_S`` raises :class:`KafkaTimeoutError`."""
    deadline = time.monotonic() + TOPIC_SETUP_PATIENCE_S
    while True:
        try:
            return await asyncio.wait_for(lookup(tps), OFFSET_LOOKUP_TRY_S)
        except (TimeoutError, KafkaTimeoutError):
            if time.monotonic() > deadline:
                raise KafkaTimeoutError(
                    f"offsets of {len(tps)} partitions not answered for "
                    f"{TOPIC_SETUP_PATIENCE_S:.0f} s") from None
            with contextlib.suppress(KafkaError, TimeoutError):
                await asyncio.wait_for(consumer._client.force_metadata_update(),
                                       OFFSET_LOOKUP_TRY_S)


class RestoreInterrupted(KafkaConnectionError):
    """A restore lost the broker while reading the changelog (a restart). It is retried;
    being a connection error, a processor that still fails of it is restarted
    (consumers/engine/supervisor.py)."""


class RestoreAborted(Exception):
    """The restore was called off (its partitions revoked, the runner stopping)."""


def _lasting_failure(deliveries: list[asyncio.Future[Any]]) -> BaseException | None:
    """Drop the settled deliveries from ``deliveries`` (reading their errors, which asyncio
    would otherwise log one by one), and return the last error a retry of the same producer
    cannot cure (:func:`~trajbus.bus.kafka.lasting_delivery_error`), if any."""
    lasting: BaseException | None = None
    pending = []
    for fut in deliveries:
        if not fut.done():
            pending.append(fut)
        elif not fut.cancelled() and (exc := fut.exception()) is not None:
            if lasting_delivery_error(exc):
                lasting = exc
    deliveries[:] = pending
    return lasting


def _return_freed_memory() -> None:
    """After a restore: give the memory the restore read through (every changelog record,
    most of them superseded) back to the OS. glibc keeps freed heap memory for reuse, so a
    restarted worker's RSS stayed well above its state's (x1.7 with 20,000 open episodes,
    bench_recovery); ``malloc_trim`` returns it. A no-op where glibc is not the allocator."""
    gc.collect()
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.malloc_trim(0)
    except (OSError, AttributeError):
        pass


class OneMemberAssignor(RangePartitionAssignor):
    """Every partition to one member of the group: the first by member id (a static member's
    id starts with its instance id, so the worker with the smallest --worker-id). A processor
    with global state (the scheduler) must see all its input in one core; with the range
    assignor a second worker started with the default processors split the scheduler's input
    and wrote the same state partition from two cores. The other members stand by with
    nothing assigned, and one of them takes over when the first leaves or dies."""

    name = "trajbus-one-member"

    @classmethod
    def assign(cls, cluster: ClusterMetadata,
               members: Mapping[str, ConsumerProtocolMemberMetadata]
               ) -> dict[str, ConsumerProtocolMemberAssignment]:
        first = min(members)
        topics = sorted({t for meta in members.values() for t in meta.subscription})
        mine = [(t, sorted(cluster.partitions_for_topic(t) or ())) for t in topics]
        return {member: ConsumerProtocolMemberAssignment(
                    cls.version, mine if member == first else [], b"")
                for member in members}


def group_assignors(global_state: bool) -> tuple[type[RangePartitionAssignor], ...]:
    """The partition assignors a processor's consumer offers its group: range (partition p of
    every input topic to the same member), or :class:`OneMemberAssignor` for a processor with
    global state.

    Exactly one each: aiokafka 0.14 sends one JoinGroup per listed assignor, each with the
    protocols listed so far (aio-libs/aiokafka#1168). With two, once one member waits in a
    join with both protocols while the other joins with the first (a worker killed between
    its two JoinGroups and restarted with the same --worker-id does that), each one's second
    JoinGroup differs from what the coordinator holds for it and forces a new rebalance, and
    the members take turns at that with no end and no owner. A worker of a version that
    offered range alone cannot share a scheduler group with this one (the coordinator refuses
    the later one's join as inconsistent): stop it first; range split the scheduler's state
    anyway."""
    return (OneMemberAssignor,) if global_state else (RangePartitionAssignor,)


def reusable_slots(parked: Mapping[int, Mapping[TopicPartition, int | None]],
                   assigned: Mapping[int, Iterable[TopicPartition]],
                   committed: Mapping[TopicPartition, int | None]) -> set[int]:
    """The core slots a worker may keep across a rebalance without a restore.

    ``parked`` holds, per slot whose core the worker set aside when its partitions were
    revoked, the group's committed offset of each of those input partitions at that moment
    (every processed batch was committed before letting go). A parked core is exactly the
    committed state of its slot iff the slot comes back with the same input partitions and
    none of their committed offsets moved meanwhile: a move means another member processed
    (and committed) records of the slot, so only the changelog has the current state."""
    keep = set()
    for slot, tps in assigned.items():
        before = parked.get(slot)
        if before is None or set(tps) != set(before):
            continue
        if all(committed.get(tp) == offset for tp, offset in before.items()):
            keep.add(slot)
    return keep


class _Rebalance(ConsumerRebalanceListener):
    def __init__(self, runner: Runner) -> None:
        self.runner = runner

    async def on_partitions_revoked(self, revoked: list[TopicPartition]) -> None:
        await self.runner.quiesce()  # the in-flight transaction finishes before we let go
        await self.runner.cancel_restore()
        self.runner.park(revoked)

    async def on_partitions_assigned(self, assigned: list[TopicPartition]) -> None:
        await self.runner.restore(assigned)


class Runner:
    """Runs one processor kind in a consumer group with transactional outputs and state."""

    def __init__(self, settings: Settings, spec: ProcessorSpec, worker_id: str = "w0") -> None:
        self.settings = settings
        self.spec = spec
        self.worker_id = worker_id
        self.topics = Topics(settings)
        prefix = settings.topics.prefix
        self.group_id = f"{prefix}.{spec.name}"
        self.changelog = f"{prefix}.{spec.name}.state"
        self.cores: dict[int, Processor] = {}
        # Across a rebalance (aiokafka's is eager: every partition is revoked, then the new
        # assignment given), the cores of revoked partitions wait here with the committed
        # offsets of their inputs; those assigned back unchanged are kept, not restored.
        self._parked: dict[int, tuple[Processor, dict[TopicPartition, int | None]]] = {}
        # The group's committed offset of each assigned input partition, as this worker left
        # it: read at assignment, then advanced by each of its transactions.
        self._committed: dict[TopicPartition, int | None] = {}
        # Partitions newly assigned beside kept ones are restored by this task while the kept
        # ones keep flowing (they are paused until their cores are built).
        self._restoring: asyncio.Task[None] | None = None
        # Set to call off the restores running in their threads (cancelling the task awaiting
        # a thread does not stop the thread, and a process waits for its threads at exit);
        # each restore takes the event current at its start (cancel_restore replaces it).
        self._abort_restore = threading.Event()
        self.stopping = asyncio.Event()
        self.idle_batches = 0
        self.processed = 0
        self.started = False  # its clients started: it got past start-up (see run)
        # Input partitions of the last assignment, once restored (None: none yet): /readyz
        self.assigned: list[TopicPartition] | None = None
        for outcome in ("committed", "aborted", "failed"):  # shown as 0 from the start
            metrics.TRANSACTIONS.labels(spec.name, outcome)
        metrics.RESTORED_RECORDS.labels(spec.name)
        metrics.PROCESSOR_RESTARTS.labels(spec.name)
        self._consumer: AIOKafkaConsumer | None = None
        self._producer: AIOKafkaProducer | None = None
        self._known_topics: set[str] = set()
        self._lock = asyncio.Lock()
        # The transaction of the previous batch, still committing while the next batch is
        # fetched and processed (see _process).
        self._inflight: asyncio.Task[None] | None = None
        self._pending: dict[TopicPartition, deque[Any]] = {}
        self._empty_since: dict[TopicPartition, float] = {}
        self._warned_silent: set[TopicPartition] = set()  # said once per silence (_release)
        # Where a busy worker's time goes, logged (INFO) every _STATS_S while records flow.
        self._stats: dict[str, float] = dict.fromkeys(_STATS, 0.0)
        self._stats_since = time.monotonic()

    # -- state --------------------------------------------------------------------------
    def _slot(self, partition: int) -> int:
        return 0 if self.spec.global_state else partition

    def park(self, revoked: Iterable[TopicPartition]) -> None:
        """Let go of revoked partitions (after :meth:`quiesce`: all they produced is
        committed). Their cores are set aside until the next assignment says whether they come
        back unchanged (:meth:`restore`)."""
        revoked = list(revoked)
        for tp in revoked:
            self._pending.pop(tp, None)  # unfinished records are fetched again by the owner
            self._empty_since.pop(tp, None)
            self._warned_silent.discard(tp)
        by_slot: dict[int, dict[TopicPartition, int | None]] = {}
        for tp in revoked:
            by_slot.setdefault(self._slot(tp.partition), {})[tp] = self._committed.pop(tp, None)
        for slot, offsets in by_slot.items():
            core = self.cores.pop(slot, None)
            if core is not None:
                self._parked[slot] = (core, offsets)

    async def restore(self, assigned: Iterable[TopicPartition]) -> None:
        """Serve newly assigned partitions: keep each parked core that comes back exactly as
        committed (:func:`reusable_slots`), rebuild the others from the committed changelog."""
        assigned = list(assigned)
        async with self._lock:  # never while a batch is being processed
            await self._wait_inflight()  # its state must be in the changelog we read
            committed = await self._fetch_committed(assigned)
            by_slot: dict[int, list[TopicPartition]] = {}
            for tp in assigned:
                by_slot.setdefault(self._slot(tp.partition), []).append(tp)
            keep = reusable_slots({s: offsets for s, (_, offsets) in self._parked.items()},
                                  by_slot, committed)
            for slot in keep:
                self.cores[slot] = self._parked[slot][0]
            if keep:
                log.info("%s: kept the state of partitions %s across the rebalance (no "
                         "restore)", self.spec.name, sorted(keep))
            self._parked.clear()  # not kept: another member has them, or they moved on
            new = sorted({tp.partition for tp in assigned
                          if self._slot(tp.partition) not in keep})
            ops_log.info("%s (%s): assigned %d input partitions %s; taking over %s",
                         self.spec.name, self.instance_id, len(assigned),
                         _partitions_text(assigned), new if new else "none (all kept)")
            self._committed.update(committed)
            todo = [tp for tp in assigned if self._slot(tp.partition) not in self.cores]
            if todo and keep and self._consumer is not None and not self.spec.ordered:
                # A restore takes its time (~0.1 s per 15k records); meanwhile the kept
                # partitions go on. The new ones are paused, so nothing of them is processed
                # before their cores exist.
                self._consumer.pause(*todo)
                self._restoring = asyncio.create_task(self._restore_then_resume(todo))
                log.info("%s: restoring partitions %s while serving the kept ones",
                         self.spec.name, sorted({tp.partition for tp in todo}))
            else:
                await self._restore(assigned)
            self.assigned = assigned
            metrics.ASSIGNED_PARTITIONS.labels(self.spec.name).set(len(assigned))

    def ready(self) -> tuple[bool, dict[str, Any]]:
        """For /readyz: clients started, group joined, partitions assigned and restored."""
        restoring = self._restoring is not None and not self._restoring.done()
        ok = self.started and self.assigned is not None and not restoring \
            and not self.stopping.is_set()
        return ok, {"started": self.started, "stopping": self.stopping.is_set(),
                    "assigned_partitions": None if self.assigned is None
                    else len(self.assigned), "restoring": restoring}

    async def _restore_then_resume(self, tps: list[TopicPartition]) -> None:
        await self._restore(tps)
        assert self._consumer is not None
        assigned = self._consumer.assignment()
        self._consumer.resume(*[tp for tp in tps if tp in assigned])

    async def cancel_restore(self) -> None:
        """Stop a restore still running (its partitions are being revoked)."""
        task, self._restoring = self._restoring, None
        if task is not None and not task.done():
            # the thread ends at its next check; a later restore gets an event of its own
            self._abort_restore.set()
            self._abort_restore = threading.Event()
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, RestoreAborted):
                await task

    def _check_restore(self) -> bool:
        """True while a restore runs; raises if one failed (the worker stops, as after any
        failure, and a restart restores again)."""
        task = self._restoring
        if task is None:
            return False
        if not task.done():
            return True
        self._restoring = None
        task.result()
        return False

    async def _fetch_committed(self, tps: list[TopicPartition]
                               ) -> dict[TopicPartition, int | None]:
        """The group's committed offset of each partition (None: never committed)."""
        if self._consumer is None or not tps:  # a restore driven without the group (tests)
            return {}
        consumer = self._consumer
        offsets = await asyncio.gather(*(consumer.committed(tp) for tp in tps))
        return dict(zip(tps, offsets, strict=True))

    async def quiesce(self) -> None:
        """Wait until no batch is being processed and no transaction is in flight (before a
        rebalance hands partitions to another worker). A failed transaction is left for the
        main loop to raise."""
        async with self._lock:
            await self._wait_inflight()

    async def _wait_inflight(self) -> None:
        task = self._inflight
        if task is not None and not task.done():
            await asyncio.wait([task])

    async def _settle(self) -> None:
        """Wait for the in-flight transaction; raise if it failed."""
        task, self._inflight = self._inflight, None
        if task is not None:
            await task

    async def _settle_unless_stopping(self) -> bool:
        """:meth:`_settle`, or False as soon as the runner is told to stop while the in-flight
        transaction is still pending (it stays in flight, for the stop to deal with)."""
        task = self._inflight
        if task is not None and not task.done() and not self.stopping.is_set():
            stop = asyncio.ensure_future(self.stopping.wait())
            try:
                await asyncio.wait({task, stop}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                stop.cancel()
        if task is not None and not task.done():
            return False
        await self._settle()
        return True

    async def _restore(self, assigned: Iterable[TopicPartition]) -> None:
        """Build the cores of the assigned slots that have none from the committed changelog.
        The reading and building run in a thread with an event loop of its own: a restore is
        CPU work (~0.4 s for 50k records), and the worker's loop goes on serving the partitions
        it kept meanwhile (see :meth:`restore`)."""
        slots = sorted({self._slot(tp.partition) for tp in assigned} - set(self.cores))
        if not slots:
            return
        started = time.monotonic()
        fresh, restored = await asyncio.to_thread(self._restore_in_thread, slots,
                                                  self._abort_restore)
        self.cores.update(fresh)
        took = time.monotonic() - started
        metrics.RESTORE_SECONDS.labels(self.spec.name).observe(took)
        metrics.RESTORED_RECORDS.labels(self.spec.name).inc(restored)
        ops_log.info("%s: restored %d state records for partitions %s in %.2fs",
                     self.spec.name, restored, slots, took)

    def _restore_in_thread(self, slots: list[int], abort: threading.Event
                           ) -> tuple[dict[int, Processor], int]:
        latest, restored = asyncio.run(self._read_changelog_retrying(slots, abort))
        gc.collect()  # the fetched records: gone before the cores are built
        fresh = {s: self.spec.factory() for s in slots}
        for slot in slots:
            values = latest.pop(slot)
            core = fresh[slot]
            for key, value in values.items():
                core.restore(key, value)
            values.clear()
        _return_freed_memory()
        return fresh, restored

    async def _read_changelog_retrying(self, slots: list[int], abort: threading.Event
                                       ) -> tuple[dict[int, dict[str, bytes | None]], int]:
        """:meth:`_read_changelog`, read again from the start if the broker went away
        meanwhile (a restart during a restore stopped a worker in the soak of 2026-12-02),
        for up to ``TOPIC_SETUP_PATIENCE_S``."""
        async def attempt() -> tuple[dict[int, dict[str, bytes | None]], int]:
            try:
                return await self._read_changelog(slots, abort)
            except asyncio.CancelledError as exc:
                # Nothing cancels this thread's loop but aiokafka itself (a fetch task
                # cancelled as its connection closed): an interruption, not a request to stop
                if abort.is_set():
                    raise RestoreAborted(f"{self.spec.name}: restore called off") from exc
                raise RestoreInterrupted(f"{self.spec.name}: restore interrupted "
                                         "(the broker connection closed)") from exc
            except KafkaError as exc:
                if broker_went_away(exc) and not isinstance(exc, KafkaConnectionError):
                    raise RestoreInterrupted(f"{self.spec.name}: restore interrupted "
                                             f"({type(exc).__name__}: {exc})") from exc
                raise

        return await retry_while_broker_restarts(
            attempt, transient=(KafkaConnectionError,),
            patience_s=lambda: 0.0 if abort.is_set() else TOPIC_SETUP_PATIENCE_S,
            what=f"{self.spec.name}: restore")

    async def _start_restore_consumer(self) -> AIOKafkaConsumer:
        """A consumer of the changelog. A restore can begin while the broker is restarting
        (a rebalance during an outage; the soak of 2026-12-01 lost a worker this way): its
        bootstrap is retried for up to ``TOPIC_SETUP_PATIENCE_S``, as topic set-up is."""
        async def start() -> AIOKafkaConsumer:
            consumer = AIOKafkaConsumer(
                **connection_options(self.settings.kafka),
                isolation_level="read_committed",
                enable_auto_commit=False,
                auto_offset_reset="earliest",  # "latest" could race the explicit seek below
                client_id=f"{self.group_id}-restore",
            )
            try:
                await consumer.start()
            except KafkaConnectionError:
                with contextlib.suppress(Exception):
                    await close_client(consumer, "restore consumer")
                raise
            return consumer

        return await retry_while_broker_restarts(
            start, transient=(KafkaConnectionError,),
            patience_s=lambda: TOPIC_SETUP_PATIENCE_S, what=f"{self.spec.name}: restore")

    async def _read_changelog(self, slots: list[int], abort: threading.Event
                              ) -> tuple[dict[int, dict[str, bytes | None]], int]:
        """The latest value of each key of the slots' changelog partitions, and how many
        records were read."""
        consumer = await self._start_restore_consumer()
        restored = 0
        try:
            tps = [TopicPartition(self.changelog, s) for s in slots]
            consumer.assign(tps)
            begin = await _offsets_riding_out_failover(consumer.beginning_offsets, tps, consumer)
            for tp in tps:
                consumer.seek(tp, begin[tp])
            # The latest value of each key, in the order of its last write: what a fully
            # compacted changelog holds. The cores are built from it only once the consumer
            # and every record it fetched are gone, so the long-lived state is not scattered
            # among short-lived records (RSS after a restore was x1.7 the uninterrupted
            # worker's, bench_recovery).
            latest: dict[int, dict[str, bytes | None]] = {s: {} for s in slots}
            # Read until no transaction is pending on the partition (last stable offset ==
            # high watermark), not merely to the last stable offset. A previous owner that let
            # go of the partition had its last transaction committed just before, and its
            # commit markers can still be on their way while its input offsets are visible
            # already: restoring without that transaction's state would resume after inputs
            # whose state is lost (a clean handover lost events this way). A transaction still
            # pending after RESTORE_PENDING_TXN_WAIT_S is taken as abandoned (a SIGKILLed
            # owner; the broker aborts it after its timeout, and its offsets were never
            # committed): the state up to the last stable offset is then the consistent one.
            pending = set(tps)
            waited_since = answered_at = time.monotonic()
            batch: dict[TopicPartition, list[Any]] = {}
            while pending:
                if abort.is_set():
                    raise RestoreAborted(f"{self.spec.name}: restore called off")
                batch = await consumer.getmany(*pending, timeout_ms=100)
                if batch:
                    answered_at = time.monotonic()
                elif time.monotonic() - answered_at > RESTORE_STALL_S:
                    raise KafkaConnectionError(
                        f"{self.spec.name}: restore got no answer from the broker for "
                        f"{RESTORE_STALL_S:.0f} s (partitions {sorted(slots)} of "
                        f"{self.changelog})")
                for tp, msgs in batch.items():
                    values = latest[tp.partition]
                    for msg in msgs:
                        key = msg.key.decode() if msg.key else ""
                        # A None (tombstone) deletes: until compaction the changelog holds a
                        # key's put and its later delete, and the delete must win.
                        values.pop(key, None)
                        values[key] = msg.value
                        restored += 1
                patient = time.monotonic() - waited_since < RESTORE_PENDING_TXN_WAIT_S
                for tp in list(pending):
                    hw, lso = consumer.highwater(tp), consumer.last_stable_offset(tp)
                    if hw is None or lso is None:
                        continue  # no fetch response for it yet
                    if await consumer.position(tp) >= lso and (lso >= hw or not patient):
                        if lso < hw:
                            log.warning("%s: state partition %d has a transaction pending for "
                                        "%.0f s: taken as abandoned, restored up to its last "
                                        "stable offset %d (high watermark %d)", self.spec.name,
                                        tp.partition, RESTORE_PENDING_TXN_WAIT_S, lso, hw)
                        pending.discard(tp)
                        answered_at = time.monotonic()
        finally:
            await close_client(consumer, "restore consumer")
        return latest, restored

    # -- topics -------------------------------------------------------------------------
    async def _prepare_topics(self, *, known_broker: bool = False) -> None:
        specs = self._topic_specs()
        await ensure_topics(self.settings, specs, known_broker=known_broker)
        self._known_topics.update(s.name for s in specs)

    def _topic_specs(self) -> list[TopicSpec]:
        parts = 1 if self.spec.global_state else self.settings.topics.partitions
        specs = [TopicSpec(self.changelog, parts, f"{self.spec.name} state changelog",
                           "state key", retention_ms=-1, compacted=True,
                           max_message_bytes=self.topics.derived_max_bytes,
                           configs=changelog_configs(self.topics.derived_max_bytes + 65536))]
        specs += self.topics.specs + list(self.spec.output_topics()) + self.spec.extra_topics
        specs += [TopicSpec(t, parts, "ticks", "-", retention_ms=3_600_000)
                  for t in self.spec.tick_topics or () if t not in {s.name for s in specs}]
        return specs

    async def _ensure_output_topic(self, topic: str) -> None:
        """Create an output topic on its first use (a new task's replay topic). The broker
        answered at start-up: a restart meanwhile is waited out (the soak of 2026-12-01 lost a
        worker that gave up after connect_timeout_s during a 20 s restart)."""
        if topic in self._known_topics:
            return
        await ensure_topics(self.settings, known_broker=True, specs=[TopicSpec(
            topic, self.settings.topics.partitions, "derived output", "episode",
            max_message_bytes=self.topics.derived_max_bytes)])
        self._known_topics.add(topic)

    # -- main loop ----------------------------------------------------------------------
    async def run(self, *, until_idle: float | None = None, recovering: bool = False) -> None:
        """Process until stopped (or until no input arrived for ``until_idle`` seconds).

        A first start fails fast when the broker does not answer (it says what to set). A
        ``recovering`` run (the processor lost the broker while running: the supervisor starts
        it again) waits for the broker instead, up to ``TOPIC_SETUP_PATIENCE_S``: a restart
        of the broker takes longer than the fail-fast timeout."""
        # Start-up can wait long (a recovering run waits for the broker): a stop meanwhile
        # ends it at once, with nothing started left behind.
        start_up = asyncio.ensure_future(self._start_up(recovering))
        stop = asyncio.ensure_future(self.stopping.wait())
        try:
            await asyncio.wait({start_up, stop}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            stop.cancel()
            if not start_up.done():
                start_up.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await start_up
        if start_up.cancelled():
            return
        start_up.result()
        assert self._producer is not None and self._consumer is not None
        self.started = True
        if recovering:
            ops_log.info("%s: reconnected to Kafka at %s; rejoining group %s from its "
                         "committed state", self.spec.name, self.settings.kafka.bootstrap_servers,
                         self.group_id)
        if self.spec.input_pattern:
            pattern = "|".join([self.spec.input_pattern] +
                               [re.escape(t) + "$" for t in self.spec.input_topics])
            self._consumer.subscribe(pattern=f"^(?:{pattern})", listener=_Rebalance(self))
        else:
            self._consumer.subscribe(self.spec.input_topics, listener=_Rebalance(self))
        ticker = asyncio.create_task(self._ticker())
        lag = asyncio.create_task(export_lag(self.group_id, self._consumer))
        idle_since = time.monotonic()
        pass_markers_at = idle_since + PASS_MARKERS_AFTER_S
        clean = False
        try:
            last_poll_end: float | None = None
            while not self.stopping.is_set():
                t_poll = time.perf_counter()
                if last_poll_end is not None:  # a stall of the loop (processing, a transaction)
                    self._stats["between_polls_max_ms"] = max(
                        self._stats["between_polls_max_ms"], 1000 * (t_poll - last_poll_end))
                batch = await self._consumer.getmany(timeout_ms=200, max_records=2000)
                last_poll_end = time.perf_counter()
                if ticker.done():  # it only ends by failing: stop rather than run tickless
                    ticker.result()
                self._stats["poll_s"] += last_poll_end - t_poll
                if self._check_restore():
                    idle_since = time.monotonic()
                if batch:  # how long the records sat in Kafka before this poll returned them
                    now_ms = time.time() * 1000
                    ages = [now_ms - m.timestamp for msgs in batch.values() for m in msgs]
                    self._stats["age_ms"] += sum(ages)
                    self._stats["age_max_ms"] = max(self._stats["age_max_ms"], max(ages))
                if not batch:
                    if until_idle is not None and time.monotonic() - idle_since > until_idle:
                        break
                    # no input but ticks for a while; checked on an empty poll only, when
                    # nothing fetched is left unprocessed (the position must not pass it)
                    if time.monotonic() >= pass_markers_at:
                        await self._commit_passed()
                        pass_markers_at = time.monotonic() + PASS_MARKERS_AFTER_S
                    continue
                if any(m.key != TICK_KEY for msgs in batch.values() for m in msgs):
                    idle_since = time.monotonic()
                    pass_markers_at = idle_since + PASS_MARKERS_AFTER_S
                if self.spec.ordered:
                    for tp, msgs in batch.items():
                        self._pending.setdefault(tp, deque()).extend(msgs)
                    ready = self._release()
                else:
                    ready = [(tp, m) for tp, msgs in batch.items() for m in msgs]
                if ready:
                    await self._process(ready)
            async with self._lock:
                task = self._inflight
                if task is not None:
                    # not wait_for: a cancelled transaction aborts, and the abort would wait
                    # for the broker just the same
                    await asyncio.wait({task}, timeout=SETTLE_ON_STOP_S)
                if task is None or task.done():
                    await self._settle()
                    clean = True
                else:
                    log.warning("%s: its last transaction did not complete within %.0f s of "
                                "the stop (is the broker away?); left for the broker to "
                                "abort: its inputs are processed again by their next owner",
                                self.spec.name, SETTLE_ON_STOP_S)
        finally:
            await self.cancel_restore()
            self._abort_restore.set()  # a restore thread of an assignment callback, if any
            inflight, self._inflight = self._inflight, None
            if inflight is not None:  # failing or stopping: the broker aborts it (or it commits)
                await _give_up(inflight)  # the producer is closed next, its transaction with it
            ticker.cancel()
            lag.cancel()
            # its error (if any) was raised above; here it must not skip closing the clients
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await ticker
            # a producer whose transaction was called off would wait in its close for the
            # abort, i.e. for the broker: the broker aborts it itself (or a restart fences it)
            await asyncio.gather(
                self._close(self._consumer, "consumer"),
                self._close(self._producer, "producer",
                            CANCEL_WAIT_S if inflight is not None else CLIENT_CLOSE_S))
            if clean:  # a crash stays a member: its restart takes the partitions back
                await self._leave_group()

    async def _start_up(self, recovering: bool) -> None:
        """Check the broker, create the topics, start the clients (see :meth:`run`)."""
        if recovering:
            await retry_while_broker_restarts(
                lambda: check_broker(self.settings.kafka),
                transient=(BrokerUnavailableError, KafkaConnectionError),
                patience_s=lambda: TOPIC_SETUP_PATIENCE_S, what=f"{self.spec.name}: restart")
        else:
            await check_broker(self.settings.kafka)
        await self._prepare_topics(known_broker=recovering)
        k = self.settings.kafka
        producer_args = dict(  # for producer_options (with the connection's settings)
            client_id=f"{self.group_id}-{self.worker_id}",
            transactional_id=f"{self.group_id}.{self.worker_id}",
            # outputs wrap inputs (dead letters, segments): allow the derived topics' size
            max_request_size=max(k.max_request_size, self.topics.derived_max_bytes + 65536),
            # A batch's records are all appended before the transaction commits, and the
            # commit waits for them: lingering only delays every transaction.
            linger_ms=0)
        consumer_args = dict(  # with connection_options (TLS/SASL) at the call
            group_id=self.group_id,
            client_id=f"{self.group_id}-{self.worker_id}",
            # Static membership (KIP-345): a worker SIGKILLed and restarted with the same
            # --worker-id is given its partitions back at once, instead of waiting for its dead
            # self's session to expire. A clean stop leaves explicitly (_leave_group).
            group_instance_id=self.instance_id,
            session_timeout_ms=k.session_timeout_ms,
            heartbeat_interval_ms=k.heartbeat_interval_ms,  # how soon it sees a rebalance
            isolation_level="read_committed",
            enable_auto_commit=False,
            auto_offset_reset="earliest",
            max_poll_records=2000,
            # partition p of every input topic to the same worker: a core sees all of an
            # episode (events and trace chunks share partition p of two topics). aiokafka's
            # default, round-robin, splits them across workers.
            # A global processor (the scheduler): everything to one member, the others
            # stand by (OneMemberAssignor). One assignor only: see group_assignors.
            partition_assignment_strategy=group_assignors(self.spec.global_state),
            metadata_max_age_ms=5000,  # pattern subscriptions see new replay topics quickly
            max_partition_fetch_bytes=k.max_request_size,
            fetch_max_bytes=4 * k.max_request_size,
            fetch_max_wait_ms=k.fetch_max_wait_ms,  # see KafkaSettings.fetch_max_wait_ms
        )
        await self._start_clients(producer_args, consumer_args)

    async def _close(self, client: AIOKafkaConsumer | AIOKafkaProducer, what: str,
                     timeout: float = CLIENT_CLOSE_S) -> None:
        """Close a client within ``timeout``: a close that hangs (a client whose background
        task died with the broker, a producer waiting to deliver to a broker that is away)
        must not keep the worker from stopping, and a close that meets aiokafka#647 (a fetch
        to a dead node pending) ends no worker in a traceback (:func:`close_client`)."""
        await close_client(client, f"{self.spec.name}: its {what}", timeout=timeout)

    async def _start_clients(self, producer_args: dict[str, Any],
                             consumer_args: dict[str, Any]) -> None:
        """Start the transactional producer and the group consumer. The broker answered a
        moment ago (check_broker); if it goes away while they start (a restart: the soak of
        2026-12-01 lost a worker whose producer was looking up its transaction coordinator
        when the broker stopped), they are built again and retried for up to
        ``TOPIC_SETUP_PATIENCE_S``, as topic set-up is."""
        async def start() -> tuple[AIOKafkaProducer, AIOKafkaConsumer]:
            producer = AIOKafkaProducer(**producer_options(self.settings.kafka,
                                                           **producer_args))
            consumer = AIOKafkaConsumer(**connection_options(self.settings.kafka),
                                        **consumer_args)
            try:
                await producer.start()
                await consumer.start()
            except BaseException as exc:
                for client in (consumer, producer):
                    with contextlib.suppress(Exception):
                        await close_client(client, "client")
                if broker_went_away(exc):
                    raise KafkaConnectionError(str(exc)) from exc
                raise
            return producer, consumer

        self._producer, self._consumer = await retry_while_broker_restarts(
            start, transient=(KafkaConnectionError,),
            patience_s=lambda: TOPIC_SETUP_PATIENCE_S, what=f"{self.spec.name}: start")

    @property
    def instance_id(self) -> str:
        """This worker's static member id in its group (one per processor and --worker-id)."""
        return f"{self.group_id}.{self.worker_id}"

    async def _leave_group(self) -> None:
        """A clean stop: hand the partitions to the other members now (a static member is
        otherwise kept until its session times out). Failing to leave only delays that."""
        try:
            await leave_group_as_static_member(self.settings, self.group_id, self.instance_id)
        except Exception as exc:  # best effort: the session timeout still applies
            log.warning("%s: could not leave group %s (%s: %s); its partitions move after the "
                        "session timeout", self.instance_id, self.group_id,
                        type(exc).__name__, exc)
        else:
            log.info("%s left group %s", self.instance_id, self.group_id)

    def _release(self) -> list[tuple[TopicPartition, Any]]:
        """Ordered mode: pop records in (timestamp, topic rank, topic, partition) order of the
        partition heads, but only while every assigned input partition has a head — its next
        record could otherwise be older. Ticks in every input partition guarantee progress;
        a partition silent for longer than ``_MAX_IDLE_S`` stops blocking (logged)."""
        assert self._consumer is not None
        rank = {t: i for i, t in enumerate(self.spec.input_topics)}
        blocking = [tp for tp in self._consumer.assignment() if tp.topic in rank]
        now = time.monotonic()
        out: list[tuple[TopicPartition, Any]] = []
        while True:
            empty = [tp for tp in blocking if not self._pending.get(tp)]
            if empty:
                for tp in empty:
                    self._empty_since.setdefault(tp, now)
                if all(now - self._empty_since[tp] < _MAX_IDLE_S for tp in empty):
                    break
                silent = [tp for tp in empty if tp not in self._warned_silent
                          and now - self._empty_since[tp] >= _MAX_IDLE_S]
                if silent:  # once per silence, not once per record released meanwhile
                    self._warned_silent.update(silent)
                    newly = sorted(f"{tp.topic}[{tp.partition}]" for tp in silent)
                    log.warning("%s: no record (not even a tick) from %s for %.0f s; ordering "
                                "without waiting for them (a broker restart or a stopped "
                                "ticker; it resumes by itself when they speak again)",
                                self.spec.name, ", ".join(newly),
                                max(now - self._empty_since[tp] for tp in silent))
            heads = [tp for tp, q in self._pending.items() if q]
            if not heads:
                break
            tp = min(heads, key=lambda t: (self._pending[t][0].timestamp,
                                           rank.get(t.topic, len(rank)), t.topic, t.partition))
            out.append((tp, self._pending[tp].popleft()))
            self._warned_silent.discard(tp)
            if self._pending[tp]:
                self._empty_since.pop(tp, None)
            else:
                self._empty_since[tp] = now
        return out

    async def _process(self, records: list[tuple[TopicPartition, Any]]) -> None:
        """Process a batch, then hand its transaction to a task and return: the transaction
        commits while the next batch is fetched and processed (the broker round trips of a
        transaction are most of a batch's wall time). Kafka allows one open transaction per
        producer, so the next batch's transaction begins only once this one has committed;
        each transaction still carries exactly its batch's outputs, the state those left
        behind and its input offsets. If a transaction fails, the next batch raises before
        anything of it is written and the worker stops (a restart resumes from the last
        commit, as after a crash)."""
        async with self._lock:
            prepared = await self._prepare(records)
            if not await self._settle_unless_stopping():
                # Told to stop while the previous transaction is still in flight (the broker
                # away: it may never complete). This batch's transaction is never begun --
                # nothing of it is written, its inputs are processed again by their next
                # owner -- and the stop waits for the previous one at most SETTLE_ON_STOP_S.
                return
            self._inflight = asyncio.create_task(self._commit(*prepared))

    async def _commit_passed(self) -> None:
        """Commit, in a transaction of its own, the position of each idle input partition that
        is past the group's commit with nothing of it left to process: what lies between is
        what a reader never gets (the commit marker that follows each transaction of the
        producer upstream, aborted records). Without it an idle worker's group reads lag 1
        per partition written transactionally in Kafka's own tools and a lag exporter's, for
        good. Skipped while a transaction is in flight or failed, or a restore runs: the next
        idle poll tries again."""
        consumer = self._consumer
        if consumer is None or self._restoring is not None:
            return
        async with self._lock:
            task = self._inflight
            if task is not None and (not task.done() or task.cancelled()
                                     or task.exception() is not None):
                return  # a failure is raised by the main loop
            paused = consumer.paused()
            offsets: dict[TopicPartition, int] = {}
            for tp in consumer.assignment():
                if tp in paused or self._pending.get(tp) or \
                        self._slot(tp.partition) not in self.cores or tp not in self._committed:
                    continue
                try:
                    position = await asyncio.wait_for(consumer.position(tp), 1.0)
                except (TimeoutError, KafkaError):
                    continue  # no position yet, or revoked meanwhile
                committed = self._committed[tp]
                if position > (committed if committed is not None else 0):
                    offsets[tp] = position
            if offsets:
                self._inflight = asyncio.create_task(
                    self._commit([], [], offsets, {}, 0, time.perf_counter()))

    async def _prepare(self, records: list[tuple[TopicPartition, Any]]
                       ) -> tuple[list[OutRecord], list[tuple[int, str, bytes | None]],
                                  dict[TopicPartition, int], dict[str, int], int, float]:
        assert self._producer is not None and self._consumer is not None
        outs: list[OutRecord] = []
        offsets: dict[TopicPartition, int] = {}
        started = time.perf_counter()
        # Records per core slot, each in log order (cores are independent, so interleaving
        # across slots does not matter; an ordered/global spec has a single slot).
        by_slot: dict[int, list[InRecord]] = {}
        counts_in: dict[str, int] = {}
        for tp, msg in records:
            slot = self._slot(tp.partition)
            if slot not in self.cores and self._restoring is not None:
                await self._restoring  # paused while restoring: only a fetch already under way
            if slot not in self.cores:  # assignment raced the listener; restore now
                await self._wait_inflight()
                await self._restore([tp])
            by_slot.setdefault(slot, []).append(InRecord(
                tp.topic, tp.partition, msg.offset, msg.key, msg.value or b"", msg.timestamp))
            counts_in[tp.topic] = counts_in.get(tp.topic, 0) + 1
            offsets[tp] = msg.offset + 1
        for slot, recs in by_slot.items():
            core = self.cores[slot]
            handle_batch = getattr(core, "handle_batch", None)
            if handle_batch is not None:  # coalesces its outputs for this one transaction
                outs.extend(handle_batch(recs))
            else:
                for rec in recs:
                    outs.extend(core.handle(rec))
        # the state each touched key ended the batch with, taken now: the next batch is
        # processed while this one's transaction is in flight
        state = [(slot, key, blob) for slot in by_slot
                 for key, blob in self.cores[slot].take_dirty().items()]
        for topic in {o.topic for o in outs}:
            await self._ensure_output_topic(topic)
        st = self._stats
        st["batches"] += 1
        st["records"] += len(records)
        st["outputs"] += len(outs)
        st["changelog"] += len(state)
        st["handle_s"] += time.perf_counter() - started
        return outs, state, offsets, counts_in, len(records), started

    async def _commit(self, outs: list[OutRecord], state: list[tuple[int, str, bytes | None]],
                      offsets: dict[TopicPartition, int], counts_in: dict[str, int],
                      n_records: int, started: float) -> None:
        assert self._producer is not None
        t_txn = time.perf_counter()
        try:
            await self._transact(outs, state, offsets)
        except BaseException as exc:
            # cancelled, fatal or the sender gone: nobody aborted it (the broker will)
            fatal = (not isinstance(exc, Exception) or sender_crash(self._producer) is not None
                     or self._producer._txn_manager.is_fatal_error())
            metrics.TRANSACTIONS.labels(self.spec.name, "failed" if fatal else "aborted").inc()
            if not isinstance(exc, KafkaError):
                raise
            crash = sender_crash(self._producer)
            if crash is not None:  # it carries the cause (the broker went away, or not)
                raise crash  # noqa: B904 -- the failed transaction stays its context
            raise
        metrics.TRANSACTIONS.labels(self.spec.name, "committed").inc()
        self._committed.update(offsets)
        counts_out: dict[str, int] = {}
        for out in outs:
            counts_out[out.topic] = counts_out.get(out.topic, 0) + 1
        for topic, n in counts_in.items():
            metrics.EVENTS_IN.labels(self.spec.name, topic).inc(n)
        for topic, n in counts_out.items():
            metrics.EVENTS_OUT.labels(self.spec.name, topic).inc(n)
        done = time.perf_counter()
        if n_records:  # not an offsets-only transaction (_commit_passed)
            metrics.BATCH_SECONDS.labels(self.spec.name).observe(done - started)
        self.processed += n_records
        self._stats["txn_s"] += done - t_txn
        self._stats["txn_max_ms"] = max(self._stats["txn_max_ms"], 1000 * (done - t_txn))
        if time.monotonic() - self._stats_since >= _STATS_S:
            self._log_stats()

    async def _transact(self, outs: list[OutRecord], state: list[tuple[int, str, bytes | None]],
                        offsets: dict[TopicPartition, int]) -> None:
        """One Kafka transaction: the batch's outputs, its state records, its input offsets."""
        assert self._producer is not None
        send = self._producer.send
        async with self._producer.transaction():
            try:
                futures = [await send(o.topic, o.value, key=o.key, partition=o.partition)
                           for o in outs]
                futures += [await send(self.changelog, blob, key=key.encode(), partition=slot)
                            for slot, key, blob in state]
            except UnknownTopicOrPartitionError as exc:
                # aiokafka's answer when no metadata came within its request timeout: for the
                # topics this worker made sure of, the broker is away (a restart, an outage)
                raise KafkaTimeoutError("no topic metadata within the request timeout "
                                        "(the broker away?)") from exc
            if futures:
                await asyncio.gather(*futures)
            # The offsets only once every record is acknowledged. A Kafka 4 broker verifies
            # a transactional produce and a TxnOffsetCommit with the transaction coordinator
            # (KIP-890) and keeps one pending verification per transactional id: sent while a
            # produce was in flight, the offsets' verification replaced the produce's, which
            # came back NOT_ENOUGH_REPLICAS ("Unable to verify ... NETWORK_EXCEPTION") and was
            # retried after aiokafka's 100 ms backoff (or the offsets' came back
            # COORDINATOR_NOT_AVAILABLE). RELIABILITY.md, tests/test_runner_txn_retries.py.
            await self._producer.send_offsets_to_transaction(offsets, self.group_id)

    def _log_stats(self) -> None:
        st, now = self._stats, time.monotonic()
        b = max(1.0, st["batches"])
        log.info("%s: %.0fs: %d batches, %.1f records/batch, %.1f outputs + %.1f state "
                 "records/batch; per batch %.1f ms polling, %.1f ms processing, %.1f ms "
                 "transaction (max %.0f ms); input age at poll mean %.0f ms, max %.0f ms; "
                 "longest time between polls %.0f ms", self.spec.name,
                 now - self._stats_since, st["batches"], st["records"] / b, st["outputs"] / b,
                 st["changelog"] / b, 1000 * st["poll_s"] / b, 1000 * st["handle_s"] / b,
                 1000 * st["txn_s"] / b, st["txn_max_ms"], st["age_ms"] / max(1.0, st["records"]),
                 st["age_max_ms"], st["between_polls_max_ms"])
        self._stats = dict.fromkeys(_STATS, 0.0)
        self._stats_since = now

    async def _ticker(self) -> None:
        """Publish Tick events into every partition of the tick topics (default: the input
        topics), so time-driven rules fire even when no traffic arrives, the ticks are
        replayable from the log, and a tick inside an input partition marks how far that
        partition has been written (a processing-time watermark).

        A broker restart does not stop it: its producer's start is retried as topic set-up
        is (``TOPIC_SETUP_PATIENCE_S``), and a tick that cannot be sent is skipped (the next
        one carries the time). If it fails all the same, the main loop raises its error: a
        worker never runs on without ticks."""
        interval = self.settings.scheduler.tick_interval_ms / 1000
        tick_topics = self.spec.tick_topics or self.spec.input_topics

        async def start() -> tuple[AIOKafkaProducer, list[tuple[str, int]]]:
            producer = AIOKafkaProducer(**producer_options(
                self.settings.kafka, client_id=f"{self.group_id}-{self.worker_id}-ticker"))
            try:
                await producer.start()
                targets = [(t, p) for t in tick_topics
                           for p in sorted(await producer.partitions_for(t))]
            except BaseException:
                with contextlib.suppress(Exception):
                    await close_client(producer, "tick producer")
                raise
            return producer, targets

        async def started() -> tuple[AIOKafkaProducer, list[tuple[str, int]]]:
            return await retry_while_broker_restarts(
                start, transient=(KafkaConnectionError, KafkaTimeoutError),
                patience_s=lambda: TOPIC_SETUP_PATIENCE_S, what=f"{self.spec.name}: ticker")

        producer, targets = await started()
        deliveries: list[asyncio.Future[Any]] = []
        try:
            seq = 0
            skipped = 0
            while True:
                await asyncio.sleep(interval)
                broken = sender_crash(producer) or _lasting_failure(deliveries)
                if broken is not None:
                    # An idempotent producer that lost a sequence (OutOfOrderSequenceNumber on
                    # every later batch, seen after a long broker restart) or whose sender
                    # died never delivers again: the clock would stop for good
                    log.warning("%s: ticker: its producer can no longer deliver (%s: %s); "
                                "starting a new one", self.spec.name, type(broken).__name__,
                                broken)
                    await self._close(producer, "ticker producer")
                    deliveries = []
                    producer, targets = await started()
                now = int(time.time() * 1000)
                try:
                    for topic, p in targets:
                        tick = Tick(header=Envelope(
                            task="_tick", sandbox="_tick", seq=seq, event_time_ms=now,
                            producer_id=f"{self.group_id}.{self.worker_id}"))
                        deliveries.append(await producer.send(topic, tick.encode(),
                                                              key=TICK_KEY, partition=p))
                except KafkaError as exc:  # the broker is away: the next tick tells the time
                    skipped += 1
                    if skipped == 1 or skipped % 60 == 0:
                        log.warning("%s: ticker: %d tick(s) not sent (%s: %s); still trying",
                                    self.spec.name, skipped, type(exc).__name__, exc)
                else:
                    skipped = 0
                seq += 1
        finally:
            await self._close(producer, "ticker producer", TICKER_CLOSE_S)


def _partitions_text(tps: Iterable[TopicPartition]) -> str:
    by_topic: dict[str, list[int]] = {}
    for tp in tps:
        by_topic.setdefault(tp.topic, []).append(tp.partition)
    return "; ".join(f"{t} {sorted(ps)}" for t, ps in sorted(by_topic.items())) or "none"
