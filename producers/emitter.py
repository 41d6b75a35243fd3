"""SandboxEmitter: the one object a sandbox runtime (or its sidecar) publishes through.

Every lifecycle change, heartbeat, liveness result, tool call and result, trace chunk, episode
start and end becomes an Avro event keyed by sandbox id, on ``Topics.sandbox_events`` (trace
chunks on ``Topics.trace_chunks``), sent through the process's one shared idempotent producer
(:func:`trajbus.bus.producer.get_producer`).

Guarantees:

- **Gapless, monotonic sequences, never reused.** Each episode is a stream (EpisodeStart is seq
  0, EpisodeEnd the last); the sandbox has one more stream (``episode`` None) for lifecycle,
  heartbeats, liveness and Drained. A seq is assigned and the encoded event appended to the
  write-ahead journal in the state directory (:mod:`trajbus.producers.journal`) in one step,
  before the event is handed to Kafka; if the append fails the seq is not consumed. Every
  journaled event is sent until the broker acknowledges it -- across restarts: a restarted
  emitter (same directory, same or another host) re-sends the journal's unacknowledged events
  with their original event id and seq (downstream dedupes by (sandbox, episode, seq)) and
  continues each stream after its highest journaled seq. So no seq is skipped, none is reused.
- **Durable on return.** When an ``emit`` coroutine returns, the event survives SIGKILL of the
  process; with ``durability="fsync"`` (default) it is fdatasync-ed before it is sent, so
  nothing on Kafka is missing from the journal after a host crash.
- **Bounded memory, no silent drop.** At most ``settings.producer.queue_max_events`` unacked
  events are held in memory. When full, ``queue_policy="block"`` (default) waits up to
  ``queue_full_timeout_s`` and then raises :class:`QueueFullError` (no seq consumed);
  ``"spill"`` keeps the event on disk only (the journal) and sends it from there, raising
  :class:`QueueFullError` only past ``max_journal_bytes``.
- **One writer per directory.** The state directory is flock-ed; a second emitter on it raises
  :class:`StateDirLockedError` after waiting :data:`STATE_DIR_LOCK_WAIT_S` (the lock dies
  with the process, so a SIGKILLed emitter's directory can be taken over at once).
- **Secrets never leave.** Every free-text field of every event -- tool names, args and
  results, trace bytes, lifecycle and episode-end reasons, liveness probe, target and error,
  env snapshot, context keys and values, content types, reset reasons, the drain detail --
  passes through a :class:`~trajbus.producers.redact.Redactor` built from *this sandbox's*
  ``env`` before it is encoded or journaled. The only string fields written as given are the
  identifiers, hashes and references listed in :data:`EXACT_FIELDS`. Trace bytes are not
  scanned for ``image/``, ``video/`` and ``audio/`` content types or with ``redact=False``.

Sending: the emitters of one event loop share one send task
(:class:`~trajbus.producers.sender.SharedSender`): one journal sync round and one pass of sends
for every emitter with pending events, at most every ``settings.producer.send_round_ms`` while
more than one emitter is open (longer with hundreds open, up to ``send_round_max_ms``).
The sender reaches an emitter only through :class:`~trajbus.producers.sending.SenderMember`,
implemented by :class:`~trajbus.producers.emitter_sending.SenderSide`.

Rooms: this module holds :class:`SandboxEmitter` (its state, start and close, sequence
assignment and journal append, flush and drain); :mod:`.emitter_events` its event API and the
redaction of free text (:data:`EXACT_FIELDS`); :mod:`.emitter_sync` :class:`SyncEmitter`;
:mod:`.emitter_results` its errors and reports; :mod:`.eventids` event and producer ids;
:mod:`.emitter_journal` its state directory and journal; :mod:`.emitter_sending` its
sender-facing part. Every name of the event API and the sync façade imports from here too.

Ordering on Kafka follows seq order per sandbox (one partition, one in-flight batch, idempotent
producer), except after a failed send is retried; consumers reorder by seq anyway.
"""

from __future__ import annotations

import asyncio
import contextlib
import heapq
import os
import random
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Literal

from aiokafka import AIOKafkaProducer

