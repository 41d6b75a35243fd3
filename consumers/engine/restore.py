"""Serving an assignment: the cores of assigned partitions are kept across a rebalance when
they are exactly the committed state (:func:`reusable_slots`), and otherwise rebuilt from the
committed changelog, read in a thread with an event loop of its own.

When partitions are revoked (:meth:`RestoreMixin.park`, after the runner's ``quiesce``: the
in-flight transaction has committed, so all they produced is committed), their cores are set
aside with the group's committed offset of each of their input partitions.

When partitions are assigned (:meth:`RestoreMixin.restore`, never while a batch is
processed):

1. wait for the in-flight transaction, so its state is in the changelog that is read;
2. fetch the group's committed offsets of the assigned partitions;
3. keep each set-aside core whose slot comes back with the same input partitions and
   unchanged committed offsets (:func:`reusable_slots`); drop the other set-aside cores;
4. rebuild the other slots' cores: if some were kept, the new partitions are paused and
   restored in the background while the kept ones are served, then resumed; otherwise the
   restore runs before the first batch. A restore (:meth:`RestoreMixin._restore`), in a thread
   with its own event loop:

   a. reads each slot's changelog partition from its beginning, keeping the latest value of
      each key (a tombstone deletes), until the position has reached the last stable offset
      and no transaction is pending on the partition (last stable offset == high watermark);
      a transaction pending longer than ``RESTORE_PENDING_TXN_WAIT_S`` is taken as abandoned
      and the partition is restored up to its last stable offset;
   b. if the broker goes away meanwhile, reads again from the beginning, for up to
      ``TOPIC_SETUP_PATIENCE_S``; no answer for ``RESTORE_STALL_S`` raises;
   c. closes its consumer and lets the fetched records go, then builds the cores from the
      latest values and returns the freed heap to the OS.

Nothing is committed by a restore: it reads committed state only (``read_committed``).

Guarantee: a core is built from the changelog only once every transaction that was pending
on its state partition has completed (or is taken as abandoned after
``RESTORE_PENDING_TXN_WAIT_S``), so it holds the state of the group's committed offsets.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import threading
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping
from typing import Any

from aiokafka import AIOKafkaConsumer, TopicPartition
from aiokafka.errors import KafkaConnectionError, KafkaError, KafkaTimeoutError

from trajbus.bus.admin import TOPIC_SETUP_PATIENCE_S
from trajbus.bus.clients import new_consumer
from trajbus.bus.closing import close_client
from trajbus.bus.kafka import broker_went_away, retry_while_broker_restarts
from trajbus.consumers.engine import metrics
from trajbus.consumers.engine.memory import return_freed_memory
from trajbus.consumers.engine.records import Processor
from trajbus.consumers.engine.state import RunnerState

log = logging.getLogger("trajbus.runner")
ops_log = logging.getLogger("trajbus.ops")

# How long a restore waits for a transaction pending on a state partition to complete. A
# committed transaction's markers land in milliseconds; one pending longer belongs to an owner
# that died mid-transaction (docs/decisions/0015-restore-waits-for-pending-transactions.md).
RESTORE_PENDING_TXN_WAIT_S = 5.0
# A restore whose reads get no answer for this long gives up (the broker is gone for good, or
# for longer than a restart); the worker's supervisor restarts the processor.
RESTORE_STALL_S = 60.0


#: How long one offset lookup may wait for a partition's leader before it is asked again with
#: fresh metadata: aiokafka's own lookup waits out request_timeout_ms (30 s) when the leader it
#: knows is shutting down or dead, which would stall a restore during a rolling restart.
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


class RestoreMixin(RunnerState):
    """The runner's restores (see the module docstring)."""

    # RunnerState's fields, typed here too (mypy does not follow trajbus.* imports)
    _restoring: asyncio.Task[None] | None
    _abort_restore: threading.Event

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
                # A restore takes time in proportion to the changelog records it reads;
                # meanwhile the kept partitions go on. The new ones are paused, so nothing of
                # them is processed before their cores exist.
                self._consumer.pause(*todo)
                self._restoring = asyncio.create_task(self._restore_then_resume(todo))
                log.info("%s: restoring partitions %s while serving the kept ones",
                         self.spec.name, sorted({tp.partition for tp in todo}))
            else:
                await self._restore(assigned)
            self.assigned = assigned
            metrics.ASSIGNED_PARTITIONS.labels(self.spec.name).set(len(assigned))

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

    async def _restore(self, assigned: Iterable[TopicPartition]) -> None:
        """Build the cores of the assigned slots that have none from the committed changelog.
        The reading and building run in a thread with an event loop of its own: a restore is
        CPU work, and the worker's loop goes on serving the partitions it kept meanwhile (see
        :meth:`restore`; docs/decisions/0016-restore-in-a-thread.md)."""
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
        return_freed_memory()
        return fresh, restored

    async def _read_changelog_retrying(self, slots: list[int], abort: threading.Event
                                       ) -> tuple[dict[int, dict[str, bytes | None]], int]:
        """:meth:`_read_changelog`, read again from the start if the broker went away
        meanwhile, for up to ``TOPIC_SETUP_PATIENCE_S``: a broker restart during a restore
        does not stop the worker (docs/decisions/0013-ride-out-broker-restarts.md)."""
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
        (a rebalance during an outage): its bootstrap is retried for up to
        ``TOPIC_SETUP_PATIENCE_S``, as topic set-up is, so such a restore does not stop the
        worker."""
        async def start() -> AIOKafkaConsumer:
            consumer = new_consumer(
                self.settings.kafka,
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
            # among short-lived records and the heap after a restore stays close to an
            # uninterrupted worker's (docs/decisions/0016-restore-in-a-thread.md).
            latest: dict[int, dict[str, bytes | None]] = {s: {} for s in slots}
            # Read until no transaction is pending on the partition (last stable offset ==
            # high watermark), not merely to the last stable offset. A previous owner that let
            # go of the partition had its last transaction committed just before, and its
            # commit markers can still be on their way while its input offsets are visible
            # already: restoring without that transaction's state would resume after inputs
            # whose state is lost, so even a clean handover would lose events. A transaction
            # still pending after RESTORE_PENDING_TXN_WAIT_S is taken as abandoned (a SIGKILLed
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


def _partitions_text(tps: Iterable[TopicPartition]) -> str:
    by_topic: dict[str, list[int]] = {}
    for tp in tps:
        by_topic.setdefault(tp.topic, []).append(tp.partition)
    return "; ".join(f"{t} {sorted(ps)}" for t, ps in sorted(by_topic.items())) or "none"
