"""Watchdog core: catch looping agents in the tool-call stream, leave progressing agents alone.

This module is the core's import path and its specification; the code lives in
:mod:`trajbus.consumers.watchdog.detector`, one concern per module.

A pure, deterministic core (no clock, no I/O, no randomness). The Kafka shell feeds it, per
replay record, :meth:`WatchdogCore.advance` (the record's partition and log time) and then the
decoded events it carries with :meth:`WatchdogCore.handle`, and persists
:meth:`WatchdogCore.take_dirty` to a changelog. The same input sequence always yields the same
outputs, byte for byte, including event ids (uuid5 of the evidence).

Time -- what judges what
    Two clocks, never compared with each other:

    - *Event time* (``header.event_time_ms``, the sandbox's own clock, which may lag or lead
      the broker by hours) judges only the loop rule's span: the time between two events of
      the same stream, both on the same sandbox's clock.
    - *Log time* judges every timer: the STALL alert, idle eviction, and so the end of a loop
      by eviction. Each stream belongs to one *log* (the Kafka adapter: the replay topic and
      partition that carry it) and remembers when it was last seen there: ``max(the log's
      clock, the log time of the record that carried its latest event)``. A log's clock is the
      latest record timestamp read from that log (:meth:`~WatchdogCore.advance`), so it never
      runs ahead of what has been read of that log; the timers of a log's streams run when its
      clock moves, before the record's events are applied.

    So a decision depends only on each replay partition's records in offset order: not on
    where the runner's ticks fall, not on how the consumer interleaves partitions, not on a
    restart (a restored stream keeps its log time; a log's clock is rebuilt from its next
    record, and any timer due by the committed records had fired before the commit), nor on
    a sandbox's clock. The runner's wall-clock ticks judge nothing: read from their own topic,
    a tick can land between an episode's segments after a restart (the tick topic read ahead
    of the replay backlog), or at every tick for a sandbox whose clock lags the broker by more
    than the idle timeout; judged by ticks, the stream would be evicted as idle and its loop
    count start over, so a loop that `replay explain` and `watchdog explain --from-log` find
    would be missed (docs/decisions/0018-watchdog-timers-on-log-time.md;
    tests/unit/test_watchdog_log_time.py).

    What log time cannot hide: an outage of the pipeline appears in the log as a gap of its
    length, so a stream silent for a threshold minus the outage may be judged differently
    than without the outage (reproducibly: the gap is in the log). And a log with no new
    record has a stopped clock: a STALL (or an eviction) in a replay partition that carries
    no other traffic is reported only when its next record is read.

    :meth:`~WatchdogCore.tick` advances every log's clock to a time: for callers whose only
    log is the events themselves (tests, offline tools: events fed without
    :meth:`~WatchdogCore.advance` are timed by their event time in log ``""``).

Streams
    State is kept per *stream* = (sandbox, episode); key :func:`state_key`. A stream starts with
    its first ToolCall, ToolResult or EpisodeStart and is dropped on EpisodeEnd, on
    SandboxLifecycle DRAINING/RECYCLED (all episodes of the sandbox), or when idle for
    ``evict_idle_ms`` of its log's time (see "Time"). Episode events whose ``seq`` is not above
    the stream's last seen ``seq`` are duplicates (redelivery after a restart) and are ignored.

Call identity
    A call is ``(tool, args fingerprint)``. The fingerprint is the canonical hash
    (:mod:`trajbus.consumers.watchdog.canonical`) with the task's ``ignore_fields`` removed: when
    ``args_canonical`` is present and mentions an ignored field, it is recomputed from that text;
    otherwise ``args_hash`` is used (by the event contract it is the SHA-256 of
    ``args_canonical``). With ``trust_canonical=False`` every ``args_canonical`` is fully
    re-canonicalised instead. A result is ``(status, result fingerprint)``, computed the same way
    from ``result_hash``/``result_canonical``; an ERROR with the same body as an OK differs.

Loop rule (per stream, thresholds per task)
    For every cycle length ``L`` in ``1..max_cycle_length`` the core keeps one *window*: the
    longest recent run of calls ``c[s..n]`` with ``c[i] == c[i-L]`` for every ``i`` in it whose
    results did not change too often. The window's *pattern* is ``c[s..s+L-1]``.

    - ``repeat_count`` = completed occurrences of the pattern = ``(n - s + 1) // L``. "The same
      call repeated 20 times in a row" means 20 consecutive identical calls (L=1), 20
      consecutive ``A,B`` pairs (L=2), and so on.
    - ``span_ms`` = latest event time seen in the stream (calls, results and other episode
      events) minus the event time of call ``s``.
    - A *result change* is a result whose fingerprint differs from the result of the same
      cycle position one cycle earlier within the window (or one cycle later, when results
      arrive out of order); results not received are not evidence either way.
      ``distinct_results`` in the evidence is this number of changes; so
      ``loop_max_distinct_results = 0`` ("zero distinct results") means every repetition
      returned exactly what the previous one at its position returned.
    - A call with ``c[n] != c[n-L]`` breaks the window: it restarts at ``s = n-L+1`` (the last
      ``L`` calls become the new candidate). A result change that exceeds
      ``loop_max_distinct_results`` restarts the window at the later call of the differing pair
      (so an agent that clicks until the page changes starts from zero, and is only caught if
      it then stays stuck on the new page for the full thresholds).
    - The rule fires for ``L`` when ``repeat_count >= loop_min_repeats`` AND
      ``span_ms >= loop_min_span_ms`` AND ``result changes <= loop_max_distinct_results`` AND the
      pattern is primitive (not itself a repetition of a shorter pattern, which the shorter
      cycle length covers). It is evaluated after every ToolCall and ToolResult; the smallest
      firing ``L`` wins.
    - Exactly one LOOP alert per loop (plus a TERMINATE/suspicious decision unless
      ``dry_run``). While it is active nothing else fires for the stream. The loop ends -- one
      LOOP_ENDED alert -- when its window breaks (a different call), when a result changes
      beyond the allowance, or when tracking ends (episode end, draining/recycled, idle
      eviction; an eviction's LOOP_ENDED is stamped with the stream's last event time). A
      later, new loop (new window) alerts again.
    - Results are matched to calls by ``call_id`` among the last ``max_cycle_length + 1``
      calls; a result for an older call is not loop evidence (it only closes the open call).

Stall rule
    A stream with an open call (a ToolCall without its ToolResult) and no episode event for
    ``stall_after_ms`` of its log's time gets one STALL alert (never a decision), stamped with
    that log time; if the clock passes the idle eviction at the same moment, the STALL comes
    first. The next event of the stream re-arms it. Open calls older than the last
    ``max_cycle_length + 1`` calls are tracked as a counter (a ToolResult with an unknown
    ``call_id`` decrements it).

Bounded state
    Per stream: a ring of the last ``max_cycle_length + 1`` calls and one 5-int window per
    cycle length, whatever the history length. Serialized (``take_dirty``) it is a compact JSON
    list (~0.5-1 KiB with 3 open calls; version 2 adds its log and log time; version 1 still
    loads, its log then unknown: no timer judges it until its next event). Per log: its clock
    and when its next timer is due at the earliest (a lower bound: a log's streams are scanned
    only once its clock reaches it).

Invalid input never raises: :meth:`~WatchdogCore.handle` returns a :class:`DeadLetterOut`.
"""

from __future__ import annotations

from .detector.explain import CandidateExplanation, Explanation
from .detector.machine import WatchdogCore
from .detector.outputs import (
    EVENT_ID_NAMESPACE,
    AlertOut,
    DeadLetterOut,
    DecisionOut,
    Output,
    output_event_id,
    state_key,
    to_model,
)
from .detector.rules import LoopRules
from .detector.stream import STATE_VERSION

__all__ = [
    "EVENT_ID_NAMESPACE",
    "STATE_VERSION",
    "AlertOut",
    "CandidateExplanation",
    "DeadLetterOut",
    "DecisionOut",
    "Explanation",
    "LoopRules",
    "Output",
    "WatchdogCore",
    "output_event_id",
    "state_key",
    "to_model",
]
