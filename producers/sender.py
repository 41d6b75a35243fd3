"""The shared sender: one send task per event loop for every :class:`SandboxEmitter` on it.

A node runs hundreds to thousands of sandboxes, each with its own emitter, most emitting about
one event a second. Sending alone, each emitter's own task woke, synced its journal, sent one
record and journaled one ack per event: the per-event overhead of a task was paid 1,000 times
a second (issue 18, item 4). Here the emitters of one loop hand their ready queues to one
:class:`SharedSender` task that runs *rounds*:

0. while more than one emitter is open, start at most one round per
   ``settings.producer.send_round_ms`` (10 ms): at 1 event/s per emitter a round then serves
   ~10 emitters per 1,000 instead of one or two, for at most that much more send latency;
1. take every emitter that became ready since the last round, pop each one's pending events
   (in record-id, i.e. seq, order; at most ``SEND_BATCH`` each);
2. one ``fdatasync`` round, in one thread hand-off, over the journals of those emitters with
   ``durability="fsync"`` that were written since their last sync: the fd duplicated *after*
   the events were appended, so every one of them is on disk before it is sent ("durable
   before sent", as before);
3. send them through the process's shared producer, emitter by emitter, each emitter's events
   in order; acks come back through each emitter's ``_on_sent`` callback, as before.

Ack records are not written by the sender: an emitter journals the acks it collected in the
same ``write(2)`` as its next event (or at ``flush``/``drain``/``close``, or when a drained
segment is due to roll: the emitter asks the sender for that turn).

Failures stay per emitter: a failed journal sync stops sending *that* emitter's events (its
journal may have lost pages; they stay journaled and are re-sent by the next emitter on the
directory) and is reported in its ``last_error``; a send that raises re-queues the rest of
that emitter's batch and retries it after a backoff, without holding up the others.
"""

from __future__ import annotations

import asyncio
import functools
import heapq
import logging
import os
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from trajbus.producers.emitter import SandboxEmitter

log = logging.getLogger(__name__)

SEND_BATCH = 2000  # events of one emitter per round
BACKOFF_MIN_S = 0.05
BACKOFF_MAX_S = 2.0

SyncFn = Callable[[int], None]


def _sync_all(sync_fn: SyncFn, fds: list[int]) -> list[OSError | None]:
    out: list[OSError | None] = []
    for fd in fds:
        try:
            sync_fn(fd)
            out.append(None)
        except OSError as exc:
            out.append(exc)
    return out


