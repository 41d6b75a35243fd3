"""The README's "For the data team" snippets run verbatim — the shell commands and the Python
blocks, against a local archive and against an S3 archive (moto's server on loopback) — and
return each event exactly once, although every event was received twice."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import uuid
from collections import Counter
from pathlib import Path
from typing import Any

import boto3
import pytest
from support import REPO
from test_archive_store import T0, records, shell_for

from trajbus.archive.episodes import publish_episodes
from trajbus.archive.query import ArchiveReader
from trajbus.archive.storage import LocalStore, ObjectStore, open_store
from trajbus.archive.synth import episode_events
from trajbus.schemas.models import Event


def section() -> str:
    text = (REPO / "README.md").read_text()
    return text[text.index("## For the data team"):text.index("## For sandbox runtimes")]


def blocks(lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", section(), flags=re.S)


def fleet() -> list[Event]:
    """Task web-shop with sandbox SB (episode 00001 complete, 00002 missing seq 2) and a few
    other sandboxes and a second task."""
    evs = episode_events("web-shop", "SB", "00001", t0_ms=T0)
    evs += [e for e in episode_events("web-shop", "SB", "00002", t0_ms=T0 + 60_000)
            if e.header.seq != 2]
    for i in range(3):
        evs += episode_events("web-shop", f"sb-{i}", "00001", t0_ms=T0 + i)
        evs += episode_events("swe", f"sb-swe-{i}", "00001", t0_ms=T0 + 3_600_000 + i)
    return evs


def build(store: ObjectStore, tmp_path: Path) -> list[Event]:
    """Archive every event twice (an emitter journal re-sent all of it) and publish the
    episode table."""
    evs = fleet()
    sh = shell_for(store, tmp_path, target_object_bytes=3_000)
    step = sh.process(records(evs + evs))
    sh.committed(step.batches + sh.flush_all().batches)
    publish_episodes(store, ArchiveReader(store).episodes())
    return evs


def check(ns: dict[str, Any], evs: list[Event]) -> None:
    kinds = Counter(type(e).__name__ for e in evs)
    assert dict(ns["kinds"]) == dict(kinds)
    sb = ns["sb"]
    assert sorted(zip(sb["episode"], sb["seq"], strict=True)) == sorted(
        (e.header.episode, e.header.seq) for e in evs if e.header.sandbox == "SB")
    assert {str(d) for d in sb["date"]} == {"2024-05-01"} and set(sb["hour"]) == {10}
    web = ns["web"]
    assert web.num_rows == sum(e.header.task == "web-shop" for e in evs)
    assert len({(s, e, q) for s, e, q in zip(*(web.column(c).to_pylist() for c in (
        "sandbox", "episode", "seq")), strict=True)}) == web.num_rows


def test_local_snippets_run_verbatim_and_count_each_event_once(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    evs = build(LocalStore(tmp_path / ".trajbus" / "archive"), tmp_path)
    monkeypatch.chdir(tmp_path)
    ns: dict[str, Any] = {}
    exec(blocks("python")[0], ns)
    check(ns, evs)
    assert ns["gappy"]["episode"].to_list() == ["00002"]
    assert ns["gappy"]["gaps"].to_list() == [[{"first": 2, "last": 2}]]

    env = {**os.environ, "TRAJBUS_ARCHIVE__URL": str(tmp_path / ".trajbus" / "archive")}
    outputs = []
    for line in blocks("bash")[0].splitlines():
        cmd = shlex.split(line, comments=True)
        if not cmd:
            continue
        if cmd[-1] == "--publish":
            cmd.append("--help")  # already published by build(); check the option exists
        res = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True,
                             timeout=120, check=False)
        assert res.returncode == 0, (line, res.stderr)
        outputs.append(res.stdout)
    tools = dict(row.split("\t")[:2] for row in outputs[0].splitlines()[1:])
    assert tools["browser.click"] == str(sum(1 for e in evs if e.header.task == "web-shop"
                                             and getattr(e, "tool", None)))
    assert [row.split("\t")[:3] for row in outputs[1].splitlines()[1:]] == [
        ["SB", "00002", "has_gaps"]]
    assert len(outputs[2].splitlines()) == sum(
        1 for e in evs if (e.header.sandbox, e.header.episode) == ("SB", "00001"))


@pytest.fixture
def s3_archive(s3_server: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
               ) -> tuple[ObjectStore, list[Event]]:
    bucket = f"readme-{uuid.uuid4().hex[:8]}"
    boto3.client("s3", endpoint_url=s3_server).create_bucket(Bucket=bucket)
    url = f"s3://{bucket}/trajbus/archive"
    monkeypatch.setenv("TRAJBUS_ARCHIVE__URL", url)
    monkeypatch.setenv("TRAJBUS_ARCHIVE__S3_ENDPOINT_URL", s3_server)
    store = open_store(url, s3_server)
    return store, build(store, tmp_path)


def test_s3_snippets_run_verbatim_with_polars_pyarrow_and_duckdb(
        s3_archive: tuple[ObjectStore, list[Event]]) -> None:
    _, evs = s3_archive
    ns: dict[str, Any] = {}
    exec(blocks("python")[1], ns)
    check(ns, evs)


def test_s3_snippet_with_duckdb_httpfs_where_the_extension_is_available(
        s3_archive: tuple[ObjectStore, list[Event]]) -> None:
    import duckdb

    try:
        duckdb.connect().execute("LOAD httpfs")
    except duckdb.Error as exc:
        pytest.skip(f"DuckDB's httpfs extension is not installed here ({str(exc)[:80]}...): "
                    "INSTALL httpfs needs the internet")
    _, evs = s3_archive
    ns: dict[str, Any] = {}
    exec(blocks("python")[2], ns)
    assert dict(ns["kinds"]) == dict(Counter(type(e).__name__ for e in evs))


def test_decision_context_snippets_answer_outcomes_decisions_and_dead_letters(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The "decision context" snippets, against a fleet with a watchdog-terminated episode,
    a crashed one, one truncated by its runtime and one still running."""
    from test_archive_context import archive as archive_context

    from trajbus.archive.synth import context_fleet

    fleet_ = context_fleet()
    archive_context(LocalStore(tmp_path / ".trajbus" / "archive"), tmp_path, fleet_)
    monkeypatch.chdir(tmp_path)
    ns: dict[str, Any] = {}
    exec(blocks("python")[4], ns)
    assert ns["ending"] == ("terminated", "scheduler", "DONE")
    assert ("watchdog", "watchdog: loop") in ns["deciders"]
    assert ("scheduler", "watchdog: agent loop") in ns["deciders"]
    assert ns["crashed"] == [("sb-crash", "00001", "recycle"), ("sb-trunc", "00000", "runtime")]
    assert sorted(ns["dead"]) == [("sb-crash", "00001", "reorder", "seq_after_end")] * 2

    env = {**os.environ, "TRAJBUS_ARCHIVE__URL": str(tmp_path / ".trajbus" / "archive")}
    outputs = []
    for line in blocks("bash")[1].splitlines():
        cmd = shlex.split(line, comments=True)
        res = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True,
                             timeout=120, check=False)
        assert res.returncode == 0, (line, res.stderr)
        outputs.append(res.stdout)
    assert [row.split("\t") for row in outputs[0].splitlines()[1:]] == [
        ["complete", "", "2"], ["in_progress", "", "1"], ["terminated", "", "1"],
        ["truncated", "recycle", "1"], ["truncated", "runtime", "1"]]
    assert [row.split("\t")[:3] for row in outputs[1].splitlines()[1:]] == [
        ["sb-loop", "", "scheduler"], ["sb-loop", "00000", "watchdog"]]
    ctx = json.loads(outputs[2])
    assert ctx["outcome"]["ending"] == "terminated"
    assert ctx["outcome"]["terminate_decision_id"] == fleet_.endings[("sb-loop", "00000")][2]