from trajbus.bus.producer import get_producer
from trajbus.bus.settings import Settings, get_settings
from trajbus.bus.topics import Topics, validate_name
from trajbus.producers.claimcheck import ClaimCheck
from trajbus.producers.journal import Journal, JournalError
from trajbus.producers.redact import Redactor
from trajbus.producers.sender import (
    BACKOFF_MIN_S,
    SharedSender,
    shared_sender,
)
from trajbus.schemas.codec import Codec, default_codec
from trajbus.schemas.models import now_ms

from .emitter_events import CANONICAL_MAX_BYTES as CANONICAL_MAX_BYTES
from .emitter_events import CLEAN_TEXT_MAX_CHARS as CLEAN_TEXT_MAX_CHARS
from .emitter_events import CLEAN_TEXT_MAX_ENTRIES as CLEAN_TEXT_MAX_ENTRIES
from .emitter_events import EXACT_FIELDS, EventAPI, canonicalizers
from .emitter_events import SUMMARY_CHARS as SUMMARY_CHARS
from .emitter_events import _summary as _summary
from .emitter_journal import JournalKeeping
from .emitter_results import (
    STATE_DIR_LOCK_WAIT_S,
    AckInfo,
    DrainReport,
    EmitterClosedError,
    EpisodeStateError,
    QueueFullError,
    StateDirLockedError,
    UnflushedEvent,
)
from .emitter_sending import SenderSide
from .emitter_sync import SyncEmitter
from .emitter_sync import _LoopThread as _LoopThread
from .eventids import default_producer_id, new_event_id
from .sending import SANDBOX_STREAM, QueuedEvent, SenderMember

_new_event_id = new_event_id  # the deep name tests import

__all__ = [
    "EXACT_FIELDS",
    "STATE_DIR_LOCK_WAIT_S",
    "AckInfo",
    "DrainReport",
    "EmitterClosedError",
    "EpisodeStateError",
    "QueueFullError",
    "SandboxEmitter",
    "StateDirLockedError",
    "SyncEmitter",
    "UnflushedEvent",
]

MESSAGE_OVERHEAD = 16 * 1024  # room for the envelope and Kafka record/batch headers


