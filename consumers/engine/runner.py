"""The imperative shell shared by every stream processor (reorder, watchdog, scheduler).

A processor is a pure core behind a :class:`Processor` adapter. The runner feeds it records
and persists its outputs and state with Kafka transactions. The main loop (:meth:`Runner.run`):

1. polls a batch (up to 2,000 records) from the input partitions (``read_committed``); in
   ordered mode the partitions are merged first (:mod:`.ordering`);
2. hands the batch to the cores, slot by slot (a slot whose core is not built yet is restored
   first, :mod:`.restore`), and takes the outputs and the state each touched key ended with;
3. waits for the previous batch's transaction: if it failed, the worker stops before anything
   of this batch is written; if the runner is told to stop meanwhile, this batch's
   transaction is never begun (its inputs are processed again by their next owner);
4. begins this batch's transaction in a task and goes back to 1: the transaction writes the
   outputs and the state records, waits for every one to be acknowledged, adds the input
   offsets and commits (:mod:`.transactions`). Only this commit makes any of it visible;
5. with no input but ticks for ``PASS_MARKERS_AFTER_S``, commits the idle partitions'
   positions past commit markers in a transaction of its own (:mod:`.idle_commit`);
6. on a stop, waits for the in-flight transaction at most ``SETTLE_ON_STOP_S``, then closes
   its clients; a transaction still pending is left for the broker to abort.

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
(faust #517/#177), its timers cannot be driven by a test, and its table recovery can skip
records fetched during the recovery after a SIGKILL (README, "Design": "One engine").
This loop is explicit aiokafka with the same table-plus-changelog recovery model.

The runner is a façade over one module per concern; each is a mixin over the shared
:class:`~.state.RunnerState`:

* :mod:`.records` -- the records and the :class:`Processor` protocol a core's adapter meets;
* :mod:`.restore` -- serving an assignment: cores kept across a rebalance or rebuilt from the
  changelog (:mod:`.changelog`: its topic's configuration; :mod:`.memory`: the heap a restore
  read through returned to the OS);
* :mod:`.transactions` -- a batch processed and committed in one transaction;
* :mod:`.idle_commit` -- an idle partition's position committed past commit markers;
* :mod:`.ordering` -- ordered mode's merge of the input partitions;
* :mod:`.ticker` -- the Tick events that carry time through the log;
* :mod:`.assignors` -- the partition assignors offered to the group;
* here -- start-up, topics, the main loop and the stop.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import time
from collections import deque
from typing import Any

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, ConsumerRebalanceListener, TopicPartition
from aiokafka.errors import KafkaConnectionError

from trajbus.bus.admin import TOPIC_SETUP_PATIENCE_S, ensure_topics, leave_group_as_static_member
from trajbus.bus.clients import new_consumer, new_producer
from trajbus.bus.closing import close_client
from trajbus.bus.kafka import (
    BrokerUnavailableError,
    broker_went_away,
    check_broker,
    retry_while_broker_restarts,
)
from trajbus.bus.ops import export_lag
from trajbus.bus.topics import TopicSpec
from trajbus.consumers.engine.assignors import OneMemberAssignor, group_assignors
from trajbus.consumers.engine.changelog import (
    CHANGELOG_CONFIGS,
    SEGMENT_FLOOR_BYTES,
    changelog_configs,
)
from trajbus.consumers.engine.idle_commit import PASS_MARKERS_AFTER_S, IdleCommitMixin
from trajbus.consumers.engine.ordering import _MAX_IDLE_S, OrderedReleaseMixin
from trajbus.consumers.engine.records import TICK_KEY, InRecord, OutRecord, Processor, ProcessorSpec
from trajbus.consumers.engine.restore import (
    OFFSET_LOOKUP_TRY_S,
    RESTORE_PENDING_TXN_WAIT_S,
    RESTORE_STALL_S,
    RestoreAborted,
    RestoreInterrupted,
    RestoreMixin,
    reusable_slots,
)
from trajbus.consumers.engine.ticker import TICKER_CLOSE_S, TickerMixin
from trajbus.consumers.engine.transactions import (
    CANCEL_WAIT_S,
    SETTLE_ON_STOP_S,
    TransactionsMixin,
    _give_up,
)

__all__ = [
    "CANCEL_WAIT_S",
    "CHANGELOG_CONFIGS",
    "CLIENT_CLOSE_S",
    "OFFSET_LOOKUP_TRY_S",
    "PASS_MARKERS_AFTER_S",
    "RESTORE_PENDING_TXN_WAIT_S",
    "RESTORE_STALL_S",
    "SEGMENT_FLOOR_BYTES",
    "SETTLE_ON_STOP_S",
    "TICKER_CLOSE_S",
    "TICK_KEY",
    "_MAX_IDLE_S",
    "InRecord",
    "OneMemberAssignor",
    "OutRecord",
    "Processor",
    "ProcessorSpec",
    "RestoreAborted",
    "RestoreInterrupted",
    "Runner",
    "changelog_configs",
    "group_assignors",
    "reusable_slots",
]

log = logging.getLogger("trajbus.runner")
# What an operator must see without -v (takeovers, reconnections): INFO even when the rest of
# the worker's log is at WARNING (consumers/engine/cli.py).
ops_log = logging.getLogger("trajbus.ops")
CLIENT_CLOSE_S = 15.0


class _Rebalance(ConsumerRebalanceListener):
    def __init__(self, runner: Runner) -> None:
        self.runner = runner

    async def on_partitions_revoked(self, revoked: list[TopicPartition]) -> None:
        await self.runner.quiesce()  # the in-flight transaction finishes before we let go
        await self.runner.cancel_restore()
        self.runner.park(revoked)

    async def on_partitions_assigned(self, assigned: list[TopicPartition]) -> None:
        await self.runner.restore(assigned)


class Runner(RestoreMixin, TransactionsMixin, IdleCommitMixin, OrderedReleaseMixin, TickerMixin):
    """Runs one processor kind in a consumer group with transactional outputs and state."""

    # RunnerState's fields, typed here too (mypy does not follow trajbus.* imports)
    _inflight: asyncio.Task[None] | None

    def ready(self) -> tuple[bool, dict[str, Any]]:
        """For /readyz: clients started, group joined, partitions assigned and restored."""
        restoring = self._restoring is not None and not self._restoring.done()
        ok = self.started and self.assigned is not None and not restoring \
            and not self.stopping.is_set()
        return ok, {"started": self.started, "stopping": self.stopping.is_set(),
                    "assigned_partitions": None if self.assigned is None
                    else len(self.assigned), "restoring": restoring}

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
        answered at start-up, so a restart meanwhile is waited out (as topic set-up is) rather
        than given up after ``connect_timeout_s``: a broker restart takes longer than that
        (docs/decisions/0013-ride-out-broker-restarts.md)."""
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
        producer_args = dict(  # aiokafka's options, over producer_options
            client_id=f"{self.group_id}-{self.worker_id}",
            transactional_id=f"{self.group_id}.{self.worker_id}",
            # outputs wrap inputs (dead letters, segments): allow the derived topics' size
            max_request_size=max(k.max_request_size, self.topics.derived_max_bytes + 65536),
            # A batch's records are all appended before the transaction commits, and the
            # commit waits for them: lingering only delays every transaction.
            linger_ms=0)
        consumer_args = dict(  # aiokafka's options, over connection_options
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
        moment ago (check_broker); if it goes away while they start (a restart, even while
        the producer looks up its transaction coordinator), they are built again and retried
        for up to ``TOPIC_SETUP_PATIENCE_S``, as topic set-up is
        (docs/decisions/0013-ride-out-broker-restarts.md)."""
        async def start() -> tuple[AIOKafkaProducer, AIOKafkaConsumer]:
            producer = new_producer(self.settings.kafka, **producer_args)
            consumer = new_consumer(self.settings.kafka, **consumer_args)
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

