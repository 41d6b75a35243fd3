"""The emitter's side of the shared sender: :class:`SenderSide` implements
:class:`~trajbus.producers.sending.SenderMember` for
:class:`~trajbus.producers.emitter.SandboxEmitter` (its pending queue, backoff, send state
and acknowledgements, as the loop's :class:`~trajbus.producers.sender.SharedSender` drives
them). Nothing else calls these methods."""

from __future__ import annotations

import asyncio
import heapq
import random
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from aiokafka import AIOKafkaProducer

from trajbus.bus.settings import Settings
from trajbus.producers.journal import Journal
from trajbus.producers.sender import BACKOFF_MAX_S, BACKOFF_MIN_S, SharedSender

from .emitter_results import AckInfo
from .sending import SANDBOX_STREAM, QueuedEvent


class SenderSide:
    """The sender-facing part of an emitter; see the module docstring."""

    # the emitter's state this part reads and writes (set up by SandboxEmitter.__init__)
    settings: Settings
    last_error: str | None
    durability: Literal["fsync", "os"]
    queue_max: int
    acked_count: int
    _key: bytes
    _on_ack: Callable[[AckInfo], None] | None
    _shuffle: tuple[int, random.Random] | None
    _drained_roll_bytes: int
    _pending: list[tuple[int, QueuedEvent]]
    _unacked: dict[int, QueuedEvent]
    _seg_unacked: dict[int, int]
    _mem_items: int
    _acked_rids: list[int]
    _journal: Journal | None
    _shared: SharedSender | None
    _send_state: str
    _backoff: float
    _retry_at: float
    _space: asyncio.Event | None
    _idle: asyncio.Event | None
    _ack_waiters: dict[int, asyncio.Future[None]]
    _producer: AIOKafkaProducer | None
    _closed_flag: bool

    if TYPE_CHECKING:  # the journal's (JournalKeeping)
        def _flush_acks(self) -> None: ...

        def _gc_segments(self) -> None: ...

    @property
    def sender_producer(self) -> AIOKafkaProducer | None:
        """The producer this emitter's events go through (:class:`SenderMember`)."""
        return self._producer

    @sender_producer.setter
    def sender_producer(self, producer: AIOKafkaProducer | None) -> None:
        self._producer = producer

    @property
    def sender_key(self) -> bytes:
        """The record key of every event (the sandbox id)."""
        return self._key

    @property
    def sender_keeps_values(self) -> bool:
        """Whether acks carry the bytes sent (an ``on_ack`` callback wants them)."""
        return self._on_ack is not None

    @property
    def sender_journal_dir(self) -> Path | None:
        """The journal's directory (None without a journal)."""
        return None if self._journal is None else self._journal.dir

    @property
    def sender_joined(self) -> SharedSender | None:
        """The shared sender this emitter has joined (None once it has left)."""
        return self._shared

    def sender_wants_round(self) -> bool:
        """Active with events pending (a backlog, or a backoff that ended)."""
        return self._send_state == "active" and bool(self._pending)

    def sender_active(self) -> bool:
        return self._send_state == "active"

    def sender_take(self, limit: int, now: float) -> list[QueuedEvent]:
        """Up to ``limit`` pending events in record-id (seq) order for this round; none while
        not active or backing off. With nothing pending this is an ack turn: the collected
        acks are journaled (and a drained segment rolled) now."""
        if self._send_state != "active" or self._retry_at > now:
            return []  # backing off after a failed send: retry_later wakes it
        pending = self._pending
        if not pending:
            self._flush_acks()
            return []
        batch = [heapq.heappop(pending)[1] for _ in range(min(limit, len(pending)))]
        if self._shuffle is not None:  # tests: out-of-order sends within a window
            window, rng = self._shuffle
            for i in range(0, len(batch), window):
                part = batch[i:i + window]
                rng.shuffle(part)
                batch[i:i + window] = part
        return batch

    def sender_sync_fd(self) -> int | None:
        """A duplicate of the journal's fd to fdatasync before this round's events are sent
        (None: no sync needed -- ``durability="os"``, or nothing written since the last)."""
        if self.durability != "fsync" or self._journal is None:
            return None
        return self._journal.sync_fd()

    def sender_unsynced(self) -> None:
        """The sync round did not happen: sync again before the next send."""
        if self._journal is not None:
            self._journal.mark_dirty()

    def sender_sync_failed(self, items: list[QueuedEvent], exc: OSError) -> None:
        """After a failed fdatasync the kernel may have dropped the journal's dirty pages: a
        later sync that succeeds proves nothing about them. So this emitter sends nothing more
        (its events stay journaled; a restarted emitter re-sends what the disk holds)."""
        self._requeue(items)
        self._send_state = "failed"
        self.last_error = f"journal sync failed, sending stopped: {exc}"

    def sender_value(self, item: QueuedEvent) -> bytes | None:
        """The bytes to send: in memory, or read back from the journal (spilled)."""
        if item.value is not None:
            return item.value
        assert self._journal is not None
        try:
            return self._journal.read(item.seg, item.offset, item.length)
        except OSError as exc:  # pragma: no cover - journal vanished under us
            self.last_error = f"journal read: {exc}"
            return None

    def sender_put_back(self, items: list[QueuedEvent]) -> None:
        """Taken events that were not sent (paused or closed meanwhile)."""
        if self._send_state != "closed":
            self._requeue(items)

    def sender_retry(self, items: list[QueuedEvent], error: str,
                      delay: float | None = None) -> None:
        """The producer refused these events: back to the queue, retried after a backoff."""
        self.last_error = error
        self._requeue(items)
        if delay is None:
            self._backoff = delay = min(self._backoff * 2, BACKOFF_MAX_S)
        self._retry_at = asyncio.get_running_loop().time() + delay
        if self._shared is not None:
            self._shared.retry_later(self, delay)

    def sender_sent_ok(self) -> None:
        self._backoff = BACKOFF_MIN_S / 2

    def sender_stop(self, error: str) -> None:
        """A bug or a vanished journal: send nothing more (the events stay journaled)."""
        self._send_state = "failed"
        self.last_error = error

    def _requeue(self, items: list[QueuedEvent]) -> None:
        """Events taken for a send that did not happen go back to the pending queue."""
        for it in items:
            heapq.heappush(self._pending, (it.rid, it))

    def sender_failed(self, item: QueuedEvent, exc: BaseException) -> None:
        """The batch carrying ``item`` was not delivered: send it again (next round)."""
        item.in_flight = False
        if self._closed_flag:
            return
        self.last_error = f"send failed: {type(exc).__name__}: {exc}"
        heapq.heappush(self._pending, (item.rid, item))
        if self._shared is not None:
            self._shared.notify(self)

    def sender_acked(self, item: QueuedEvent, topic: str, partition: int, offset: int,
                      value: bytes | None) -> None:
        """The broker acknowledged ``item`` at ``topic``/``partition``/``offset``."""
        item.in_flight = False
        if self._closed_flag:
            return
        if self._unacked.pop(item.rid, None) is None:
            return
        self._acked_rids.append(item.rid)
        self.acked_count += 1
        left = self._seg_unacked.get(item.seg, 1) - 1
        self._seg_unacked[item.seg] = left
        if item.value is not None:
            self._mem_items -= 1
            item.value = None
            if self._mem_items < self.queue_max and self._space is not None:
                self._space.set()
        if not self._unacked and self._idle is not None:
            self._idle.set()
            journal = self._journal
            if (self._shared is not None and journal is not None
                    and journal.worth_rolling_drained(self._drained_roll_bytes)):
                self._shared.notify(self)  # roll the drained segment now, not at the next event
        if self._ack_waiters:
            waiter = self._ack_waiters.pop(item.rid, None)
            if waiter is not None and not waiter.done():
                waiter.set_result(None)
        if self._on_ack is not None:
            episode = None if item.stream == SANDBOX_STREAM else item.stream
            self._on_ack(AckInfo(item.kind, episode, item.seq, item.event_id, topic,
                                 partition, offset, value or b"", item.resent))
        if left <= 0 and self._journal is not None and item.seg != self._journal.active:
            self._gc_segments()