class SandboxEmitter(EventAPI, SenderSide, JournalKeeping):
    """Publishes one sandbox's events. Use ``async with SandboxEmitter(...) as em:`` or call
    :meth:`start` / :meth:`close`. Not thread-safe: use it from one event loop (or use
    :class:`SyncEmitter`)."""

    def __init__(
        self,
        sandbox: str,
        task: str,
        *,
        env: Mapping[str, str] | None = None,
        state_dir: str | os.PathLike[str] | None = None,
        settings: Settings | None = None,
        producer_id: str | None = None,
        tenant: str | None = None,
        queue_policy: Literal["block", "spill"] = "block",
        durability: Literal["fsync", "os"] = "fsync",
        max_journal_bytes: int = 4 * 1024**3,
        segment_bytes: int = 32 * 1024 * 1024,
        drained_roll_bytes: int = 1024 * 1024,
        claim_check: ClaimCheck | None = None,
        on_ack: Callable[[AckInfo], None] | None = None,
        shuffle: tuple[int, random.Random] | None = None,
        codec: Codec | None = None,
        id_factory: Callable[[], str] | None = None,
    ) -> None:
        self.settings = settings or get_settings()
        self.sandbox = validate_name("sandbox", sandbox)
        self.task = validate_name("task", task)
        self.tenant = tenant
        self.producer_id = producer_id or default_producer_id(sandbox)
        self.topics = Topics(self.settings)
        self.state_dir = Path(state_dir) if state_dir is not None else (
            self.settings.state_dir / sandbox)
        p = self.settings.producer
        self.queue_max = p.queue_max_events
        self.queue_timeout_s = p.queue_full_timeout_s
        self.queue_policy = queue_policy
        self.durability = durability
        self.max_journal_bytes = max_journal_bytes
        self.max_inline = min(self.settings.topics.max_message_bytes,
                              self.settings.kafka.max_request_size) - MESSAGE_OVERHEAD
        self.redactor = Redactor.for_env(env, p.redact_env)
        self._clean_text = self.redactor.clean_texts  # short texts its rules left unchanged
        self._canon, self._canon_full = canonicalizers(self.settings.watchdog.ignore_fields)
        self._claim = claim_check
        self._on_ack = on_ack
        self._shuffle = shuffle
        self._codec = codec or default_codec()
        self._key = sandbox.encode()
        self._new_id = id_factory or new_event_id
        self._segment_bytes = segment_bytes
        self._drained_roll_bytes = drained_roll_bytes

        # state (rebuilt from the journal)
        self._next_rid = 0
        self._next_seq: dict[str, int] = {SANDBOX_STREAM: 0}
        self._open: dict[str, dict[str, Any]] = {}  # episode -> {"pv": policy_version}
        self._closed: dict[str, int] = {}  # episode -> final seq
        self._cursors: dict[str, Any] = {}
        self._lifecycle: str | None = None

        # queue
        self._pending: list[tuple[int, QueuedEvent]] = []
        self._unacked: dict[int, QueuedEvent] = {}
        self._seg_unacked: dict[int, int] = {}
        self._mem_items = 0
        self._acked_rids: list[int] = []
        self.acked_count = 0
        self.resent_count = 0
        self.last_error: str | None = None

        self._lock_fd = -1
        self._journal: Journal | None = None
        self._sender: _SendHandle | None = None
        self._shared: SharedSender | None = None
        # "idle" (not started), "active", "paused" (tests), "failed" (journal sync), "closed"
        self._send_state = "idle"
        self._backoff = BACKOFF_MIN_S / 2
        self._retry_at = 0.0
        self._space: asyncio.Event | None = None
        self._idle: asyncio.Event | None = None
        self._ack_waiters: dict[int, asyncio.Future[None]] = {}
        self._producer: AIOKafkaProducer | None = None
        self._closed_flag = False
        self._stopping = False
        self._open_journal()

    # -- lifecycle of the emitter -------------------------------------------------------------
    async def start(self) -> SandboxEmitter:
        """Connect (fail fast) and start sending, beginning with any journaled backlog."""
        if self._sender is not None:
            return self
        if self._closed_flag:
            raise EmitterClosedError("emitter is closed")
        self._space = asyncio.Event()
        self._idle = asyncio.Event()
        self._space.set()
        if not self._unacked:
            self._idle.set()
        self._producer = await get_producer(self.settings.kafka)
        if self._closed_flag:  # closed while the producer started
            raise EmitterClosedError("emitter is closed")
        # one send task per event loop for all emitters on it (trajbus.producers.sender)
        self._shared = shared_sender()
        self._shared.join(self)
        self._send_state = "active"
        self._sender = _SendHandle(self)
        if self._pending:
            self._shared.notify(self)
        return self

    async def __aenter__(self) -> SandboxEmitter:
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self, timeout: float = 10.0) -> bool:
        """Stop accepting events, wait up to ``timeout`` for acks, release the directory.
        Returns True if everything was acknowledged; unacked events stay journaled."""
        if self._closed_flag:
            return not self._unacked
        ok = await self.flush(timeout) if self._sender is not None else not self._unacked
        await self._shutdown()
        return ok

    async def abort(self) -> None:
        """Close at once without waiting (what a crash leaves behind; for tests/simulators)."""
        await self._shutdown()

    async def _shutdown(self) -> None:
        if self._closed_flag:
            return
        self._closed_flag = True
        self._stopping = True
        self._send_state = "closed"
        if self._shared is not None:
            self._shared.leave(self)
            self._shared = None
        for fut in self._ack_waiters.values():
            if not fut.done():
                fut.set_exception(EmitterClosedError("emitter closed"))
        if self._journal is not None:
            with contextlib.suppress(Exception):
                self._journal.append_acks(self._acked_rids)
            self._acked_rids = []
            self._journal.close()
        if self._lock_fd >= 0:
            os.close(self._lock_fd)
            self._lock_fd = -1

    # -- introspection ------------------------------------------------------------------------
    @property
    def open_episodes(self) -> list[str]:
        return list(self._open)

    def is_open(self, episode: str) -> bool:
        return episode in self._open

    def is_closed(self, episode: str) -> bool:
        return episode in self._closed

    def next_seq(self, episode: str | None = None) -> int:
        return self._next_seq.get(episode or SANDBOX_STREAM, 0)

    def cursor(self, name: str) -> Any:
        """The last cursor journaled under ``name`` (see ``trace_chunk(cursor=...)``)."""
        return self._cursors.get(name)

    @property
    def cursors(self) -> dict[str, Any]:
        return dict(self._cursors)

    @property
    def pending_count(self) -> int:
        """Events journaled but not yet acknowledged."""
        return len(self._unacked)

    @property
    def lifecycle_state(self) -> str | None:
        return self._lifecycle

    # -- the core -----------------------------------------------------------------------------
    async def _reserve(self, force: bool) -> bool:
        """Wait for room; returns whether the value may be held in memory."""
        if self._closed_flag or self._stopping:
            raise EmitterClosedError("emitter is closed")
        if self._sender is None:
            raise EmitterClosedError("emitter not started: await start() first")
        if force or self._mem_items < self.queue_max:
            return True
        if self.queue_policy == "spill":
            assert self._journal is not None
            if self._journal.total_bytes > self.max_journal_bytes:
                raise QueueFullError(
                    f"{self.sandbox}: journal holds {self._journal.total_bytes} bytes unsent "
                    f"(> {self.max_journal_bytes}); broker unreachable? last error: "
                    f"{self.last_error}")
            return False
        assert self._space is not None
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.queue_timeout_s
        while self._mem_items >= self.queue_max:
            self._space.clear()
            remaining = deadline - loop.time()
            if remaining <= 0:
                raise QueueFullError(
                    f"{self.sandbox}: {self._mem_items} events unacknowledged for "
                    f"{self.queue_timeout_s}s (queue_max_events={self.queue_max}); last error: "
                    f"{self.last_error}")
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._space.wait(), remaining)
            if self._closed_flag:
                raise EmitterClosedError("emitter is closed")
        return True

    async def _emit(self, kind: str, episode: str | None, fields: dict[str, Any], *,
                    topic: str | None = None, event_time_ms: int | None = None,
                    extra: dict[str, Any] | None = None, force: bool = False) -> tuple[str, int]:
        if (self._mem_items < self.queue_max or force) and not (
                self._closed_flag or self._stopping or self._sender is None):
            in_memory = True  # room: what _reserve decides at once, without a coroutine
        else:
            in_memory = await self._reserve(force)
        # -- no await from here on: seq assignment and journal append are one step ----------
        stream = SANDBOX_STREAM if episode is None else episode
        if kind == "EpisodeStart":
            if episode in self._open or episode in self._closed:
                raise EpisodeStateError(f"episode {episode!r} of {self.sandbox} already exists")
            seq = 0
        else:
            if episode is not None and episode not in self._open:
                state = "ended" if episode in self._closed else "not started"
                raise EpisodeStateError(f"episode {episode!r} of {self.sandbox} is {state}")
            seq = self._next_seq.get(stream, 0)
        pv = self._open.get(episode, {}).get("pv") if episode is not None else None
        if extra and "pv" in extra:
            pv = extra["pv"]
        event_id = self._new_id()
        record = {
            "header": {
                "event_id": event_id, "task": self.task, "sandbox": self.sandbox,
                "episode": episode, "seq": seq,
                "event_time_ms": event_time_ms if event_time_ms is not None else now_ms(),
                "producer_id": self.producer_id, "policy_version": pv,
            },
            **fields,
        }
        value = self._codec.encode(kind, record)
        if len(value) > self.max_inline + MESSAGE_OVERHEAD // 2:
            raise ValueError(f"{kind} event of {len(value)} bytes exceeds the maximum message "
                             f"size; large payloads must go through the claim-check")
        rid = self._next_rid
        topic = topic or self.topics.sandbox_events
        h: dict[str, Any] = {"t": "E", "rid": rid, "s": stream, "q": seq, "id": event_id,
                             "k": kind, "tp": topic}
        if extra:
            h.update(extra)
        journal = self._journal
        assert journal is not None
        if journal.needs_roll(len(value)):
            journal.open_new_segment(self._snapshot())
            self._gc_segments()
        # The acks collected since the last write go in the same write(2) as the event.
        acks = self._acked_rids
        seg, off, length = journal.append(h, value, acks)  # JournalError: nothing consumed
        if acks:
            self._acked_rids = []
        self._apply(h)
        item = QueuedEvent(rid, seg, off, length, topic, kind, stream, seq, event_id,
                     value if in_memory else None)
        if in_memory:
            self._mem_items += 1
        self._unacked[rid] = item
        self._seg_unacked[seg] = self._seg_unacked.get(seg, 0) + 1
        heapq.heappush(self._pending, (rid, item))
        assert self._idle is not None
        self._idle.clear()
        if self._shared is not None:
            self._shared.notify(self)
        return event_id, rid

    async def flush(self, timeout: float | None = None) -> bool:
        """Wait until every journaled event is acknowledged (True) or ``timeout`` passes."""
        if self._idle is None:
            return not self._unacked
        try:
            await asyncio.wait_for(self._idle.wait(), timeout)
        except TimeoutError:
            return False
        finally:
            self._flush_acks()
        return True

    async def _wait_acked(self, rid: int, timeout: float) -> bool:
        if rid not in self._unacked:
            return True
        fut = self._ack_waiters.get(rid)
        if fut is None:
            fut = asyncio.get_running_loop().create_future()
            self._ack_waiters[rid] = fut
        try:
            await asyncio.wait_for(asyncio.shield(fut), max(0.0, timeout))
        except (TimeoutError, EmitterClosedError):
            return False
        return True

    # -- drain --------------------------------------------------------------------------------
    async def drain(self, deadline_s: float | None = None, *, detail: str = "") -> DrainReport:
        """Flush everything pending, wait for broker acks, then publish Drained with the final
        seq of every open episode -- all within ``deadline_s`` (default
        ``settings.producer.drain_deadline_s``). Never raises for a slow or absent broker: the
        report says exactly which events were not acknowledged (they stay journaled)."""
        loop = asyncio.get_running_loop()
        deadline_s = self.settings.producer.drain_deadline_s if deadline_s is None else deadline_s
        t0 = loop.time()
        end = t0 + deadline_s
        acked0 = self.acked_count
        reserve = min(2.0, deadline_s * 0.2)
        await self.flush(max(0.0, end - reserve - loop.time()))
        before = len(self._unacked)
        final = {ep: self._next_seq.get(ep, 1) - 1 for ep in self._open}
        drained_id: str | None = None
        drained_acked = False
        error: str | None = None
        try:
            drained_id, rid = await self._emit("Drained", None, {
                "final_seqs": [{"episode": e, "final_seq": s} for e, s in final.items()],
                "complete": before == 0, "unflushed": before,
                "detail": self._text(detail or (
                    f"{before} events unacknowledged at the deadline; last error: "
                    f"{self.last_error}" if before else "")),
            }, force=True)
            drained_acked = await self._wait_acked(rid, end - loop.time())
        except (JournalError, EmitterClosedError, ValueError) as exc:
            error = f"{type(exc).__name__}: {exc}"
        self._flush_acks()
        unflushed = [UnflushedEvent(i.kind, None if i.stream == SANDBOX_STREAM else i.stream,
                                    i.seq, i.event_id, i.topic)
                     for _, i in sorted(self._unacked.items())]
        return DrainReport(
            complete=not unflushed and drained_acked, flushed=self.acked_count - acked0,
            unflushed=unflushed, final_seqs=final, drained_event_id=drained_id,
            drained_acked=drained_acked, elapsed_s=loop.time() - t0,
            error=error or (self.last_error if unflushed else None),
        )


class _SendHandle:
    """``SandboxEmitter._sender``: this emitter's membership of the loop's shared sender.
    ``cancel()`` stops sending its events (they stay journaled and pending), as cancelling
    its own send task did before the sender was shared (tests use it to simulate a sender that
    never gets acknowledgements)."""

    __slots__ = ("_em",)

    def __init__(self, em: SandboxEmitter) -> None:
        self._em = em

    def cancel(self) -> None:
        if self._em._send_state == "active":
            self._em._send_state = "paused"

    def done(self) -> bool:
        return self._em._send_state != "active"


def _implements_sender_member(em: SandboxEmitter) -> SenderMember:
    """Type-checked only: :class:`SandboxEmitter` implements :class:`SenderMember`."""
    return em
