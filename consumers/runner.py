"""The imperative shell shared by every stream processor (reorder, watchdog, scheduler).

A processor is a pure core behind a :class:`Processor` adapter. The runner feeds it records
and persists its outputs and state with Kafka transactions:

    consume batch -> core.handle(...) -> outputs + dirty state + input offsets
                  -> ONE transaction: output records, state changelog records, offsets

Guarantee: a batch's outputs, the state they leave behind and the input offsets that produced
them become visible together or not at all (consumers of our outputs read ``read_committed``).
A worker killed at any point restarts from the last committed offsets with the state of that
same moment, so it re-derives exactly the outputs that were lost, never a second copy of a
committed one. A transaction that fails (broker restart, expired membership) is aborted and
the runner rewinds: the cores of its partitions are rebuilt from the committed changelog and
the partitions re-read from their committed offsets, as after a crash, in the same process.
A worker whose transactional id was taken over by a newer incarnation is fenced and exits.

Client: confluent-kafka (librdkafka). Fetching, compression, batching and the transaction
protocol run in C threads; this loop runs in a thread of its own (one per processor), and the
batch's transaction is one blocking commit while librdkafka already fetches the next batch.
Assignment is ``range``: partition p of every input topic goes to the same member, which the
cores need (an episode's events and trace chunks share partition p of two topics). The
incremental ``cooperative-sticky`` assignor balances partitions without that guarantee, so
it is not used; every rebalance therefore revokes and restores all partitions. Static
membership (``group.instance.id``) is not used either: with
librdkafka a member whose session expired while the broker restarted rejoins and is then
fenced by its own new incarnation, a fatal consumer error (seen here in the broker-restart
test; confluentinc/librdkafka#3437, confluent-kafka-go#494). A SIGKILLed worker's partitions
therefore move after the session timeout (10 s).

Time: cores never read the clock. Each runner's ticker publishes :class:`Tick` events into its
input partitions, so ticks are part of the log and an offline replay makes the same decisions.

Why not a faust agent: faust-streaming's ``exactly_once`` logs and swallows transaction errors
(STACK-NOTES.md, faust #517/#177), its timers cannot be driven by a test, and an earlier faust
engine lost events after a SIGKILL (README, "Design"). This loop is explicit, with the same
table-plus-changelog recovery model.
"""

from __future__ import annotations

import asyncio
import logging
import re
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, Protocol

from confluent_kafka import (
    OFFSET_BEGINNING,
    Consumer,
    KafkaError,
    KafkaException,
    Message,
    Producer,
    TopicPartition,
)

from trajbus.bus.admin import ensure_topics
from trajbus.bus.kafka import check_broker
from trajbus.bus.rdkafka import common_config, consumer_config, producer_config
from trajbus.bus.settings import Settings
from trajbus.bus.topics import Topics, TopicSpec
from trajbus.consumers import metrics
from trajbus.schemas.models import Envelope, Tick

log = logging.getLogger("trajbus.runner")
TICK_KEY = b"_tick"
_MAX_IDLE_S = 10.0
_STATS_S = 10.0
_STATS = ("batches", "records", "outputs", "changelog", "poll_s", "handle_s", "txn_s",
          "age_ms", "age_max_ms")


@dataclass(frozen=True, slots=True)
class InRecord:
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
    # also consume topics matching this (Python) regex; the subscription uses
    # ``subscribe_pattern`` (a librdkafka regex, no lookarounds) and records of topics it
    # matches but ``input_pattern`` does not are skipped (their offsets still advance)
    input_pattern: str | None = None
    subscribe_pattern: str | None = None
    tick_topics: list[str] | None = None  # where the ticker writes (default: input_topics)
    # True: records of all input partitions are processed in one deterministic order, merged
    # by record timestamp (the order `trajbus replay explain` re-creates from the log).
    ordered: bool = False
    extra_topics: list[TopicSpec] = field(default_factory=list)


# A restore reads the whole changelog partition. Kafka never compacts the active segment, and
# its defaults (1 GiB / 7 days) keep nearly all of a busy worker's history there: small
# segments that roll every 10 minutes, cleaned once 10% is dirty (and at most 15 minutes
# after a write), keep a restore close to the live keys. Tombstones stay a day, long enough
# for any restore in progress to see them.
CHANGELOG_CONFIGS = {
    "segment.ms": str(10 * 60_000),
    "segment.bytes": str(64 * 1024 * 1024),
    "min.cleanable.dirty.ratio": "0.1",
    "max.compaction.lag.ms": str(15 * 60_000),
    "delete.retention.ms": str(24 * 3_600_000),
}


