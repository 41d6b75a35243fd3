"""The replay reorder core: a pure, deterministic state machine that turns one partition's
shuffled, duplicated episode events into ordered, deduplicated replay segments.

This module is the core's import path and its specification; the code lives in
:mod:`trajbus.consumers.replay.reorder`, one concern per module.

The Kafka shell (written separately) decodes each input record, builds an :class:`InEvent`
with :meth:`InEvent.from_decoded`, calls :meth:`ReorderCore.handle`, calls
:meth:`ReorderCore.tick` with its own clock now and then, and writes the outputs plus
:meth:`ReorderCore.take_dirty` (the changelog) in one Kafka transaction.

Guarantees (per episode, keyed by ``(sandbox, episode)``):

* **Order, exactly once.** Every accepted event appears in exactly one :class:`SegmentOut`,
  in ``seq`` order; concatenating an episode's segments gives its events sorted by seq,
  without duplicates. Segment indexes count 0, 1, 2, ... with no holes.
* **Streaming.** A segment is emitted as soon as the next expected seq arrives; it carries
  that event plus every buffered event that is now contiguous (split by the segment caps).
* **Exact duplicates** (same key, same content digest) are dropped and counted; a
  **conflicting duplicate** (same key, different content) becomes a :class:`DeadLetterOut`
  (``conflicting_duplicate``) carrying both versions when the first one is still buffered,
  and the new one plus a reason when the first one was already emitted. The first version
  always wins. Content comparison for already-emitted events covers the last
  ``dedupe_window`` sequences of the episode by their 64-bit digest and every older seq of
  the episode (up to ``HISTORY_MAX`` seqs) by a 16-bit digest: an older exact duplicate is
  dropped (counter ``duplicates``), an older conflicting one is a ``conflicting_duplicate``
  dead letter like a recent one (missed only when the 16-bit digests collide, 1 in 65,536).
  A duplicate older than the history (an episode longer than ``HISTORY_MAX`` seqs, a gap
  wider than ``HISTORY_GAP_MAX`` seqs, or state restored from a changelog written before
  the history existed) cannot be compared: it is an ``unverified_duplicate`` dead letter
  (counter ``duplicates_unverified``), never dropped silently.
* **Gaps.** When an event beyond the next expected seq arrives, the episode *stalls*; the
  stall timer starts at the event's *arrival time* (below) and restarts whenever the episode
  makes progress while events are still buffered. Once the clock has passed that time plus
  ``gap_timeout_ms`` without the missing seqs, the gap is closed: the next segment carries
  ``gap=(from_seq, to_seq)`` (the seqs declared missing) and the stream continues. An event
  that arrives after its gap was closed is a :class:`LateOut` (``after_gap``), never spliced
  into a later segment.
* **Clock.** The core's clock is the maximum of every event time and every ``tick(now_ms)``
  seen (a watermark); the wall clock is never read. A producer with a clock far ahead
  therefore closes gaps early (the shell should tick from a sane clock and may clamp
  event times). With ``event_time_clock=False`` only ticks move it.
* **Arrival time.** Every timeout an event starts (stall, recycle grace, idle, tombstone)
  counts from ``max(clock, ev.log_time_ms)``: the record's log time (when it was written to
  Kafka) at the earliest. The clock can lag far behind that moment (one input topic read
  behind the other, or a clock restored from a changelog that is stale by the downtime); a
  timer started from the lagging clock would expire as soon as the clock caught up, before
  the records written right after the opening one were read: a false gap. Decisions still
  depend only on the log (log times are in it).
* **End.** The EpisodeEnd's seq is the last: the segment that contains it (once everything
  before it was emitted or declared missing) has ``is_last=True`` and
  ``is_terminal = (outcome == "TERMINAL")``. A ``Drained`` event's ``final_seq`` for an
  episode without EpisodeEnd also bounds it: once everything up to it is emitted the
  episode ends truncated (``is_last=True, is_terminal=False``). Events with a seq beyond
  the known last seq are dead letters (``seq_after_end``).
* **Recycle.** ``SandboxLifecycle(state=RECYCLED)`` (sandbox-level, ``episode=None``) arms a
  grace deadline (``recycle_grace_ms``, default ``gap_timeout_ms``) on every open episode of
  that sandbox: trace chunks travel on another topic and may still be in flight. At the
  deadline, buffered events are flushed (closing gaps with markers) and the episode ends
  truncated with a final segment (zero events when nothing was pending; its ``gap`` covers
  the seqs up to the drained final seq when one is known). Episodes first seen for a
  recycled sandbox after the grace are late (``sandbox_recycled``).
* **Closed episodes** stay as tombstones for ``tombstone_ttl_ms`` (default
  ``60 * gap_timeout_ms``): duplicates of their events are still dropped (or dead-lettered
  when conflicting); seqs inside a closed gap are :class:`LateOut` (``after_gap``); new seqs
  of a truncated episode are :class:`LateOut` (``after_close``). After the TTL the key is
  forgotten (a ``None`` in the changelog).
* **Bounded memory.** An episode never holds more than ``max_buffered_per_episode`` events
  (nor ``max_buffered_bytes_per_episode`` bytes) and the core never more than
  ``max_buffered_total``: when a bound is exceeded, the oldest gap (of that episode, or of
  the episode that has stalled longest for the total bound) is force-closed early, exactly
  as on timeout (gap marker, stream continues; counter ``forced_gap_closes``). Nothing
  stalls and nothing is dropped silently.
* **Per-sandbox limit.** A sandbox may have at most ``max_open_episodes_per_sandbox`` episodes
  open at once (a sandbox runs one episode at a time; a flood of opened episodes is a broken
  or hostile sandbox). An event that would open one more is a dead letter
  (``too_many_open_episodes``, counter ``episodes_refused``) with its bytes; once the sandbox's
  episodes end, new ones are admitted again.
  The limit is judged at the event's arrival time *on the clock*, i.e. once every input
  topic has been read that far: an event that would exceed it while its arrival is still
  ahead of the clock is **held** (counters ``held_events``, gauge ``held``) and judged when
  the clock reaches it. Episodes look open while another input topic lags (their ends and
  middle events are in its unread part); judged at once, a sandbox's ordinary episodes would
  be refused because the worker read one topic ahead of the other. Held events are judged in
  arrival order; while a sandbox has held events, its new episodes queue behind them (a slot
  freed meanwhile goes to the earliest); an episode is judged as one, at its first held
  arrival (its other events join it), and a ``Drained``'s final seq for a held episode is held
  with it. A held event is judged as on arrival (the same recycle deadline and limit); its
  dead letter names its source record (``DeadLetterOut.origin``). Held events of a sandbox
  are bounded by ``max_buffered_per_episode`` (count) and ``max_buffered_bytes_per_episode``
  (bytes) and count towards ``max_buffered_total``; beyond a bound an event is judged at once.
* **Bad input never raises**: it becomes a :class:`DeadLetterOut` with a stable
  ``reason_code`` (``invalid_seq``, ``missing_episode``, ``missing_sandbox``,
  ``invalid_event``, ``bad_start_seq``, ``missing_outcome``, ``seq_after_end``,
  ``conflicting_end``, ``conflicting_duplicate``, ``unverified_duplicate``,
  ``too_many_open_episodes``, ``internal_error``).
* **Determinism.** Outputs depend only on the sequence of ``handle``/``tick`` calls. Segment
  event ids are uuid5 of ``sandbox/episode/segment_index``; :func:`segment_record` builds the
  ReplaySegment record, so re-running a log produces byte-identical segments.
* **Persistence.** :meth:`ReorderCore.take_dirty` returns compact blobs for every key
  changed since the last call (``"sandbox/episode"`` per episode, ``"sandbox/"`` per
  recycled sandbox, ``"@clock"`` for the clock; ``None`` when deleted). Feeding the latest
  blob of every key to :meth:`ReorderCore.restore` of a fresh core resumes with outputs
  identical to an uninterrupted run. Restoring a key several times (a changelog not yet
  compacted) costs no more memory than restoring its latest record: timers are armed once per
  restored key, before the next ``handle``/``tick``.
"""

from __future__ import annotations

from .reorder.episode import (
    GAPS_KEPT,
    HISTORY_GAP_MAX,
    HISTORY_MAX,
)
from .reorder.events import (
    CLOCK_KEY,
    DIGEST_SIZE,
    HELD_PREFIX,
    SEGMENT_NAMESPACE,
    DeadLetterOut,
    InEvent,
    LateOut,
    Origin,
    Output,
    SegmentOut,
    content_digest,
    episode_key,
    replay_segment,
    segment_event_id,
    segment_record,
)
from .reorder.machine import ReorderCore

__all__ = [
    "CLOCK_KEY",
    "DIGEST_SIZE",
    "GAPS_KEPT",
    "HELD_PREFIX",
    "HISTORY_GAP_MAX",
    "HISTORY_MAX",
    "SEGMENT_NAMESPACE",
    "DeadLetterOut",
    "InEvent",
    "LateOut",
    "Origin",
    "Output",
    "ReorderCore",
    "SegmentOut",
    "content_digest",
    "episode_key",
    "replay_segment",
    "segment_event_id",
    "segment_record",
]
