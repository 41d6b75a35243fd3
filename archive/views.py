"""The views of ``ArchiveReader.connect()`` (``trajbus archive sql``), by name, with what each
holds. A module without imports, so the command line's help is written from it without
loading pyarrow or DuckDB."""

from __future__ import annotations

VIEWS: dict[str, str] = {
    "events": "every archived event, one row each (the archive columns, plus date and hour)",
    "episodes": "one row per episode: seq range, counts, completeness, and its ending "
    "(complete / truncated / terminated / in_progress, truncated_by, terminate_decision_id)",
    "episode_objects": "the index: one row per task, sandbox, episode and object",
    "conflicts": "conflicting copies of events (same key, other bytes), kept apart",
    "decisions": "scheduling decisions, with decided_by: scheduler / watchdog",
    "alerts": "watchdog alerts (LOOP, LOOP_ENDED, STALL) with their evidence",
    "dead_letters": "input a processor refused: stage, reason_code, source position",
    "decision_acks": "the sandbox runtime's answers (DONE / FAILED) to decisions",
    "lifecycle": "sandbox state changes and drain reports (final_seqs, complete)",
}
"""Every view of :meth:`ArchiveReader.connect` (``trajbus archive sql``) and what it holds:
``archive sql --help`` is written from it, and a test checks it against the views a
connection has."""

__all__ = ["VIEWS"]