# A transaction step that does not finish in this time is aborted and the batch redone from
# the last commit (e.g. offsets sent with a group generation that a broker restart expired).
_TXN_TIMEOUT_S = 20.0
_RESTORE_TIMEOUT_S = 600.0
_TP = tuple[str, int]


def _where(msg: Message) -> tuple[str, int, int]:
    """(topic, partition, offset) of a consumed record (never None for a record)."""
    return str(msg.topic()), int(msg.partition() or 0), int(msg.offset() or 0)


class TransactionAborted(RuntimeError):
    """A batch's transaction was aborted; the runner rewound to the last commit."""


class _Wedged(RuntimeError):
    """A transactional call did not return within its timeout (librdkafka can block in
    send_offsets_to_transaction after a broker restart: confluentinc/librdkafka#5456).
    ``returned`` is set once the call has returned after all."""

    def __init__(self, message: str, returned: threading.Event) -> None:
        super().__init__(message)
        self.returned = returned


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
        self.stopping = threading.Event()
        self.processed = 0
        self.rewinds = 0
        # replaced producers still inside a call, kept until it returns (then destroyed)
        self._wedged: list[tuple[Producer, threading.Event]] = []
        self._consumer: Consumer | None = None
        self._producer: Producer | None = None
        self._ticks: Producer | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._known_topics: set[str] = set()
        self._input_rx = re.compile(spec.input_pattern) if spec.input_pattern else None
        self._pending: dict[_TP, deque[Message]] = {}
        self._empty_since: dict[_TP, float] = {}
        # Where a busy worker's time goes, logged (INFO) every _STATS_S while records flow.
        self._stats: dict[str, float] = dict.fromkeys(_STATS, 0.0)
        self._stats_since = time.monotonic()

    # -- state --------------------------------------------------------------------------
    def _slot(self, partition: int) -> int:
        return 0 if self.spec.global_state else partition

    def _drop(self, partitions: Iterable[TopicPartition]) -> None:
        for tp in partitions:
            key = (tp.topic, tp.partition)
            self._pending.pop(key, None)  # unreleased records are re-fetched by the new owner
            self._empty_since.pop(key, None)
        if not self.spec.global_state:
            for tp in partitions:
                self.cores.pop(tp.partition, None)

    async def restore(self, assigned: Iterable[Any]) -> None:
        """Rebuild the cores of the given input partitions (anything with ``.partition``)
        from the committed changelog (for tests and tools; the runner restores on
        assignment)."""
        slots = {self._slot(tp.partition) for tp in assigned}
        await asyncio.to_thread(self._restore_slots, slots)

    def _restore_slots(self, wanted: Iterable[int]) -> None:
        """Read the changelog partitions of ``wanted`` slots (those without a core) from the
        beginning to their end, committed records only, deletes included, into fresh cores."""
        slots = sorted(set(wanted) - set(self.cores))
        if not slots:
            return
        started = time.monotonic()
        fresh = {s: self.spec.factory() for s in slots}
        cfg = common_config(self.settings.kafka, f"{self.group_id}-{self.worker_id}-restore")
        cfg.update({"group.id": f"{self.group_id}.restore", "enable.auto.commit": False,
                    "isolation.level": "read_committed", "enable.partition.eof": True,
                    "max.partition.fetch.bytes": self.topics.derived_max_bytes + 65536,
                    "fetch.max.bytes": 4 * (self.topics.derived_max_bytes + 65536)})
        consumer = Consumer(cfg)
        restored = 0
        try:
            consumer.assign([TopicPartition(self.changelog, s, OFFSET_BEGINNING)
                             for s in slots])
            remaining = set(slots)
            deadline = time.monotonic() + _RESTORE_TIMEOUT_S
            while remaining:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{self.spec.name}: restoring {self.changelog} "
                                       f"partitions {sorted(remaining)} took over "
                                       f"{_RESTORE_TIMEOUT_S:.0f}s; is the broker up?")
                for msg in consumer.consume(1000, 0.5):
                    err = msg.error()
                    if err is not None:
                        if err.code() == KafkaError._PARTITION_EOF:
                            remaining.discard(_where(msg)[1])
                            continue
                        if err.fatal():
                            raise KafkaException(err)
                        continue  # transport hiccups: librdkafka retries
                    key = msg.key()
                    # A None (tombstone) deletes: until compaction the changelog holds a
                    # key's put and its later delete, and the delete must win.
                    fresh[_where(msg)[1]].restore(key.decode() if key else "", msg.value())
                    restored += 1
        finally:
            consumer.close()
        self.cores.update(fresh)
        log.info("%s: restored %d state records for partitions %s in %.2fs",
                 self.spec.name, restored, slots, time.monotonic() - started)

    # -- rebalance callbacks (called inside consume(), never during a transaction) --------
    def _on_assign(self, consumer: Consumer, partitions: list[TopicPartition]) -> None:
        self._restore_slots({self._slot(tp.partition) for tp in partitions})
        # the client assigns ``partitions`` (from their committed offsets) after this returns

    def _on_revoke(self, consumer: Consumer, partitions: list[TopicPartition]) -> None:
        self._drop(partitions)

    def _on_lost(self, consumer: Consumer, partitions: list[TopicPartition]) -> None:
        log.warning("%s: lost partitions %s (membership expired); another worker owns them",
                    self.spec.name, [(tp.topic, tp.partition) for tp in partitions])
        self._drop(partitions)

    # -- topics -------------------------------------------------------------------------
    async def _prepare_topics(self) -> None:
        parts = 1 if self.spec.global_state else self.settings.topics.partitions
        specs = [TopicSpec(self.changelog, parts, f"{self.spec.name} state changelog",
                           "state key", retention_ms=-1, compacted=True,
                           max_message_bytes=self.topics.derived_max_bytes,
                           configs=CHANGELOG_CONFIGS)]
        specs += self.topics.specs + list(self.spec.output_topics()) + self.spec.extra_topics
        specs += [TopicSpec(t, parts, "ticks", "-", retention_ms=3_600_000)
                  for t in self.spec.tick_topics or () if t not in {s.name for s in specs}]
        await ensure_topics(self.settings, specs)
        self._known_topics.update(s.name for s in specs)

    async def _ensure_output_topic(self, topic: str) -> None:
        if topic in self._known_topics:
            return
        await ensure_topics(self.settings, [TopicSpec(
            topic, self.settings.topics.partitions, "derived output", "sandbox/episode",
            max_message_bytes=self.topics.derived_max_bytes)])
        self._known_topics.add(topic)

    def _ensure_output_topic_sync(self, topic: str) -> None:
        if topic in self._known_topics:
            return
        assert self._loop is not None
        asyncio.run_coroutine_threadsafe(self._ensure_output_topic(topic),
                                         self._loop).result(timeout=120)

    # -- main loop ----------------------------------------------------------------------
    async def run(self, *, until_idle: float | None = None) -> None:
        """Process until stopped (or until no input arrived for ``until_idle`` seconds)."""
        await check_broker(self.settings.kafka)
        await self._prepare_topics()
        self._loop = asyncio.get_running_loop()
        await asyncio.to_thread(self._run, until_idle)

    def _subscription(self) -> list[str]:
        topics = list(self.spec.input_topics)
        if self.spec.subscribe_pattern:
            topics.append(self.spec.subscribe_pattern)
        return topics

    def _wanted(self, topic: str) -> bool:
        return (self._input_rx is None or topic in self.spec.input_topics
                or self._input_rx.fullmatch(topic) is not None)

    def _new_producer(self) -> Producer:
        """The transactional producer, initialised: this fences every older producer with
        this worker's transactional id (an earlier incarnation, or a wedged predecessor in
        this process) and aborts its open transaction, so what the changelog holds is what
        was committed."""
        k = self.settings.kafka
        producer = Producer(producer_config(
            k, f"{self.group_id}-{self.worker_id}",
            transactional_id=f"{self.group_id}.{self.worker_id}",
            # outputs wrap inputs (dead letters, segments): allow the derived topics' size
            max_request_size=max(k.max_request_size, self.topics.derived_max_bytes + 65536),
            # a batch's records are all appended before its commit, which flushes them:
            # lingering only delays every transaction
            linger_ms=0))
        deadline = time.monotonic() + _RESTORE_TIMEOUT_S
        while True:
            try:
                producer.init_transactions(_TXN_TIMEOUT_S)
                return producer
            except KafkaException as exc:
                err = exc.args[0]
                if err.fatal() or not err.retriable() or time.monotonic() > deadline:
                    raise
                log.warning("%s: initialising transactions: %s; retrying", self.spec.name, err)

    def _run(self, until_idle: float | None) -> None:
        k = self.settings.kafka
        # before any partition is assigned: a restore then reads only committed state
        self._producer = self._new_producer()
        self._ticks = Producer(producer_config(k, f"{self.group_id}-{self.worker_id}-ticker"))
        cfg = consumer_config(k, self.group_id, f"{self.group_id}-{self.worker_id}",
                              max_fetch_bytes=self.topics.derived_max_bytes + 65536)
        cfg["partition.assignment.strategy"] = "range"  # co-partitioned (module docstring)
        self._consumer = Consumer(cfg)
        self._consumer.subscribe(self._subscription(), on_assign=self._on_assign,
                                 on_revoke=self._on_revoke, on_lost=self._on_lost)
        tick_targets = self._tick_targets()
        interval = self.settings.scheduler.tick_interval_ms / 1000
        next_tick = time.monotonic() + interval
        tick_seq = 0
        idle_since = time.monotonic()
        try:
            while not self.stopping.is_set():
                if self._wedged:  # destroy replaced producers whose call has returned
                    self._wedged = [(p, r) for p, r in self._wedged if not r.is_set()]
                if time.monotonic() >= next_tick:
                    self._tick(tick_targets, tick_seq)
                    tick_seq += 1
                    next_tick = time.monotonic() + interval
                t_poll = time.perf_counter()
                msgs = self._consumer.consume(2000, 0.2)
                self._stats["poll_s"] += time.perf_counter() - t_poll
                batch = self._data(msgs)
                if not batch:
                    if until_idle is not None and time.monotonic() - idle_since > until_idle:
                        break
                    continue
                now_ms = time.time() * 1000
                ages = [now_ms - m.timestamp()[1] for m in batch]
                self._stats["age_ms"] += sum(ages)
                self._stats["age_max_ms"] = max(self._stats["age_max_ms"], max(ages))
                if any(m.key() != TICK_KEY for m in batch):
                    idle_since = time.monotonic()
                if self.spec.ordered:
                    for m in batch:
                        self._pending.setdefault(_where(m)[:2], deque()).append(m)
                    ready = self._release()
                else:
                    ready = batch
                if ready:
                    self._process(ready)
        finally:
            try:
                self._consumer.close()  # revokes (and, non-static, leaves) the group
            finally:
                self._ticks.flush(10)

    def _data(self, msgs: list[Message]) -> list[Message]:
        """The records of a consume() call; client errors are logged (librdkafka retries
        transport errors itself), fatal ones raise."""
        out = []
        for m in msgs:
            err = m.error()
            if err is None:
                out.append(m)
            elif err.fatal():
                raise KafkaException(err)
            else:
                log.debug("%s: consumer: %s", self.spec.name, err)
        return out

    def _tick_targets(self) -> list[tuple[str, int]]:
        assert self._ticks is not None
        names = self.spec.tick_topics or self.spec.input_topics
        meta = self._ticks.list_topics(timeout=30)
        targets = []
        for t in names:
            parts = meta.topics.get(t)
            if parts is None or parts.error is not None:
                raise RuntimeError(f"{self.spec.name}: tick topic {t} does not exist")
            targets += [(t, p) for p in sorted(parts.partitions)]
        return targets

    def _tick(self, targets: list[tuple[str, int]], seq: int) -> None:
        """Publish a Tick into every partition of the tick topics (default: the input
        topics), so time-driven rules fire without traffic, the ticks are replayable from
        the log, and a tick inside an input partition marks how far that partition has been
        written (a processing-time watermark)."""
        assert self._ticks is not None
        now = int(time.time() * 1000)
        tick = Tick(header=Envelope(task="_tick", sandbox="_tick", seq=seq, event_time_ms=now,
                                    producer_id=f"{self.group_id}.{self.worker_id}")).encode()
        for topic, p in targets:
            try:
                self._ticks.produce(topic, tick, key=TICK_KEY, partition=p)
            except BufferError:  # the broker is unreachable and the queue full: skip a tick
                break
        self._ticks.poll(0)

    def _release(self) -> list[Message]:
        """Ordered mode: pop records in (timestamp, topic rank, topic, partition) order of the
        partition heads, but only while every assigned input partition has a head — its next
        record could otherwise be older. Ticks in every input partition guarantee progress;
        a partition silent for longer than ``_MAX_IDLE_S`` stops blocking (logged)."""
        assert self._consumer is not None
        rank = {t: i for i, t in enumerate(self.spec.input_topics)}
        blocking = [(tp.topic, tp.partition) for tp in self._consumer.assignment()
                    if tp.topic in rank]
        now = time.monotonic()
        out: list[Message] = []
        while True:
            empty = [tp for tp in blocking if not self._pending.get(tp)]
            if empty:
                for tp in empty:
                    self._empty_since.setdefault(tp, now)
                if all(now - self._empty_since[tp] < _MAX_IDLE_S for tp in empty):
                    break
                log.warning("%s: partitions %s silent for %ss; not waiting for them",
                            self.spec.name, empty, _MAX_IDLE_S)
            heads = [tp for tp, q in self._pending.items() if q]
            if not heads:
                break
            tp = min(heads, key=lambda t: (self._pending[t][0].timestamp()[1],
                                           rank.get(t[0], len(rank)), t[0], t[1]))
            out.append(self._pending[tp].popleft())
            if self._pending[tp]:
                self._empty_since.pop(tp, None)
            else:
                self._empty_since[tp] = now
        return out

    def _process(self, records: list[Message]) -> None:
        """One batch: cores -> outputs and state -> one transaction with the input offsets.
        A failed transaction is aborted and the runner rewinds (module docstring)."""
        try:
            self._transact(*self._prepare(records))
        except TransactionAborted as exc:
            log.warning("%s: %s; rewound to the last commit", self.spec.name, exc)

    def _prepare(self, records: list[Message]
                 ) -> tuple[list[OutRecord], list[tuple[int, str, bytes | None]],
                            dict[_TP, int], dict[str, int], int, float]:
        outs: list[OutRecord] = []
        offsets: dict[_TP, int] = {}
        started = time.perf_counter()
        # Records per core slot, each in log order (cores are independent, so interleaving
        # across slots does not matter; an ordered/global spec has a single slot).
        by_slot: dict[int, list[InRecord]] = {}
        counts_in: dict[str, int] = {}
        owned = {(tp.topic, tp.partition) for tp in self._consumer.assignment()} \
            if self._consumer is not None else set()
        for msg in records:
            topic, partition, offset = _where(msg)
            if (topic, partition) not in owned:
                continue  # revoked since it was fetched: its new owner processes it
            offsets[(topic, partition)] = offset + 1
            if not self._wanted(topic):
                continue  # e.g. an operator's debug replay topic: never a live input
            slot = self._slot(partition)
            if slot not in self.cores:  # defensive: assignment always restores first
                self._restore_slots({slot})
            by_slot.setdefault(slot, []).append(InRecord(
                topic, partition, offset, msg.key(), msg.value() or b"", msg.timestamp()[1]))
            counts_in[topic] = counts_in.get(topic, 0) + 1
        for slot, recs in by_slot.items():
            core = self.cores[slot]
            handle_batch = getattr(core, "handle_batch", None)
            if handle_batch is not None:  # coalesces its outputs for this one transaction
                outs.extend(handle_batch(recs))
            else:
                for rec in recs:
                    outs.extend(core.handle(rec))
        state = [(slot, key, blob) for slot in by_slot
                 for key, blob in self.cores[slot].take_dirty().items()]
        for topic in {o.topic for o in outs}:
            self._ensure_output_topic_sync(topic)
        st = self._stats
        st["batches"] += 1
        st["records"] += len(records)
        st["outputs"] += len(outs)
        st["changelog"] += len(state)
        st["handle_s"] += time.perf_counter() - started
        return outs, state, offsets, counts_in, len(records), started

    def _produce(self, topic: str, value: bytes | None, key: bytes | None,
                 partition: int | None) -> None:
        assert self._producer is not None
        while True:
            try:
                if partition is None:
                    self._producer.produce(topic, value, key)
                else:
                    self._producer.produce(topic, value, key, partition)
                return
            except BufferError:  # the local queue is full: let librdkafka send some
                self._producer.poll(0.05)

    def _transact(self, outs: list[OutRecord], state: list[tuple[int, str, bytes | None]],
                  offsets: dict[_TP, int], counts_in: dict[str, int], n_records: int,
                  started: float) -> None:
        assert self._producer is not None and self._consumer is not None
        producer = self._producer
        t_txn = time.perf_counter()
        try:
            producer.begin_transaction()
            for o in outs:
                self._produce(o.topic, o.value, o.key, o.partition)
            for slot, key, blob in state:
                self._produce(self.changelog, blob, key.encode(), slot)
            self._bounded(producer.send_offsets_to_transaction,
                          [TopicPartition(t, p, off) for (t, p), off in offsets.items()],
                          self._consumer.consumer_group_metadata(), _TXN_TIMEOUT_S)
            producer.commit_transaction(_TXN_TIMEOUT_S)
        except _Wedged as exc:
            self._wedged.append((producer, exc.returned))  # returns (fenced) once replaced
            self._producer = self._new_producer()  # fences it, aborts its transaction
            self._rewind()
            raise TransactionAborted(f"{exc}; producer replaced") from exc
        except KafkaException as exc:
            err = exc.args[0]
            if not isinstance(err, KafkaError) or err.fatal():
                raise  # e.g. fenced by a newer incarnation of this worker id: exit
            self._abort_and_rewind()
            raise TransactionAborted(f"transaction failed ({err}); aborted") from exc
        counts_out: dict[str, int] = {}
        for out in outs:
            counts_out[out.topic] = counts_out.get(out.topic, 0) + 1
        for topic, n in counts_in.items():
            metrics.EVENTS_IN.labels(self.spec.name, topic).inc(n)
        for topic, n in counts_out.items():
            metrics.EVENTS_OUT.labels(self.spec.name, topic).inc(n)
        done = time.perf_counter()
        metrics.BATCH_SECONDS.labels(self.spec.name).observe(done - started)
        self.processed += n_records
        self._stats["txn_s"] += done - t_txn
        if time.monotonic() - self._stats_since >= _STATS_S:
            self._log_stats()

    def _bounded(self, call: Callable[..., Any], *args: Any) -> None:
        """``call(*args)`` in a helper thread, waiting at most its own timeout plus a margin:
        a call that does not return by then is wedged (``_Wedged``)."""
        box: dict[str, BaseException] = {}
        done = threading.Event()

        def target() -> None:
            try:
                call(*args)
            except BaseException as exc:
                box["exc"] = exc
            finally:
                done.set()

        threading.Thread(target=target, name=f"{self.spec.name}-txn", daemon=True).start()
        if not done.wait(_TXN_TIMEOUT_S + 5):
            raise _Wedged(f"{getattr(call, '__name__', 'call')} did not return within "
                          f"{_TXN_TIMEOUT_S + 5:.0f}s", done)
        if "exc" in box:
            raise box["exc"]

    def _abort_and_rewind(self) -> None:
        """Abort the open transaction (retrying while the broker is unreachable; a producer
        that cannot abort is replaced, which aborts it), then rewind."""
        assert self._producer is not None
        deadline = time.monotonic() + _RESTORE_TIMEOUT_S
        while True:
            try:
                self._producer.abort_transaction(_TXN_TIMEOUT_S)
                break
            except KafkaException as exc:
                err = exc.args[0]
                if err.fatal():
                    raise
                if time.monotonic() > deadline or not err.retriable():
                    # a new producer with the same transactional id fences this one and
                    # aborts its transaction; the old one is destroyed when dropped
                    self._producer = self._new_producer()
                    break
                log.warning("%s: aborting the transaction: %s; retrying", self.spec.name, err)
                time.sleep(1.0)
        self._rewind()

    def _rewind(self) -> None:
        """Put every assigned partition back where the last commit left it: cores rebuilt
        from the committed changelog, positions at the committed offsets."""
        assert self._consumer is not None
        self.rewinds += 1
        assignment = self._consumer.assignment()
        committed = self._consumer.committed(assignment, timeout=_TXN_TIMEOUT_S)
        self._drop(assignment)
        if self.spec.global_state:
            self.cores.clear()
        self._restore_slots({self._slot(tp.partition) for tp in assignment})
        for tp in committed:
            self._consumer.seek(TopicPartition(
                tp.topic, tp.partition, tp.offset if tp.offset >= 0 else OFFSET_BEGINNING))

    def _log_stats(self) -> None:
        st, now = self._stats, time.monotonic()
        b = max(1.0, st["batches"])
        log.info("%s: %.0fs: %d batches, %.1f records/batch, %.1f outputs + %.1f state "
                 "records/batch; per batch %.1f ms polling, %.1f ms processing, %.1f ms "
                 "transaction; input age at poll mean %.0f ms, max %.0f ms", self.spec.name,
                 now - self._stats_since, st["batches"], st["records"] / b, st["outputs"] / b,
                 st["changelog"] / b, 1000 * st["poll_s"] / b, 1000 * st["handle_s"] / b,
                 1000 * st["txn_s"] / b, st["age_ms"] / max(1.0, st["records"]),
                 st["age_max_ms"])
        self._stats = dict.fromkeys(_STATS, 0.0)
        self._stats_since = now
