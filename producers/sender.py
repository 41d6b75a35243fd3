"""The shared sender: one send task per event loop for every :class:`SandboxEmitter` on it.

A node runs hundreds to thousands of sandboxes, each with its own emitter, most emitting about
one event a second. Sending alone, each emitter's own task woke, synced its journal, sent one
record and journaled one ack per event: the per-event overhead of a task was paid 1,000 times
a second (issue 18, item 4). Here the emitters of one loop hand their ready queues to one
:class:`SharedSender` task that runs *rounds*:

0. while more than one emitter is open, start at most one round per
   ``settings.producer.send_round_ms`` (10 ms), and per that much for every 100 open emitters
   beyond the first hundred, up to ``send_round_max_ms`` (50 ms at 500 emitters and more): at 1
   event/s per emitter a round then serves ~10 emitters per 100 open instead of one or two, for
   at most that much more send latency. With more than 100 open, the loop's thread also gets a
   Linux timer slack of that interval (at most ``timer_slack_max_ms``; see
   :mod:`trajbus.producers.timerslack`): timers on the loop, the callers' sleeps included, may
   end that much late, so their wake-ups coalesce. The thread's own slack is restored when 100
   or fewer are open;
1. take every emitter that became ready since the last round, pop each one's pending events
   (in record-id, i.e. seq, order; at most ``SEND_BATCH`` each);
2. one sync round, in one thread hand-off, over the journals of those emitters with
   ``durability="fsync"`` that were written since their last sync: the fd duplicated *after*
   the events were appended, so every one of them is on disk before it is sent ("durable
   before sent", as before). With ``journal_sync="filesystem"`` (default) the journals of a
   round that share a filesystem are made durable by one ``syncfs(2)`` -- a group commit
   across sandboxes, without giving up the per-sandbox journal directory (each sandbox's
   unit of locking, recovery and migration). A lone journal, or ``journal_sync="file"``,
   gets its own ``fdatasync``. ``syncfs`` also writes back other dirty data of the
   filesystem; measured on ext4 it was still the faster of the two beside a heavy writer
   (bench/ANALYSIS.md "Group commit"), so there is no automatic switch between them. A round
   whose sync took over ``SLOW_SYNC_WARN_S`` holds up every emitter's sends (not its emits)
   and is logged, at most every ``SLOW_SYNC_WARN_EVERY_S``;
3. hand them to the process's shared producer by partition: each (topic, partition) has a
   *lane*, the events the rounds gave it, in their order; one task per busy
   lane builds a batch of everything queued (``create_batch``) and submits it
   (``send_batch``), which waits only until *that* partition's previous batch is drained --
   a slow partition holds up its own lane, no other. One delivery future per batch
   acknowledges its events (offset = the batch's base offset + the event's place in it),
   instead of a ``send()`` coroutine, a partition look-up and a future per event
   (bench/ANALYSIS.md "Batches by partition").

What is durable when (``durability="fsync"``): an event is in the journal (``write(2)``, so it
survives SIGKILL of the process) when its ``emit`` returns; it is on disk (``fdatasync``) before
it is handed to the producer; it is acknowledged once the broker has it (``acks=all``,
idempotent producer). Nothing is sent that a host crash could take out of the journal.

Ack records are not written by the sender: an emitter journals the acks it collected in the
same ``write(2)`` as its next event (or at ``flush``/``drain``/``close``, or when a drained
segment is due to roll: the emitter asks the sender for that turn).

Failures stay per emitter: a failed journal sync stops sending *that* emitter's events (its
journal may have lost pages; they stay journaled and are re-sent by the next emitter on the
directory) and is reported in its ``last_error`` (a failed ``syncfs`` cannot say whose pages
were lost, so it counts as failed for every journal it covered); a batch the producer
refuses (``send_batch`` raised) gives every event its lane held back to its emitter's queue,
each emitter retrying after its backoff, while the other lanes go on; the events of a batch
whose delivery failed are re-queued at once. An event is handed to a lane only while its
emitter is active, not backing off, and holds no earlier event back in its queue, so a
refusal never lets an emitter's later events overtake its earlier ones in the partition.
Handed to a lane is handed to the producer: like a record in aiokafka's accumulator, it is
sent even if its emitter pauses or closes meanwhile. A
delivery that failed for good (an idempotent producer that lost a sequence after a long broker
outage has every later batch of that partition refused: RELIABILITY finding Y) makes the next
round replace the process's shared producer first (so does a ``send_batch`` that raised
because the producer's own sender task crashed); the events it failed are sent again through
the new one, and so are those of its batches still unresolved once it is stopped, or
submitted to it after (aiokafka may append a batch that waited for its partition to a
closing accumulator, where it would never resolve). Every lane sends through the one
current producer, so a retired one is never used again.

The sender talks to its emitters through a small protocol (the ``_sender_*`` methods of
:class:`~trajbus.producers.emitter.SandboxEmitter`): take a batch, the journal fd to sync, put
events back, retry later, acknowledged, failed.
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import logging
import os
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from aiokafka import AIOKafkaProducer
from aiokafka.partitioner import murmur2

from trajbus.bus.kafka import lasting_delivery_error, sender_crash
from trajbus.bus.producer import replace_producer
from trajbus.bus.settings import KafkaSettings
from trajbus.producers.journal import syncfs
from trajbus.producers.timerslack import get_timer_slack_ns, set_timer_slack_ns

if TYPE_CHECKING:
    from trajbus.producers.emitter import SandboxEmitter, _Item

log = logging.getLogger(__name__)

SEND_BATCH = 2000  # events of one emitter per round
SLACK_MIN_MEMBERS = 100  # beyond this many open emitters the loop thread gets a timer slack
BACKOFF_MIN_S = 0.05
BACKOFF_MAX_S = 2.0

# A sync round this slow delays every emitter's sends: say so, at most this often.
SLOW_SYNC_WARN_S = 1.0
SLOW_SYNC_WARN_EVERY_S = 300.0

SyncFn = Callable[[int], None]


class SharedSender:
    """Sends for every emitter of one event loop; see the module docstring."""

    def __init__(self, sync_fn: SyncFn = os.fdatasync,
                 syncfs_fn: SyncFn | None = syncfs) -> None:
        self._sync_fn = sync_fn
        self._syncfs_fn = syncfs_fn  # None: per-file syncs only
        # Counters (tests, bench): journals made durable, and the calls that did it.
        self.journals_synced = 0
        self.syncfs_calls = 0
        self.fdatasyncs = 0
        self.slow_sync_rounds = 0  # over SLOW_SYNC_WARN_S
        self._slow_unreported = 0
        self._slow_longest = 0.0
        self._slow_warned_at: float | None = None
        self._ready: dict[SandboxEmitter, None] = {}  # insertion-ordered set
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._members = 0
        self._last_round = 0.0
        self.round_s: float | None = None  # the smallest send_round_ms of the members, in s
        self.round_max_s: float | None = None  # the smallest send_round_max_ms, in s
        self.slack_max_s: float | None = None  # the smallest timer_slack_max_ms, in s
        # The loop thread's timer slack set by this sender (ns), and the thread's own before.
        self.timer_slack_ns: int | None = None
        self._thread_slack_ns: int | None = None
        self.rounds = 0  # for tests and metrics
        self.sync_rounds = 0
        # The last shared producer found broken (its deliveries failed for good) and its
        # replacement: emitters still holding an older one move to it as they send.
        self._broken: AIOKafkaProducer | None = None
        self._replacement: AIOKafkaProducer | None = None
        # The producer every lane sends through: the newest member's (the process's shared
        # one when it joined), or the replacement of a broken one. Others are retired.
        self._current: AIOKafkaProducer | None = None
        self.replacements = 0
        self._lanes: dict[tuple[str, int], _Lane] = {}  # (topic, partition)
        # submitted batches not yet acknowledged or failed, by producer
        self._unsettled: dict[AIOKafkaProducer, set[_Sent]] = {}

    # -- membership ---------------------------------------------------------------------------
    def join(self, em: SandboxEmitter) -> None:
        self._members += 1
        if em._producer is not None:
            self._current = em._producer
        r = max(0.0, em.settings.producer.send_round_ms / 1000)
        r_max = max(r, em.settings.producer.send_round_max_ms / 1000)
        slack = max(0.0, em.settings.producer.timer_slack_max_ms / 1000)
        if self._task is None or self._task.done():
            self.round_s, self.round_max_s, self.slack_max_s = r, r_max, slack
            self._task = asyncio.get_running_loop().create_task(
                self._run(), name="trajbus-emitter-sender")
            self._task.add_done_callback(self._task_ended)
        else:
            self.round_s = r if self.round_s is None else min(self.round_s, r)
            self.round_max_s = r_max if self.round_max_s is None else min(self.round_max_s, r_max)
            self.slack_max_s = slack if self.slack_max_s is None else min(self.slack_max_s, slack)
        self._adjust_timer_slack()

    def round_interval(self) -> float:
        """Seconds between the starts of two rounds: 0 for a lone emitter, ``send_round_ms``
        up to 100 open emitters, that much per 100 beyond, at most ``send_round_max_ms``."""
        if self._members <= 1 or not self.round_s:
            return 0.0
        grown = self.round_s * max(1.0, self._members / 100)
        return min(grown, max(self.round_s, self.round_max_s or 0.0))

    def timer_slack_s(self) -> float:
        """The timer slack this sender wants on its loop's thread: none up to 100 open
        emitters; beyond, the round interval, at most ``timer_slack_max_ms``. Every timed wait
        of that thread may then end that much late: the rounds' own wait and the producer's
        linger too, so an event can wait up to about twice the round interval, plus linger,
        before it is sent (an emit returns as fast: it waits for no timer)."""
        if self._members <= SLACK_MIN_MEMBERS or not self.slack_max_s:
            return 0.0
        return min(self.round_interval(), self.slack_max_s)

    def _adjust_timer_slack(self) -> None:
        """Apply :meth:`timer_slack_s` to the calling (the loop's) thread, or give the thread
        back its own slack. Called from join and leave, which run on the loop."""
        want = int(self.timer_slack_s() * 1e9)
        if want == (self.timer_slack_ns or 0):
            return
        if not want:
            self._release_timer_slack()
            return
        now = get_timer_slack_ns()
        if now is None:
            return  # not Linux: nothing to do
        if now != self.timer_slack_ns:  # first time, or someone else set it meanwhile: theirs
            self._thread_slack_ns = now  # is what the thread gets back
        if set_timer_slack_ns(want):
            self.timer_slack_ns = want

    def _release_timer_slack(self) -> None:
        """Give the loop's thread back the slack it had before this sender set one -- unless
        someone else changed it meanwhile (theirs is kept)."""
        if self.timer_slack_ns is None:
            return
        if self._thread_slack_ns and get_timer_slack_ns() == self.timer_slack_ns:
            set_timer_slack_ns(self._thread_slack_ns)
        self.timer_slack_ns = None

    def leave(self, em: SandboxEmitter) -> None:
        self._members -= 1
        self._ready.pop(em, None)
        self._adjust_timer_slack()
        if self._members <= 0:
            self._wake.set()  # let the task see it has nothing left to do and end

    def notify(self, em: SandboxEmitter) -> None:
        """``em`` has pending events (or acks to journal): include it in the next round."""
        if em not in self._ready:
            self._ready[em] = None
            if not self._wake.is_set():
                self._wake.set()

    def retry_later(self, em: SandboxEmitter, delay: float) -> None:
        asyncio.get_running_loop().call_later(delay, self._retry, em)

    def _retry(self, em: SandboxEmitter) -> None:
        if em._sender_wants_round():
            self.notify(em)

    # -- the rounds ---------------------------------------------------------------------------
    def _task_ended(self, task: asyncio.Task[None]) -> None:
        """The send task ended -- also cancelled with emitters still open, the loop ending,
        maybe before it ever ran: the thread gets its own slack back."""
        if self._task is task:
            self._release_timer_slack()

    async def _run(self) -> None:
        wake = self._wake
        while True:
            if not self._ready:
                if self._members <= 0:
                    return
                wake.clear()
                await wake.wait()
                continue
            loop = asyncio.get_running_loop()
            interval = self.round_interval()  # one emitter alone never waits
            if interval:
                wait = self._last_round + interval - loop.time()
                if wait > 0:
                    await asyncio.sleep(wait)
            self._last_round = loop.time()
            ready, self._ready = self._ready, {}
            try:
                await self._round(ready)
            except Exception:  # pragma: no cover - a bug; the other emitters must keep going
                log.exception("emitter sender round failed")
            self.rounds += 1
            await asyncio.sleep(0)  # let emitters run between rounds

    def producer_failed(self, producer: AIOKafkaProducer, exc: BaseException) -> None:
        """A delivery through ``producer`` failed for good (:func:`lasting_delivery_error`):
        the next round replaces it before sending."""
        if producer is self._current and producer is not self._broken:  # not a retired one
            log.warning("the shared Kafka producer can no longer deliver (%s: %s); replacing "
                        "it (its undelivered events are sent again)", type(exc).__name__, exc)
            self._broken, self._replacement = producer, None

    async def _replace_broken(self, kafka: KafkaSettings) -> bool:
        """Build the replacement of a broken producer; False while the broker is away."""
        assert self._broken is not None
        try:
            self._replacement = await replace_producer(self._broken, kafka)
        except Exception as exc:  # the broker is away: the next round tries again
            log.warning("cannot replace the shared Kafka producer yet (%s: %s)",
                        type(exc).__name__, exc)
            return False
        self.replacements += 1
        self._current = self._replacement
        self._settle_replaced(self._broken)
        return True

    def _producer_of(self, em: SandboxEmitter) -> AIOKafkaProducer | None:
        # the emitters of a process share one producer: any other they hold was replaced
        current = self._current
        if current is None:
            current = self._current = em._producer
        elif em._producer is not current:
            em._producer = current
        return current

    async def _round(self, ready: dict[SandboxEmitter, None]) -> None:
        if self._broken is not None and self._replacement is None and ready:
            if not await self._replace_broken(next(iter(ready)).settings.kafka):
                for em in ready:  # nothing is taken: they wait for the next round
                    self.retry_later(em, BACKOFF_MAX_S)
                return
        batches: list[tuple[SandboxEmitter, list[_Item]]] = []
        syncing: list[tuple[SandboxEmitter, int]] = []
        whole_fs: list[bool] = []  # per syncing journal: may a syncfs cover it
        # -- no await: a batch is taken and its journal's fd duplicated in one step -----------
        now = asyncio.get_running_loop().time()
        for em in ready:
            batch = em._sender_take(SEND_BATCH, now)
            if not batch:
                continue
            if em._sender_wants_round():  # a backlog: the rest goes in the next round
                self._ready[em] = None
            try:
                fd = em._sender_sync_fd()
            except OSError as exc:
                em._sender_sync_failed(batch, exc)
                continue
            if fd is not None:
                syncing.append((em, fd))
                whole_fs.append(em.settings.producer.journal_sync == "filesystem")
            batches.append((em, batch))
        if syncing:
            fds = [fd for _, fd in syncing]
            loop = asyncio.get_running_loop()
            started = loop.time()
            try:
                errors = await asyncio.to_thread(self._sync_journals, fds, whole_fs)
            except Exception as exc:  # no sync happened (e.g. the executor is shut down)
                for em, batch in batches:
                    em._sender_retry(batch, f"journal sync round: {type(exc).__name__}: {exc}",
                                     BACKOFF_MAX_S)
                for em, _ in syncing:
                    em._sender_unsynced()  # sync again before sending
                return
            finally:
                for fd in fds:
                    os.close(fd)
            self.sync_rounds += 1
            self.journals_synced += len(fds)
            took = loop.time() - started
            if took > SLOW_SYNC_WARN_S:
                self._slow_sync(took, syncing, whole_fs, loop.time())
            failed = {em: exc for (em, _), exc in zip(syncing, errors, strict=True)
                      if exc is not None}
            if failed:
                kept = []
                for em, batch in batches:
                    err = failed.get(em)
                    if err is None:
                        kept.append((em, batch))
                    else:
                        em._sender_sync_failed(batch, err)
                batches = kept
        if batches:
            await self._send(batches)

    def _sync_journals(self, fds: list[int], whole_fs: list[bool]) -> list[OSError | None]:
        """Make the journals behind ``fds`` durable (in a worker thread; one round at a time).
        Returns each one's error, or None. Journals that may share a ``syncfs`` are grouped by
        filesystem; a group of one gets an ``fdatasync``, as do the others."""
        errors: list[OSError | None] = [None] * len(fds)
        groups: dict[int, list[int]] = {}  # st_dev -> indexes into fds
        per_file: list[int] = []
        for i, fd in enumerate(fds):
            if not whole_fs[i] or self._syncfs_fn is None:
                per_file.append(i)
                continue
            try:
                groups.setdefault(os.fstat(fd).st_dev, []).append(i)
            except OSError as exc:
                errors[i] = exc
        for members in groups.values():
            if len(members) == 1 or self._syncfs_fn is None:
                per_file.extend(members)
                continue
            self.syncfs_calls += 1
            try:
                self._syncfs_fn(fds[members[0]])
            except OSError as exc:
                for i in members:
                    errors[i] = exc
        for i in per_file:
            self.fdatasyncs += 1
            try:
                self._sync_fn(fds[i])
            except OSError as exc:
                errors[i] = exc
        return errors

    def _slow_sync(self, took: float, syncing: list[tuple[SandboxEmitter, int]],
                   whole_fs: list[bool], now: float) -> None:
        self.slow_sync_rounds += 1
        self._slow_unreported += 1
        self._slow_longest = max(self._slow_longest, took)
        if (self._slow_warned_at is not None
                and now - self._slow_warned_at < SLOW_SYNC_WARN_EVERY_S):
            return
        journal = syncing[0][0]._journal
        where = journal.dir.parent if journal is not None else "?"
        how = ("syncfs" if self._syncfs_fn is not None and sum(whole_fs) > 1
               else "fdatasync per journal")
        log.warning(
            "journal sync rounds are slow: %d over %.0f s since the last such warning, the "
            "longest %.1f s (the last: %d journals, %s, %.1f s). Every emitter's events reach "
            "Kafka that much later; emits are not held up (they return once journaled). The "
            "disk holding the journals (%s) is busy or slow: give the sandboxes' state_dir a "
            "filesystem of its own if heavy writers share it", self._slow_unreported,
            SLOW_SYNC_WARN_S, self._slow_longest, len(syncing), how, took, where)
        self._slow_warned_at = now
        self._slow_unreported = 0
        self._slow_longest = 0.0

    async def _send(self, batches: list[tuple[SandboxEmitter, list[_Item]]]) -> None:
        """Hand each emitter's events, in seq order, to the lanes of their partitions."""
        counts: dict[tuple[AIOKafkaProducer, str], int | str] = {}  # per round: or the error
        busy: dict[tuple[str, int], _Lane] = {}
        for em, batch in batches:
            try:
                await self._hand_over(em, batch, counts, busy)
            except Exception as exc:  # a broken emitter must not stop the others
                em._sender_stop(f"sender: {type(exc).__name__}: {exc}")
        for key, lane in busy.items():
            if (lane.task is None or lane.task.done()) and lane.entries:
                lane.task = asyncio.get_running_loop().create_task(
                    self._run_lane(key, lane), name="trajbus-emitter-lane")

    async def _hand_over(self, em: SandboxEmitter, batch: list[_Item],
                         counts: dict[tuple[AIOKafkaProducer, str], int | str],
                         busy: dict[tuple[str, int], _Lane]) -> None:
        producer = self._producer_of(em)
        assert producer is not None
        key = em._key
        loop = asyncio.get_running_loop()
        for i, item in enumerate(batch):
            count = counts.get((producer, item.topic))
            if count is None:
                try:  # known metadata: no wait; unknown: once per topic and round
                    count = len(await producer.partitions_for(item.topic))
                except Exception as exc:  # KafkaTimeoutError, connection errors...
                    count = f"{type(exc).__name__}: {exc}"
                counts[(producer, item.topic)] = count
            # -- no await from here to the append: the check holds when the event goes --
            # Paused or closed while this round awaited, or earlier events of this emitter
            # were refused meanwhile (these must not overtake them): back to its queue.
            if not em._sender_may_send(item.rid, loop.time()):
                em._sender_put_back(batch[i:])
                return
            if isinstance(count, str):
                em._sender_retry(batch[i:], count)
                return
            lane_key = (item.topic, partition_of(key, count))
            lane = self._lanes.get(lane_key)
            if lane is None:
                lane = self._lanes[lane_key] = _Lane()
            busy[lane_key] = lane
            # a spilled event's bytes are read from the journal only when its batch is built:
            # a lane holds at most about two batches' worth of bytes, however long it is
            lane.entries.append((em, item))
            item.in_flight = True

    async def _run_lane(self, key: tuple[str, int], lane: _Lane) -> None:
        """Send what ``lane`` holds, a batch at a time, through the process's current producer,
        until it is empty; then the lane is dropped (the next round makes a new one). The only
        task of its lane: the partition's batches go in the order the rounds queued their
        events. Whatever it took and did not submit goes back to its emitters, however the task
        ends (an event is in flight from its hand-over until submitted, acked or given back)."""
        topic, partition = key
        entries: list[tuple[SandboxEmitter, _Item]] = []
        unreadable: set[SandboxEmitter] = set()  # a journal read failed: it sends no more
        start = 0
        ended = "sender stopped"
        try:
            while lane.entries:
                entries, lane.entries = lane.entries, []
                start = 0
                while start < len(entries):
                    producer = self._producer_of(entries[start][0])
                    assert producer is not None
                    builder = producer.create_batch()
                    chunk: list[tuple[SandboxEmitter, _Item, bytes]] = []
                    end = start
                    for em, item in itertools.islice(entries, start, None):
                        value = None if em in unreadable else item.value
                        if value is None and em not in unreadable:
                            value = em._sender_value(item)  # spilled: from the journal
                            if value is None:  # closed (its successor re-sends), or unreadable
                                unreadable.add(em)
                                em._sender_stop(f"journal read: {em.last_error}")
                        if value is None:  # none of its later events goes either: no holes
                            item.in_flight = False
                            end += 1
                            continue
                        if builder.append(timestamp=None, key=em._key, value=value) is None:
                            break  # full (a batch's first record always fits)
                        chunk.append((em, item, value))
                        end += 1
                    if not chunk:  # pragma: no cover - every one's journal vanished
                        start = end
                        continue
                    try:
                        fut = await producer.send_batch(builder, topic, partition=partition)
                    except Exception as exc:  # KafkaTimeoutError, a closed producer...
                        # everything this lane holds goes back (the finally below), so each
                        # emitter's events stay in seq order within the partition
                        if sender_crash(producer) is not None:  # it can send nothing more
                            self.producer_failed(producer, exc)
                        ended = f"{type(exc).__name__}: {exc}"
                        return
                    start = end
                    if not self._submitted(producer, topic, partition, chunk, fut):
                        # its producer was replaced meanwhile: the chunk goes again, and what
                        # the lane holds behind it goes back too, not to overtake it
                        ended = "the shared producer was replaced"
                        return
                    for em, _item, _value in chunk:
                        em._sender_sent_ok()
        except asyncio.CancelledError:
            ended = "sender cancelled"
            raise
        finally:
            rest = [(em, item) for em, item in itertools.chain(
                itertools.islice(entries, start, None), lane.entries) if item.in_flight]
            lane.entries = []
            if rest:
                _refused(rest, ended)
            lane.task = None
            if self._lanes.get(key) is lane:
                del self._lanes[key]

    def _submitted(self, producer: AIOKafkaProducer, topic: str, partition: int,
                   chunk: list[tuple[SandboxEmitter, _Item, bytes]],
                   fut: asyncio.Future[Any]) -> bool:
        """A batch is in ``producer``'s accumulator: its future settles its events -- unless
        the producer is replaced first (see :meth:`_settle_replaced`). False: it was already
        (the batch's events are sent again)."""
        sent = _Sent(chunk, fut)
        if producer is not self._current:
            # replaced (or dropped) while this batch waited for its partition: aiokafka may
            # have appended it to the closing accumulator after the flush, where it would
            # never resolve -- sent again through the current producer
            self._settle(sent, producer, topic, partition, _REPLACED)
            return False
        self._unsettled.setdefault(producer, set()).add(sent)
        fut.add_done_callback(functools.partial(self._batch_delivered, producer, topic,
                                                partition, sent))
        return True

    def _batch_delivered(self, producer: AIOKafkaProducer, topic: str, partition: int,
                         sent: _Sent, fut: asyncio.Future[Any]) -> None:
        """A batch's delivery future resolved: acknowledge (or fail) each of its events."""
        if fut.cancelled():
            self._settle(sent, producer, topic, partition, asyncio.CancelledError())
        else:
            self._settle(sent, producer, topic, partition, fut.exception())

    def _settle(self, sent: _Sent, producer: AIOKafkaProducer, topic: str, partition: int,
                exc: BaseException | None) -> None:
        if sent.settled:
            return  # given back when its producer was replaced: the late outcome is moot
        sent.settled = True
        unsettled = self._unsettled.get(producer)
        if unsettled is not None:
            unsettled.discard(sent)
            if not unsettled:
                del self._unsettled[producer]
        if exc is not None:
            if lasting_delivery_error(exc) and not isinstance(exc, asyncio.CancelledError):
                self.producer_failed(producer, exc)
            for em, item, _value in sent.chunk:
                em._sender_failed(item, exc)
            return
        base = sent.fut.result().offset
        for i, (em, item, value) in enumerate(sent.chunk):
            try:
                em._sender_acked(item, topic, partition, base + i,
                                 value if em._on_ack is not None else None)
            except Exception:  # an on_ack that raised: the batch's other events are acked
                log.exception("acknowledging event %s of %s failed", item.event_id,
                              em.sandbox)

    def _settle_replaced(self, producer: AIOKafkaProducer) -> None:
        """``producer`` was replaced (and stopped): a batch of it whose future is still pending
        may never resolve (aiokafka appends a batch that waited for its partition's previous
        one even to a closing accumulator); its events are sent again through the
        replacement (a duplicate at worst, which the consumers drop by seq)."""
        for sent in list(self._unsettled.get(producer, ())):
            if not sent.fut.done():
                self._settle(sent, producer, "", -1, _REPLACED)


class _Sent:
    """A submitted batch: its events and delivery future, settled once."""

    __slots__ = ("chunk", "fut", "settled")

    def __init__(self, chunk: list[tuple[SandboxEmitter, _Item, bytes]],
                 fut: asyncio.Future[Any]) -> None:
        self.chunk = chunk
        self.fut = fut
        self.settled = False


_REPLACED = RuntimeError("the shared producer was replaced before this batch was acknowledged")


class _Lane:
    """The events handed to one (topic, partition), in the order rounds queued them, and the
    one task sending them (None, or done, while idle). Handed to a lane is handed to the
    producer: like a record in aiokafka's accumulator, it is sent even if its emitter pauses
    or closes meanwhile (at worst a duplicate of what the emitter's successor re-sends, which
    the consumers drop by seq)."""

    __slots__ = ("entries", "task")

    def __init__(self) -> None:
        self.entries: list[tuple[SandboxEmitter, _Item]] = []
        self.task: asyncio.Task[None] | None = None


def _refused(entries: list[tuple[SandboxEmitter, _Item]], error: str) -> None:
    """The producer would not take these: back to their emitters, retried after a backoff."""
    by_emitter: dict[SandboxEmitter, list[_Item]] = {}
    for em, item in entries:
        item.in_flight = False
        by_emitter.setdefault(em, []).append(item)
    for em, items in by_emitter.items():
        em._sender_retry(items, error)


@functools.lru_cache(maxsize=65536)
def partition_of(key: bytes, count: int) -> int:
    """The partition of ``key`` among ``count``: murmur2, as aiokafka's and Kafka's default
    partitioners pick it, so every producer of a sandbox's key writes to one partition."""
    return (murmur2(key) & 0x7FFFFFFF) % count


_by_loop: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, SharedSender] = (
    weakref.WeakKeyDictionary())


def shared_sender() -> SharedSender:
    """The running event loop's :class:`SharedSender` (created on first use)."""
    loop = asyncio.get_running_loop()
    s = _by_loop.get(loop)
    if s is None:
        s = _by_loop[loop] = SharedSender()
    return s
