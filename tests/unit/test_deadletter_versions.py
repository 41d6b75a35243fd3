"""A conflicting duplicate's dead letter carries both versions whole: the rejected one in
``original_value`` and the kept one in ``conflicting_value`` (not a hex excerpt in the reason),
within the size rule for poison pills: a dead letter always fits the derived topics' limit, and
what had to be cut is named in the reason with where the whole bytes are.

Pure: the reorder processor the worker runs, fed records as the consumer hands them over."""

from __future__ import annotations

from trajbus.bus.settings import ReplaySettings, Settings, TopicSettings
from trajbus.bus.topics import Topics
from trajbus.consumers.engine.processors import ReorderProcessor
from trajbus.consumers.engine.runner import InRecord, OutRecord
from trajbus.schemas import models as m
from trajbus.schemas.codec import default_codec

codec = default_codec()
T0 = 1_767_225_600_000


def _call(seq: int, summary: str, producer: str = "p1") -> bytes:
    h = m.Envelope(event_id=f"e{seq}", task="task-a", sandbox="sb-1", episode="ep-1", seq=seq,
                   event_time_ms=T0 + seq, producer_id=producer)
    return m.ToolCall(header=h, call_id=f"c{seq}", tool="exec", args_hash="0" * 64,
                      args_summary=summary).encode()


def _start() -> bytes:
    h = m.Envelope(event_id="e0", task="task-a", sandbox="sb-1", episode="ep-1", seq=0,
                   event_time_ms=T0, producer_id="p1")
    return m.EpisodeStart(header=h).encode()


def _run(settings: Settings, values: list[bytes]) -> list[OutRecord]:
    p = ReorderProcessor(settings)
    outs: list[OutRecord] = []
    for off, v in enumerate(values):
        outs += p.handle(InRecord("t.sandbox.events", 0, off, b"sb-1", v, T0 + off))
    return outs


def _settings(max_message_bytes: int = 8 * 1024 * 1024) -> Settings:
    return Settings(topics=TopicSettings(prefix="t", max_message_bytes=max_message_bytes),
                    replay=ReplaySettings(gap_timeout_ms=60_000))


def _letters(outs: list[OutRecord]) -> list[OutRecord]:
    return [o for o in outs if o.topic == "t.deadletter"]


def test_a_conflict_with_a_buffered_event_carries_both_versions_whole() -> None:
    kept = _call(2, "x" * 50_000)
    rejected = _call(2, "y" * 50_000, producer="impostor")
    [dl] = _letters(_run(_settings(), [_start(), kept, rejected]))
    rec = codec.decode(dl.value).record
    assert rec["reason_code"] == "conflicting_duplicate"
    assert rec["original_value"] == rejected
    assert rec["conflicting_value"] == kept
    assert "truncated" not in rec["reason"] and kept.hex()[:40] not in rec["reason"]


def test_a_conflict_with_an_emitted_event_says_where_the_kept_version_is() -> None:
    kept = _call(1, "x")
    rejected = _call(1, "y", producer="impostor")
    [dl] = _letters(_run(_settings(), [_start(), kept, rejected]))
    rec = codec.decode(dl.value).record
    assert rec["reason_code"] == "conflicting_duplicate"
    assert rec["original_value"] == rejected and rec["conflicting_value"] is None
    assert "kept version is in the episode's replay segments" in rec["reason"]


def test_two_versions_too_big_together_are_cut_to_fit_and_the_reason_says_so() -> None:
    huge = 8 * 1024 * 1024 - 4096  # each within the input limit; together over any record limit
    kept, rejected = _call(2, "x" * huge), _call(2, "y" * huge, producer="impostor")
    [dl] = _letters(_run(_settings(), [_start(), kept, rejected]))
    assert len(dl.value) <= Topics(_settings()).derived_max_bytes
    rec = codec.decode(dl.value).record
    assert rec["original_value"] == rejected  # the rejected one is only in this record: whole
    assert kept.startswith(rec["conflicting_value"]) and len(rec["conflicting_value"]) > 0
    assert "kept version of" in rec["reason"] and "replayed whole" in rec["reason"]


def test_a_conflict_far_behind_the_dedupe_window_is_a_counted_dead_letter() -> None:
    """Issue 37: a conflicting copy more than 64 seqs back was dropped with no dead letter and
    no metric. Now it is a dead letter (the kept version is in the replay segments) and the
    dead-letter counter counts it; an exact copy that far back is still just a duplicate."""
    from trajbus.bus import deadletter

    before = deadletter.counts[("reorder", "conflicting_duplicate")]
    values = [_start()] + [_call(s, f"call {s}") for s in range(1, 101)]
    outs = _run(_settings(), [*values, _call(1, "call 1"), _call(1, "another call 1")])
    [dl] = _letters(outs)
    rec = codec.decode(dl.value).record
    assert rec["reason_code"] == "conflicting_duplicate" and "100 seqs back" in rec["reason"]
    assert rec["original_value"] == _call(1, "another call 1")
    assert rec["source_offset"] == 102
    assert deadletter.counts[("reorder", "conflicting_duplicate")] == before + 1
