"""Processing a batch and committing it: the batch's outputs, the state its cores were left
with and its input offsets go out in ONE Kafka transaction, which commits while the next batch
is fetched and processed.

For each batch (:meth:`TransactionsMixin._process`):

1. prepare (:meth:`~TransactionsMixin._prepare`): each core handles its records in log order;
   the outputs, the state each touched key ended the batch with (a snapshot: the next batch is
   processed while this one commits) and the input offsets (last offset + 1 per partition)
   are taken; new output topics are created;
2. settle the previous batch's transaction: wait for it and raise if it failed, so nothing of
   this batch is written after a failure. Told to stop meanwhile, the batch's transaction is
   never begun;
3. in a task (:meth:`~TransactionsMixin._commit`), one transaction
   (:meth:`~TransactionsMixin._transact`): send the outputs, then the state records to the
   changelog; wait until every one is acknowledged; then add the input offsets
   (``send_offsets_to_transaction``); then commit;
4. once committed, record the committed offsets and count the batch in the metrics.

Guarantee: the outputs, state records and input offsets of a batch become visible together or
not at all (step 3's commit), and a failed transaction stops the worker before anything of the
next batch is written (step 2). A transaction not committed is aborted by the broker, and its
inputs are processed again from the last committed offsets.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from aiokafka import TopicPartition
from aiokafka.errors import KafkaError, KafkaTimeoutError, UnknownTopicOrPartitionError

from trajbus.bus.kafka import sender_crash
from trajbus.consumers.engine import metrics
from trajbus.consumers.engine.records import InRecord, OutRecord
from trajbus.consumers.engine.state import _STATS, _STATS_S, RunnerState

log = logging.getLogger("trajbus.runner")

# On a stop, how long the in-flight transaction may take to complete, and the ticker's
# producer to close. With the broker away neither ever would: the transaction is then left to
# the broker to abort (its offsets were not committed, so the next owner processes its inputs
# again, exactly once) and the undelivered ticks are dropped (the next tick tells the time).
# A worker told to stop during an outage exits in seconds, not at the hard deadline.
SETTLE_ON_STOP_S = 10.0
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


class TransactionsMixin(RunnerState):
    """The runner's batches and transactions (see the module docstring)."""

    # RunnerState's fields, typed here too (mypy does not follow trajbus.* imports)
    _inflight: asyncio.Task[None] | None
    _stats: dict[str, float]
    _stats_since: float

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
            # (KIP-890) and keeps one pending verification per transactional id: offsets sent
            # while a produce is in flight replace the produce's verification, which comes
            # back NOT_ENOUGH_REPLICAS ("Unable to verify ... NETWORK_EXCEPTION") and is
            # retried after aiokafka's 100 ms backoff (or the offsets' comes back
            # COORDINATOR_NOT_AVAILABLE). docs/decisions/0014-offsets-after-acks.md,
            # tests/kafka/test_runner_txn_retries.py.
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
