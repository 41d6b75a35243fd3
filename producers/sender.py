"""The shared sender: one send task per event loop for every :class:`SandboxEmitter` on it.

A node runs hundreds to thousands of sandboxes, each with its own emitter, most emitting about
one event a second. Were each emitter to send alone, its own task would wake, sync its
journal, send one record and journal one ack per event: the per-event overhead of a task, paid
1,000 times a second (docs/decisions/0005-shared-sender-rounds.md). Instead the emitters of one
loop hand their ready queues to one :class:`SharedSender` task that runs *rounds*:

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
   filesystem; on ext4 it stays the faster of the two even beside a heavy writer, so there is
   no automatic switch between them (docs/decisions/0007-journal-group-commit.md). A round
   whose sync took over ``SLOW_SYNC_WARN_S`` holds up every emitter's sends (not its emits)
   and is logged, at most every ``SLOW_SYNC_WARN_EVERY_S``;
3. send them through the process's shared producer, emitter by emitter, each emitter's events
   in seq order (one ``send()`` each: the producer batches them per partition, over rounds,
   for ``linger_ms``); acks come back through each record's future.

Not done: one ``send_batch`` per partition per round. At 1,000 emitters x 1 event/s a round
holds ~2 events per partition, fewer than the producer's own batches gather over
``linger_ms``, so it saves no CPU; and ``send_batch`` waits until the partition's previous
batch is drained, so one slow partition would hold up every other partition's sends in that
round (docs/decisions/0005-shared-sender-rounds.md).

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
were lost, so it counts as failed for every journal it covered); an event the producer
refuses goes back to its emitter's queue with the rest of that emitter's batch and is retried
after a backoff without holding up the others; a failed delivery is re-queued at once. A
delivery that failed for good (an idempotent producer that lost a sequence after a long broker
outage has every later batch of that partition refused:
docs/decisions/0019-replace-a-failed-producer.md) makes the next round replace the process's
shared producer first; the events it failed are sent again through the new one.

The sender reaches its emitters only through :class:`~trajbus.producers.sending.SenderMember`
(which :class:`~trajbus.producers.emitter.SandboxEmitter` implements): take a batch, the
journal fd to sync, put events back, retry later, acknowledged, failed.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from aiokafka import AIOKafkaProducer

from trajbus.bus.kafka import lasting_delivery_error
from trajbus.bus.producer import replace_producer
from trajbus.bus.settings import KafkaSettings
from trajbus.producers.journal import syncfs
from trajbus.producers.timerslack import get_timer_slack_ns, set_timer_slack_ns

if TYPE_CHECKING:
    from .sending import QueuedEvent, SenderMember

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
        self._ready: dict[SenderMember, None] = {}  # insertion-ordered set
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
        self.replacements = 0

    # -- membership ---------------------------------------------------------------------------
    def join(self, em: SenderMember) -> None:
        self._members += 1
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

    def leave(self, em: SenderMember) -> None:
        self._members -= 1
        self._ready.pop(em, None)
        self._adjust_timer_slack()
        if self._members <= 0:
            self._wake.set()  # let the task see it has nothing left to do and end

    def notify(self, em: SenderMember) -> None:
        """``em`` has pending events (or acks to journal): include it in the next round."""
        if em not in self._ready:
            self._ready[em] = None
            if not self._wake.is_set():
                self._wake.set()

    def retry_later(self, em: SenderMember, delay: float) -> None:
        asyncio.get_running_loop().call_later(delay, self._retry, em)

    def _retry(self, em: SenderMember) -> None:
        if em.sender_wants_round():
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
        if producer is not self._broken:  # not a late failure of the one being replaced
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
        return True

    def _producer_of(self, em: SenderMember) -> AIOKafkaProducer | None:
        # the emitters of a process share one producer: any other they hold was replaced
        if self._replacement is not None and em.sender_producer is not self._replacement:
            em.sender_producer = self._replacement
        return em.sender_producer

    async def _round(self, ready: dict[SenderMember, None]) -> None:
        if self._broken is not None and self._replacement is None and ready:
            if not await self._replace_broken(next(iter(ready)).settings.kafka):
                for em in ready:  # nothing is taken: they wait for the next round
                    self.retry_later(em, BACKOFF_MAX_S)
                return
        batches: list[tuple[SenderMember, list[QueuedEvent]]] = []
        syncing: list[tuple[SenderMember, int]] = []
        whole_fs: list[bool] = []  # per syncing journal: may a syncfs cover it
        # -- no await: a batch is taken and its journal's fd duplicated in one step -----------
        now = asyncio.get_running_loop().time()
        for em in ready:
            batch = em.sender_take(SEND_BATCH, now)
            if not batch:
                continue
            if em.sender_wants_round():  # a backlog: the rest goes in the next round
                self._ready[em] = None
            try:
                fd = em.sender_sync_fd()
            except OSError as exc:
                em.sender_sync_failed(batch, exc)
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
                    em.sender_retry(batch, f"journal sync round: {type(exc).__name__}: {exc}",
                                     BACKOFF_MAX_S)
                for em, _ in syncing:
                    em.sender_unsynced()  # sync again before sending
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
                        em.sender_sync_failed(batch, err)
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

    def _slow_sync(self, took: float, syncing: list[tuple[SenderMember, int]],
                   whole_fs: list[bool], now: float) -> None:
        self.slow_sync_rounds += 1
        self._slow_unreported += 1
        self._slow_longest = max(self._slow_longest, took)
        if (self._slow_warned_at is not None
                and now - self._slow_warned_at < SLOW_SYNC_WARN_EVERY_S):
            return
        journal_dir = syncing[0][0].sender_journal_dir
        where = journal_dir.parent if journal_dir is not None else "?"
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

    async def _send(self, batches: list[tuple[SenderMember, list[QueuedEvent]]]) -> None:
        for em, batch in batches:
            try:
                await self._send_one(em, batch)
            except Exception as exc:  # a broken emitter must not stop the others
                em.sender_stop(f"sender: {type(exc).__name__}: {exc}")

    async def _send_one(self, em: SenderMember, batch: list[QueuedEvent]) -> None:
        """``em``'s events in seq order, one ``send()`` each: the producer appends them to its
        batch of their partition (which it sends after ``linger_ms``, so a batch gathers the
        events of several rounds); each record's future acknowledges its event."""
        producer = self._producer_of(em)
        assert producer is not None
        key = em.sender_key
        keep_value = em.sender_keeps_values
        for i, item in enumerate(batch):
            if not em.sender_active():  # paused or closed while this round awaited
                em.sender_put_back(batch[i:])
                return
            value = em.sender_value(item)
            if value is None:  # pragma: no cover - journal vanished under us
                em.sender_put_back(batch[i:])
                raise RuntimeError(f"journal read: {em.last_error}")
            try:
                fut = await producer.send(item.topic, value, key=key)
            except Exception as exc:  # KafkaTimeoutError, connection errors...
                em.sender_retry(batch[i:], f"{type(exc).__name__}: {exc}")
                return
            item.in_flight = True
            fut.add_done_callback(functools.partial(_delivered, em, item,
                                                    value if keep_value else None, producer))
        em.sender_sent_ok()


def _delivered(em: SenderMember, item: QueuedEvent, value: bytes | None,
               producer: AIOKafkaProducer, fut: asyncio.Future[Any]) -> None:
    """A record's delivery future resolved: acknowledge (or fail) its event."""
    if fut.cancelled():
        em.sender_failed(item, asyncio.CancelledError())
        return
    exc = fut.exception()
    if exc is not None:
        sender = em.sender_joined
        if lasting_delivery_error(exc) and sender is not None:
            sender.producer_failed(producer, exc)
        em.sender_failed(item, exc)
        return
    md = fut.result()
    em.sender_acked(item, md.topic, md.partition, md.offset, value)


_by_loop: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, SharedSender] = (
    weakref.WeakKeyDictionary())


def shared_sender() -> SharedSender:
    """The running event loop's :class:`SharedSender` (created on first use)."""
    loop = asyncio.get_running_loop()
    s = _by_loop.get(loop)
    if s is None:
        s = _by_loop[loop] = SharedSender()
    return s
