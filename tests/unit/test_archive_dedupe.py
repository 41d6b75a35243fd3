"""Specification of write-time deduplication: the archive holds exactly one row per event.

Re-sent copies (same sandbox, episode, seq and bytes) never become a second row — in the same
batch, in a later batch, after a restart, after the episode was evicted from the bounded
cache, and after a crash between upload and commit. A conflicting copy (same key, other
content) is not merged: it is a row of ``conflicts/``. Checked with DuckDB over the raw files.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import duckdb
import pytest
from test_archive_store import T0, fleet, records, shell_for

from trajbus.archive.archiver import ArchiveShell
from trajbus.archive.query import ArchiveReader
from trajbus.archive.storage import LocalStore
from trajbus.archive.synth import episode_events
from trajbus.schemas.models import Event, ToolCall


def raw_counts(root: Path, area: str = "events") -> tuple[int, int]:
    """(rows, distinct (sandbox, episode, seq)) of the raw files, read by DuckDB directly."""
    files = list((root / area).rglob("*.parquet"))
    if not files:
        return 0, 0
    row = duckdb.sql(
        f"SELECT count(*), count(DISTINCT (sandbox, coalesce(episode, ''), seq)) "
        f"FROM read_parquet('{root}/{area}/**/*.parquet')").fetchall()[0]
    return int(row[0]), int(row[1])


def commit_all(sh: ArchiveShell, recs: list[Any]) -> None:
    step = sh.process(recs)
    sh.committed(step.batches + sh.flush_all().batches)


def test_resent_copies_in_the_same_and_later_batches_and_after_a_restart_are_one_row(
        tmp_path: Path) -> None:
    store = LocalStore(tmp_path / "a")
    events = fleet(sandboxes=4, episodes=2)
    # the batch itself carries every third event twice
    first = records(events + events[::3])
    sh = shell_for(store, tmp_path, target_object_bytes=4_000)
    commit_all(sh, first)
    assert sh.duplicates == len(events[::3])
    assert raw_counts(store.root) == (len(events), len(events))
    # "hours later" a restarted archiver (new process: empty cache) reads a journal re-send
    later = shell_for(store, tmp_path, target_object_bytes=4_000)
    later.assigned(first[0].topic, 0, len(first))
    commit_all(later, records(events[5:20], start=len(first)))
    assert later.duplicates == 15 and later.dedupe.stats.loads > 0
    assert raw_counts(store.root) == (len(events), len(events))


def test_a_conflicting_copy_is_kept_apart_in_conflicts_not_merged(tmp_path: Path) -> None:
    store = LocalStore(tmp_path / "a")
    events = episode_events("web", "sb-0", "ep-0", t0_ms=T0)
    call = next(e for e in events if isinstance(e, ToolCall))
    other = call.model_copy(update={"args_hash": "something-else"})
    sh = shell_for(store, tmp_path)
    commit_all(sh, records([*events, other]))
    assert sh.conflicts == 1
    assert raw_counts(store.root) == (len(events), len(events))
    kept = duckdb.sql(f"SELECT args_hash FROM read_parquet('{store.root}/events/**/*.parquet') "
                      f"WHERE seq = {call.header.seq}").fetchall()
    assert kept == [(call.args_hash,)], "the first version wins"
    conflict = duckdb.sql(
        f"SELECT seq, args_hash, kafka_offset FROM "
        f"read_parquet('{store.root}/conflicts/**/*.parquet')").fetchall()
    assert conflict == [(call.header.seq, "something-else", len(events))]
    con = ArchiveReader(store).connect()
    assert con.execute("SELECT count(*) FROM conflicts").fetchone() == (1,)


def test_memory_is_bounded_and_evicted_episodes_are_reloaded_from_the_store(
        tmp_path: Path) -> None:
    store = LocalStore(tmp_path / "a")
    events = fleet(sandboxes=6, episodes=4)
    sh = shell_for(store, tmp_path, target_object_bytes=2_000)
    sh.dedupe.max_keys = 20
    recs = records(events)
    commit_all(sh, recs)
    assert sh.dedupe.stats.evictions > 0
    assert sh.dedupe._keys <= 20
    # every event re-sent: each is found again in the store, none archived twice
    commit_all(sh, records(events, start=len(recs)))
    assert sh.duplicates == len(events)
    assert sh.dedupe.stats.loads > 0
    assert raw_counts(store.root) == (len(events), len(events))


def test_a_crash_between_upload_and_commit_replays_to_the_same_single_rows(
        tmp_path: Path) -> None:
    store = LocalStore(tmp_path / "a")
    events = fleet(sandboxes=3, episodes=2)
    recs = records(events + events[:7])  # the tail re-sends the first seven
    crashed = shell_for(store, tmp_path, target_object_bytes=3_000)
    crashed.process(recs)
    crashed.flush_all()  # uploaded, never committed: every batch marker stays
    assert store.list("_batches/")
    assert raw_counts(store.root) == (len(events), len(events))
    # restart: consumption resumes at the committed offset 0 and replays the same batches;
    # the rows the crashed attempt uploaded are not mistaken for earlier copies
    again = shell_for(store, tmp_path, target_object_bytes=3_000)
    pending = again.assigned(recs[0].topic, 0, 0)
    assert pending
    commit_all(again, recs)
    assert again.duplicates == 7
    assert raw_counts(store.root) == (len(events), len(events))
    assert not store.list("_batches/")


def test_the_batch_marker_is_written_before_any_object(tmp_path: Path) -> None:
    """A crash after some objects of a batch were uploaded but before anything else still
    leaves a marker, so the restart replays the same boundary and overwrites those keys."""
    store = LocalStore(tmp_path / "a")
    seen_marker_first: list[bool] = []
    put_file = store.put_file

    def spy(key: str, path: Any) -> int:
        seen_marker_first.append(bool(store.list("_batches/")))
        return put_file(key, path)

    store.put_file = spy  # type: ignore[method-assign]
    sh = shell_for(store, tmp_path)
    sh.process(records(fleet(sandboxes=2, episodes=1)))
    sh.flush_all()
    assert seen_marker_first and all(seen_marker_first)


@pytest.mark.parametrize("copies", [2, 5])
def test_episode_reads_and_sql_count_each_event_once(tmp_path: Path, copies: int) -> None:
    store = LocalStore(tmp_path / "a")
    events: list[Event] = fleet(sandboxes=2, episodes=2)
    sh = shell_for(store, tmp_path, target_object_bytes=3_000)
    commit_all(sh, records(events * copies))
    reader = ArchiveReader(store)
    con = reader.connect()
    assert con.execute("SELECT count(*) FROM events").fetchone() == (len(events),)
    ep = reader.episode("web", "sb-0", "ep-0")
    assert ep["seq"].to_pylist() == list(range(ep.num_rows))