class SharedSender:
    """Sends for every emitter of one event loop; see the module docstring."""

    def __init__(self, sync_fn: SyncFn = os.fdatasync) -> None:
        self._sync_fn = sync_fn
        self._ready: dict[SandboxEmitter, None] = {}  # insertion-ordered set
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._members = 0
        self._last_round = 0.0
        self.round_s: float | None = None  # the smallest send_round_ms of the members, in s
        self.rounds = 0  # for tests and metrics
        self.sync_rounds = 0
        self.syncs = 0

    # -- membership ---------------------------------------------------------------------------
    def join(self, em: SandboxEmitter) -> None:
        self._members += 1
        r = max(0.0, em.settings.producer.send_round_ms / 1000)
        if self._task is None or self._task.done():
            self.round_s = r
            self._task = asyncio.get_running_loop().create_task(
                self._run(), name="trajbus-emitter-sender")
        else:
            self.round_s = r if self.round_s is None else min(self.round_s, r)

    def leave(self, em: SandboxEmitter) -> None:
        self._members -= 1
        self._ready.pop(em, None)
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
        if em._send_state == "active" and em._pending:
            self.notify(em)

    # -- the rounds ---------------------------------------------------------------------------
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
            if self._members > 1 and self.round_s:  # one emitter alone never waits
                wait = self._last_round + self.round_s - loop.time()
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

    async def _round(self, ready: dict[SandboxEmitter, None]) -> None:
        batches: list[tuple[SandboxEmitter, list[Any]]] = []
        syncing: list[tuple[SandboxEmitter, int]] = []
        # -- no await: a batch is taken and its journal's fd duplicated in one step -----------
        now = asyncio.get_running_loop().time()
        for em in ready:
            if em._send_state != "active":
                continue
            if em._retry_at > now:  # backing off after a failed send: retry_later wakes it
                continue
            if not em._pending:
                em._flush_acks()  # an ack turn: journal the acks, roll a drained segment
                continue
            pending = em._pending
            batch = [heapq.heappop(pending)[1]
                     for _ in range(min(SEND_BATCH, len(pending)))]
            if pending:  # a backlog: the rest goes in the next round
                self._ready[em] = None
            journal = em._journal
            if em.durability == "fsync" and journal is not None:
                try:
                    fd = journal.sync_fd()
                except OSError as exc:
                    self._sync_failed(em, batch, exc)
                    continue
                if fd is not None:
                    syncing.append((em, fd))
            batches.append((em, batch))
        if syncing:
            fds = [fd for _, fd in syncing]
            try:
                errors = await asyncio.to_thread(_sync_all, self._sync_fn, fds)
            except Exception as exc:  # no sync happened (e.g. the executor is shut down)
                for em, batch in batches:
                    em._requeue(batch)
                    em.last_error = f"journal sync round: {type(exc).__name__}: {exc}"
                    em._retry_at = asyncio.get_running_loop().time() + BACKOFF_MAX_S
                    self.retry_later(em, BACKOFF_MAX_S)
                for em, _ in syncing:
                    if em._journal is not None:
                        em._journal._dirty = True  # sync again before sending
                return
            finally:
                for fd in fds:
                    os.close(fd)
            self.sync_rounds += 1
            self.syncs += len(fds)
            failed = {em: exc for (em, _), exc in zip(syncing, errors, strict=True)
                      if exc is not None}
            if failed:
                kept = []
                for em, batch in batches:
                    err = failed.get(em)
                    if err is None:
                        kept.append((em, batch))
                    else:
                        self._sync_failed(em, batch, err)
                batches = kept
        for em, batch in batches:
            if em._send_state != "active":
                if em._send_state == "paused":
                    em._requeue(batch)
                continue
            try:
                await self._send(em, batch)
            except Exception as exc:  # a broken emitter must not stop the others
                em._send_state = "failed"
                em.last_error = f"sender: {type(exc).__name__}: {exc}"

    @staticmethod
    def _sync_failed(em: SandboxEmitter, batch: list[Any], exc: OSError) -> None:
        """After a failed fdatasync the kernel may have dropped the journal's dirty pages: a
        later sync that succeeds proves nothing about them. So this emitter sends nothing more
        (its events stay journaled; a restarted emitter re-sends what the disk holds)."""
        em._requeue(batch)
        em._send_state = "failed"
        em.last_error = f"journal sync failed, sending stopped: {exc}"

    async def _send(self, em: SandboxEmitter, batch: list[Any]) -> None:
        producer = em._producer
        journal = em._journal
        assert producer is not None and journal is not None
        if em._shuffle is not None:
            window, rng = em._shuffle
            for i in range(0, len(batch), window):
                part = batch[i:i + window]
                rng.shuffle(part)
                batch[i:i + window] = part
        key = em._key
        on_sent = em._on_sent
        keep_value = em._on_ack is not None
        for i, item in enumerate(batch):
            if em._send_state != "active":  # closed or paused while this round awaited
                if em._send_state == "paused":
                    em._requeue(batch[i:])
                return
            value = item.value
            if value is None:
                try:
                    value = journal.read(item.seg, item.offset, item.length)
                except OSError as exc:  # pragma: no cover - journal vanished under us
                    em._requeue(batch[i:])
                    raise RuntimeError(f"journal read: {exc}") from exc
            try:
                fut = await producer.send(item.topic, value, key=key)
            except Exception as exc:  # KafkaTimeoutError, connection errors...
                em.last_error = f"{type(exc).__name__}: {exc}"
                em._requeue(batch[i:])
                em._backoff = min(em._backoff * 2, BACKOFF_MAX_S)
                em._retry_at = asyncio.get_running_loop().time() + em._backoff
                self.retry_later(em, em._backoff)
                return
            item.in_flight = True
            fut.add_done_callback(functools.partial(on_sent, item,
                                                    value if keep_value else None))
        em._backoff = BACKOFF_MIN_S / 2


_by_loop: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, SharedSender] = (
    weakref.WeakKeyDictionary())


def shared_sender() -> SharedSender:
    """The running event loop's :class:`SharedSender` (created on first use)."""
    loop = asyncio.get_running_loop()
    s = _by_loop.get(loop)
    if s is None:
        s = _by_loop[loop] = SharedSender()
    return s
