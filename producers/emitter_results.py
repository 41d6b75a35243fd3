"""What a :class:`~trajbus.producers.emitter.SandboxEmitter` reports to its caller besides
seqs and event ids: the errors it raises and the records it hands back (acks, drain reports)."""

from __future__ import annotations

from dataclasses import dataclass


class QueueFullError(RuntimeError):
    """The emitter's bounded queue stayed full for ``queue_full_timeout_s``: the event was NOT
    accepted (no seq consumed). The caller decides: retry, slow down, or fail the step."""


class EmitterClosedError(RuntimeError):
    """The emitter was closed."""


class EpisodeStateError(RuntimeError):
    """An event for an episode that is not open, or a start of an episode that exists."""


STATE_DIR_LOCK_WAIT_S = 2.0
"""How long opening a state directory waits for its lock before :class:`StateDirLockedError`.
A child process forked by this one holds a copy of every descriptor, the lock's among them,
until it execs (or exits): an emitter closed and re-opened on its directory in that moment (a
migration while the process spawns a child) finds the lock held for a moment, not for good."""


class StateDirLockedError(RuntimeError):
    """Another live emitter holds this state directory (for :data:`STATE_DIR_LOCK_WAIT_S`)."""


@dataclass(frozen=True, slots=True)
class AckInfo:
    """One event the broker acknowledged (passed to ``on_ack``)."""

    kind: str
    episode: str | None
    seq: int
    event_id: str
    topic: str
    partition: int
    offset: int
    value: bytes
    resent: bool  # recovered from the journal after a restart


@dataclass(frozen=True, slots=True)
class UnflushedEvent:
    kind: str
    episode: str | None
    seq: int
    event_id: str
    topic: str


@dataclass
class DrainReport:
    """What :meth:`SandboxEmitter.drain` achieved. ``unflushed`` lists exactly the events not
    acknowledged when drain returned (they stay journaled and are re-sent by the next emitter
    on this state directory)."""

    complete: bool
    flushed: int
    unflushed: list[UnflushedEvent]
    final_seqs: dict[str, int]
    drained_event_id: str | None
    drained_acked: bool
    elapsed_s: float
    error: str | None = None

    @property
    def unflushed_count(self) -> int:
        return len(self.unflushed)
