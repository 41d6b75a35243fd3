"""The interface between the shared sender and the emitters it sends for.

:class:`~trajbus.producers.sender.SharedSender` sends the events of every
:class:`~trajbus.producers.emitter.SandboxEmitter` on one event loop. It reaches an emitter
only through :class:`SenderMember`, which the emitter implements; an event waiting to be sent
is a :class:`QueuedEvent`. Everything here runs on the event loop's thread.

One round, from the sender's side (see :mod:`trajbus.producers.sender`):

1. :meth:`~SenderMember.sender_take` a batch (in seq order) from each emitter that is ready;
   :meth:`~SenderMember.sender_wants_round` says whether more is left for the next round;
2. :meth:`~SenderMember.sender_sync_fd` gives the journal fd to make durable before sending;
   the outcome is reported with :meth:`~SenderMember.sender_sync_failed` (that emitter stops
   sending), :meth:`~SenderMember.sender_retry` or :meth:`~SenderMember.sender_unsynced`;
3. each event's bytes (:meth:`~SenderMember.sender_value`) go to the emitter's producer
   (:attr:`~SenderMember.sender_producer`) with its :attr:`~SenderMember.sender_key`; events
   not sent go back (:meth:`~SenderMember.sender_put_back`, or
   :meth:`~SenderMember.sender_retry` after a refused send); a batch handed over whole is
   :meth:`~SenderMember.sender_sent_ok`;
4. each record's delivery ends in :meth:`~SenderMember.sender_acked` or
   :meth:`~SenderMember.sender_failed` (sent again next round).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from pathlib import Path

    from aiokafka import AIOKafkaProducer

    from trajbus.bus.settings import Settings

    from .sender import SharedSender


SANDBOX_STREAM = ""
"""The stream key of the sandbox-level events (episode None)."""


@dataclass(eq=False, slots=True)
class QueuedEvent:
    """One journaled event waiting to be sent (or in flight)."""

    rid: int  # record id in the journal: the send order
    seg: int  # journal segment, offset and length of its record
    offset: int
    length: int
    topic: str
    kind: str
    stream: str  # the episode, or SANDBOX_STREAM
    seq: int
    event_id: str
    value: bytes | None  # None = spilled: read back from the journal to send
    resent: bool = False
    in_flight: bool = False


class SenderMember(Protocol):
    """What the shared sender needs from an emitter; the only way it reaches one."""

    settings: Settings
    """The emitter's settings (the sender reads ``producer`` and ``kafka``)."""
    last_error: str | None
    """The emitter's last error, for the sender's own error messages."""
    sender_producer: AIOKafkaProducer | None
    """The producer its events go through (the process's shared one); the sender moves it to
    the replacement of a producer found broken."""

    @property
    def sender_key(self) -> bytes:
        """The record key of every event of the emitter."""
        ...

    @property
    def sender_keeps_values(self) -> bool:
        """Whether :meth:`sender_acked` needs the bytes that were sent."""
        ...

    @property
    def sender_journal_dir(self) -> Path | None:
        """The emitter's journal directory (None without a journal), named in warnings."""
        ...

    @property
    def sender_joined(self) -> SharedSender | None:
        """The sender the emitter has joined (None once it has left)."""
        ...

    def sender_wants_round(self) -> bool:
        """Active with events pending (a backlog, or a backoff that ended)."""
        ...

    def sender_active(self) -> bool:
        """Sending (not paused, failed or closed)."""
        ...

    def sender_take(self, limit: int, now: float) -> list[QueuedEvent]:
        """Up to ``limit`` pending events in seq order; none while not active or backing off.
        With nothing pending this is the emitter's turn to journal its collected acks."""
        ...

    def sender_sync_fd(self) -> int | None:
        """A duplicate of the journal's fd to sync before this round's events are sent (the
        caller closes it), or None when no sync is needed."""
        ...

    def sender_unsynced(self) -> None:
        """The sync round did not happen: sync again before the next send."""
        ...

    def sender_sync_failed(self, items: list[QueuedEvent], exc: OSError) -> None:
        """The journal's sync failed: the emitter sends nothing more (its events stay
        journaled)."""
        ...

    def sender_value(self, item: QueuedEvent) -> bytes | None:
        """The bytes to send (read back from the journal when spilled); None when they cannot
        be read (``last_error`` says why)."""
        ...

    def sender_put_back(self, items: list[QueuedEvent]) -> None:
        """Taken events that were not sent (paused or closed meanwhile)."""
        ...

    def sender_retry(self, items: list[QueuedEvent], error: str,
                     delay: float | None = None) -> None:
        """These events were refused: back to the queue, retried after ``delay`` (None: the
        emitter's own backoff)."""
        ...

    def sender_sent_ok(self) -> None:
        """A whole batch was handed to the producer."""
        ...

    def sender_stop(self, error: str) -> None:
        """Send nothing more (a bug or a vanished journal); the events stay journaled."""
        ...

    def sender_failed(self, item: QueuedEvent, exc: BaseException) -> None:
        """The record carrying ``item`` was not delivered: send it again."""
        ...

    def sender_acked(self, item: QueuedEvent, topic: str, partition: int, offset: int,
                     value: bytes | None) -> None:
        """The broker acknowledged ``item`` at ``topic``/``partition``/``offset``."""
        ...
