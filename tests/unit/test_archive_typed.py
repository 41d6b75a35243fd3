"""Specification of the archive's typed, documented schema (issue 38, item 5).

* The fields analysts filter on are typed columns (probe ``ok`` / ``latency_ms``, ``dataset``,
  ``content_type``, ``final_seqs``, decisions, alerts, dead letters), and stay in
  ``payload_json``; columns every row has are declared non-null; every column is documented
  (name, type, nullability, meaning) in the reference the README links.
* Objects written before those columns (archive format 2) still read -- ``archive sql``,
  ``ArchiveReader.episode``, compaction merging them with new ones -- with the missing
  columns null, and the decision-context views still answer from ``payload_json``.
* Claim-check references into the archive are stored relative to the archive root, so an
  archive copied elsewhere still resolves them; absolute references (older objects, blobs
  outside the archive) stay readable.
* ``trajbus schemas show KIND`` prints a kind's Avro fields; ``archive sql --help`` lists
  every view a connection has.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

import duckdb
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from support import REPO
from test_archive_context import EVENTS, archive, recs, shell
from test_archive_store import T0, records, shell_for

from trajbus.archive.maintenance import compact
from trajbus.archive.query import ArchiveReader, reassemble_trace
from trajbus.archive.rows import (
    ARCHIVE_SCHEMA,
    DERIVED_FIELDS,
    NON_NULL,
    PROMOTED_FIELDS,
    conform,
    rows_to_table,
    to_row,
)
from trajbus.archive.storage import LocalStore, S3Store, open_store
from trajbus.archive.synth import context_fleet, episode_events
from trajbus.archive.views import VIEWS
from trajbus.archive.writer import ArchiveWriter
from trajbus.bus.settings import Settings
from trajbus.producers.claimcheck import ClaimCheck, blob_key
from trajbus.schemas.models import (
    DecisionKind,
    Drained,
    Envelope,
    EpisodeFinalSeq,
    EpisodeStart,
    Event,
    LifecycleState,
    LivenessProbe,
    SandboxLifecycle,
    SchedulingDecision,
    TraceChunk,
)

TASK = "web-shop"
NEW_COLUMNS = [n for n, _ in PROMOTED_FIELDS + DERIVED_FIELDS]


def hdr(sandbox: str, seq: int, t: int, episode: str | None = None,
        producer: str = "sidecar") -> Envelope:
    return Envelope(event_id=f"{sandbox}-{episode}-{seq}-{producer}", task=TASK,
                    sandbox=sandbox, episode=episode, seq=seq, event_time_ms=t,
                    producer_id=producer)


def lifecycle_stream(sandbox: str, first_seq: int, t0: int) -> list[Event]:
    """Four events of a sandbox's lifecycle stream from ``first_seq``: a probe that
    succeeds, one that times out, a drain report and a state change."""
    s = first_seq
    return [
        LivenessProbe(header=hdr(sandbox, s, t0), probe="tcp", target="10.0.0.7:8080",
                      ok=True, latency_ms=12),
        LivenessProbe(header=hdr(sandbox, s + 1, t0 + 1_000), target="10.0.0.7:8080",
                      ok=False, latency_ms=15_000, error="timeout"),
        Drained(header=hdr(sandbox, s + 2, t0 + 2_000), complete=False, unflushed=2,
                final_seqs=[EpisodeFinalSeq(episode="00000", final_seq=5)]),
        SandboxLifecycle(header=hdr(sandbox, s + 3, t0 + 3_000), state=LifecycleState.DRAINING,
                         reason="probes failed"),
    ]


def every_kind(store: LocalStore, tmp_path: Path) -> dict[str, Any]:
    """Archive the decision-context fleet plus a lifecycle stream with probes and a drain
    report, an episode with a dataset, an environment snapshot and trace chunks (one inline,
    one claim-checked into the archive, one after a reset) and a placement decision."""
    f = context_fleet(TASK, t0_ms=T0)
    f.events += lifecycle_stream("sb-probe", 0, T0 + 5_000)
    ep = episode_events(TASK, "sb-probe", "00000", t0_ms=T0 + 10_000, tool_calls=1)
    start = ep[0]
    assert isinstance(start, EpisodeStart)
    ep[0] = start.model_copy(update={"context": {"dataset": "ds-web", "prompt": "p-17"},
                                     "env_snapshot": "snapshots/web/0017"})
    png = b"\x89PNG" + bytes(range(256)) * 8
    cc = ClaimCheck(url=str(store.root), threshold=0, settings=Settings())
    ref = cc.put(png, content_type="image/png")
    last = ep[-1].header
    ep[-1:] = [
        TraceChunk(header=last.model_copy(update={"seq": last.seq}), file_offset=0,
                   length=len(png), sha256=ref.sha256, blob=ref, content_type="image/png"),
        TraceChunk(header=last.model_copy(update={"seq": last.seq + 1, "event_id": "reset"}),
                   file_offset=0, length=2, sha256="0" * 64, data=b"ok",
                   content_type="text/plain", reset="log rotated"),
    ]
    f.events += ep
    f.decisions.append(SchedulingDecision(
        header=hdr("sb-probe", len(f.decisions), T0 + 4_000, producer="trajbus.scheduler"),
        decision=DecisionKind.PLACE, reason="best fit", node="node-1", request_id="req-9",
        details={"dataset": "ds-web", "affinity": "50"}))
    assert archive(store, tmp_path, f) == []
    return {"png": png, "ref": ref, "fleet": f}


def raw(store: LocalStore, area: str = "events") -> pa.Table:
    """Every row of an area's objects, straight from the files."""
    return pa.concat_tables(conform(pq.read_table(p)) for p in sorted(
        (store.root / area).rglob("*.parquet")))


# -- typed columns ---------------------------------------------------------------------------
def test_the_fields_analysts_filter_on_are_typed_columns_and_stay_in_payload_json(
        tmp_path: Path) -> None:
    store = LocalStore(tmp_path / "archive")
    every_kind(store, tmp_path)
    glob = f"{store.root}/events/**/*.parquet"
    q = duckdb.connect()

    def sql(query: str) -> list[tuple[Any, ...]]:
        return q.execute(query.replace("EVENTS", f"read_parquet('{glob}')")).fetchall()

    assert sql("SELECT ok, latency_ms, error, probe, target, typeof(ok), typeof(latency_ms) "
               "FROM EVENTS WHERE kind = 'LivenessProbe' ORDER BY seq") == [
        (True, 12, None, "tcp", "10.0.0.7:8080", "BOOLEAN", "BIGINT"),
        (False, 15_000, "timeout", "tcp", "10.0.0.7:8080", "BOOLEAN", "BIGINT")]
    assert sql("SELECT final_seqs[1].episode, final_seqs[1].final_seq, complete, unflushed "
               "FROM EVENTS WHERE kind = 'Drained' AND sandbox = 'sb-probe'") == [
        ("00000", 5, False, 2)]
    assert sql("SELECT dataset, env_snapshot FROM EVENTS WHERE kind = 'EpisodeStart' "
               "AND sandbox = 'sb-probe'") == [("ds-web", "snapshots/web/0017")]
    assert sql("SELECT content_type, reset FROM EVENTS WHERE kind = 'TraceChunk' AND "
               "sandbox = 'sb-probe' ORDER BY seq") == [("image/png", None),
                                                        ("text/plain", "log rotated")]
    assert sql("SELECT decision, decision_event_id IS NOT NULL FROM EVENTS "
               "WHERE kind = 'DecisionAck'") == [("TERMINATE", True)]
    dq = q.execute(f"SELECT decision, request_id, dataset, typeof(cause_event_ids) FROM "
                   f"read_parquet('{store.root}/decisions/**/*.parquet') "
                   "WHERE sandbox = 'sb-probe'").fetchall()
    assert dq == [("PLACE", "req-9", "ds-web", "VARCHAR[]")]

    # every promoted column is filled somewhere, and equals the field kept in payload_json
    rows = [r for area in ("events", "decisions", "alerts", "dead_letters")
            for r in raw(store, area).to_pylist()]
    assert {n for n in NEW_COLUMNS if any(r[n] is not None for r in rows)} == set(NEW_COLUMNS)
    for r in rows:
        payload = json.loads(r["payload_json"] or "{}")
        for name, _ in PROMOTED_FIELDS:
            if name in payload:
                assert r[name] == payload[name], (r["kind"], name)
            else:
                assert r[name] is None, (r["kind"], name)


def test_columns_every_row_has_are_declared_non_null(tmp_path: Path) -> None:
    store = LocalStore(tmp_path / "archive")
    every_kind(store, tmp_path)
    for path in (store.root / "events").rglob("*.parquet"):
        schema = pq.read_schema(path)
        assert {f.name for f in schema if not f.nullable} == set(NON_NULL)
        assert schema.metadata[b"trajbus.archive.schema"] == b"3"
    assert {"event_id", "task", "sandbox", "seq", "event_time", "kind", "kafka_offset"} \
        <= NON_NULL and "episode" not in NON_NULL and "policy_version" not in NON_NULL
    # a row without one of them cannot be written
    e = lifecycle_stream("sb-x", 0, T0)[0]
    row = to_row(e.KIND, e.to_record(), EVENTS, 0, 0)  # no event_digest
    with pytest.raises((ValueError, pa.ArrowInvalid), match="event_digest"):
        ArchiveWriter(LocalStore(tmp_path / "other")).write_batch(
            rows_to_table([row]), EVENTS, 0, 0, 0)


def _doc_type(t: pa.DataType) -> str:
    return (str(t).replace("timestamp[ms, tz=UTC]", "timestamp(ms, UTC)")
            .replace("list<item: ", "list<"))


def test_every_column_is_documented_with_its_type_and_nullability() -> None:
    """archive/README.md's column table: one row per column (or per group of columns of one
    type), with the type as pyarrow writes it and whether it can be null."""
    text = (REPO / "archive" / "README.md").read_text()
    table = text[text.index("## Columns"):text.index("`episodes` (view")]
    documented: dict[str, tuple[str, str]] = {}
    for line in table.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) != 4 or not cells[0].startswith("`"):
            continue
        for name in re.findall(r"`([a-z_0-9]+)`", cells[0]):
            documented[name] = (cells[1].strip("`"), cells[2])
    for f in ARCHIVE_SCHEMA:
        assert f.name in documented, f"column {f.name} is not documented"
        assert documented[f.name] == (_doc_type(f.type), "yes" if f.nullable else "no"), f.name
    section = (REPO / "README.md").read_text().split("## For the data team", 1)[1]
    assert "](archive/README.md#columns)" in section.split("\n## ", 1)[0]


# -- older objects ---------------------------------------------------------------------------
FORMAT2 = pa.schema([pa.field(f.name, f.type, nullable=f.name != "kind")
                     for f in ARCHIVE_SCHEMA if f.name not in NEW_COLUMNS],
                    metadata={b"trajbus.archive.schema": b"2"})


def downgrade(root: Path) -> int:
    """Rewrite every data object under ``root`` as archive format 2 wrote it (no promoted
    columns, every column but ``kind`` nullable), row group by row group (the index names
    row groups). Returns the number of objects rewritten."""
    n = 0
    for area in ("events", "decisions", "alerts", "dead_letters"):
        for path in (root / area).rglob("*.parquet"):
            pf = pq.ParquetFile(path)
            groups = [pf.read_row_group(i).select(FORMAT2.names).cast(FORMAT2)
                      for i in range(pf.num_row_groups)]
            pf.close()
            with pq.ParquetWriter(path, FORMAT2) as w:
                for g in groups:
                    w.write_table(g)
            n += 1
    return n


def test_objects_of_the_previous_format_read_beside_new_ones(tmp_path: Path) -> None:
    """Objects written before the promoted columns read beside objects of the current
    format: their promoted columns are null (``payload_json`` has the fields), the
    decision-context views read those fields from ``payload_json``, and compaction rewrites
    them with the columns filled."""
    store = LocalStore(tmp_path / "archive")
    old_f = context_fleet(TASK, t0_ms=T0)
    old_f.events += lifecycle_stream("sb-probe", 0, T0 + 5_000)
    assert archive(store, tmp_path, old_f) == []
    assert downgrade(store.root) >= 4
    assert "ok" not in pq.read_schema(next((store.root / "events").rglob("*.parquet"))).names
    probes = "SELECT ok, latency_ms, error FROM events WHERE kind = 'LivenessProbe' ORDER BY seq"
    typed = [(True, 12, None), (False, 15_000, "timeout")]
    untyped = [(None, None, None)] * 2

    # only old objects: every view answers, the promoted columns exist (null)
    con = ArchiveReader(store).connect()
    assert con.execute(probes).fetchall() == untyped
    for view in VIEWS:
        con.execute(f"SELECT * FROM {view}").fetchall()
    assert con.execute("SELECT count(*) FROM decisions WHERE decision IS NULL").fetchone() \
        == (0,)
    assert con.execute("SELECT final_seqs FROM lifecycle WHERE sandbox = 'sb-crash' AND "
                       "kind = 'Drained'").fetchall() == [([{"episode": "00001",
                                                              "final_seq": 4}],)]
    assert con.execute("SELECT count(*) FROM alerts WHERE alert = 'LOOP' AND "
                       "repeat_count = 25").fetchone() == (1,)

    # new objects of the same hour and sandbox stream, written after the upgrade
    sh = shell(store, tmp_path)
    step = sh.process(recs(EVENTS, lifecycle_stream("sb-probe", 4, T0 + 9_000),
                           start=len(old_f.events)))
    sh.committed(step.batches + sh.flush_all().batches)
    sh.close()
    reader = ArchiveReader(store)
    con = reader.connect()
    assert con.execute(probes).fetchall() == untyped + typed
    assert con.execute("SELECT count(*), count(final_seqs), count(*) FILTER (WHERE sandbox = "
                       "'sb-probe') FROM lifecycle WHERE kind = 'Drained'").fetchone() == (5, 5, 2)
    stream = reader.episode(TASK, "sb-probe", None)
    assert stream.column("seq").to_pylist() == list(range(8))
    assert stream.column("ok").to_pylist() == [None] * 4 + [True, False, None, None]
    assert stream.schema.field("ok").type == pa.bool_()
    assert reader.episode(TASK, "sb-probe", None, columns=["seq", "latency_ms"]
                          ).column("latency_ms").to_pylist() == [None] * 4 + [12, 15_000,
                                                                             None, None]

    # compaction merges old and new objects of the hour into one of the current format
    n_before = len(list((store.root / "events").rglob("*.parquet")))
    rep = compact(store, min_age_ms=0, grace_ms=0, now_ms=T0 + 86_400_000)
    assert rep.outputs and len(list((store.root / "events").rglob("*.parquet"))) < n_before
    for key in rep.outputs:
        assert pq.read_schema(store.duckdb_path(key)).metadata[b"trajbus.archive.schema"] \
            == b"3"
    merged = raw(store)
    assert merged.filter(pa.compute.equal(merged["kind"], "LivenessProbe")
                         ).column("ok").to_pylist() == [True, False, True, False]
    filled = {"Drained": "final_seqs", "SchedulingDecision": "decision",
              "WatchdogAlert": "alert", "DecisionAck": "decision_event_id"}
    seen = set()
    for key in rep.outputs:  # every merged object: its old rows' columns are filled
        t = pq.read_table(store.duckdb_path(key))
        for kind, col in filled.items():
            rows = t.filter(pa.compute.equal(t["kind"], kind))
            assert rows.column(col).null_count == 0, (key, kind)
            if rows.num_rows:
                seen.add(kind)
    assert seen >= {"Drained", "SchedulingDecision"}
    after = ArchiveReader(store)
    assert after.episode(TASK, "sb-probe", None).column("ok").to_pylist() == [
        True, False, None, None] * 2
    con = after.connect()
    assert con.execute(probes).fetchall() == typed * 2
    assert con.execute("SELECT count(*) FROM decisions WHERE decision IS NULL").fetchone() \
        == (0,)


# -- blob references -------------------------------------------------------------------------
def test_claim_check_references_are_relative_to_the_archive_root(tmp_path: Path) -> None:
    store = LocalStore(tmp_path / "archive")
    made = every_kind(store, tmp_path)
    png, ref = made["png"], made["ref"]
    assert ref.uri.startswith("file:///")  # on Kafka: absolute, for any consumer
    key = blob_key(ref.sha256)
    assert key.startswith("blobs/sha256/") and (store.root / key).is_file()

    t = raw(store)
    chunk = [r for r in t.to_pylist() if r["blob_uri"] is not None]
    assert [r["blob_uri"] for r in chunk] == [key]
    assert json.loads(chunk[0]["payload_json"])["blob"]["uri"] == key
    for col in t.columns:  # no absolute path anywhere in the stored rows
        if pa.types.is_string(col.type):
            assert not any("file://" in v or str(tmp_path) in v
                           for v in col.to_pylist() if v), col

    # the archive moved (copied to another machine, synced to another bucket): still reads
    moved = tmp_path / "elsewhere" / "archive"
    shutil.copytree(store.root, moved)
    shutil.rmtree(store.root)
    reader = ArchiveReader(LocalStore(moved, create=False))
    ep = reader.episode(TASK, "sb-probe", "00000")
    row = next(r for r in ep.to_pylist() if r["blob_uri"])
    assert reader.fetch_blob(row) == png
    data, missing = reassemble_trace(ep, reader.fetch_blob)
    assert missing == [] and data == b"ok"  # the reset chunk restarted the file after the png
    rows = [r for r in ep.to_pylist() if r["seq"] < ep.column("seq").to_pylist()[-1]]
    assert reassemble_trace(rows, reader.fetch_blob) == (png, [])

    out = tmp_path / "trace.bin"
    res = subprocess.run([sys.executable, "-m", "trajbus", "archive", "--url", str(moved),
                          "episode", "--task", TASK, "--sandbox", "sb-probe", "--episode",
                          "00000", "--trace-out", str(out)], cwd=REPO, capture_output=True,
                         text=True, timeout=120, check=False)
    assert res.returncode == 0, res.stderr
    assert out.read_bytes() == b"ok"


def test_absolute_references_stay_readable(tmp_path: Path) -> None:
    """An object written before references were relative holds the blob's absolute URI; a
    blob stored outside the archive keeps its absolute URI. Both read."""
    store = LocalStore(tmp_path / "archive")
    inside = ClaimCheck(url=str(store.root), threshold=0, settings=Settings())
    outside = ClaimCheck(url=str(tmp_path / "blobstore"), threshold=0, settings=Settings())
    a, b = b"inside" * 100, b"outside" * 100
    ra, rb = inside.put(a), outside.put(b)
    evs: list[Event] = [
        TraceChunk(header=hdr("sb-1", i, T0 + i, "00000"), file_offset=off, length=len(d),
                   sha256=r.sha256, blob=r)
        for i, (off, d, r) in enumerate(((0, a, ra), (len(a), b, rb)))]
    # the old archiver: rows without a blob root, i.e. absolute references
    old_rows = [to_row(e.KIND, e.to_record(), EVENTS, 0, i) | {"event_digest": i}
                for i, e in enumerate(evs)]
    assert [r["blob_uri"] for r in old_rows] == [ra.uri, rb.uri]
    ArchiveWriter(store).write_batch(rows_to_table(old_rows), EVENTS, 0, 0, 1)
    reader = ArchiveReader(store)
    ep = reader.episode(TASK, "sb-1", "00000")
    assert reassemble_trace(ep, reader.fetch_blob) == (a + b, [])

    # the current archiver: the reference into the archive is relative, the other absolute
    sh = shell_for(store, tmp_path / "new")
    more = [e.model_copy(update={"header": e.header.model_copy(update={"sandbox": "sb-2"})})
            for e in evs]
    step = sh.process(records(more))
    sh.committed(step.batches + sh.flush_all().batches)
    ep2 = ArchiveReader(store).episode(TASK, "sb-2", "00000")
    assert ep2.column("blob_uri").to_pylist() == [blob_key(ra.sha256), rb.uri]
    assert reassemble_trace(ep2, reader.fetch_blob) == (a + b, [])


def test_references_into_an_s3_archive_are_relative_too(s3_server: str,
                                                        tmp_path: Path) -> None:
    import boto3

    bucket = f"typed-{uuid.uuid4().hex[:8]}"
    boto3.client("s3", endpoint_url=s3_server).create_bucket(Bucket=bucket)
    s3_store = open_store(f"s3://{bucket}/trajbus/archive", s3_server)
    assert isinstance(s3_store, S3Store)
    cc = ClaimCheck(url=s3_store.url, endpoint_url=s3_store.endpoint_url, threshold=0,
                    settings=Settings())
    shot = b"\x89PNG" * 500
    ref = cc.put(shot, content_type="image/png")
    key = blob_key(ref.sha256)
    assert ref.uri == f"{s3_store.url}/{key}"  # on Kafka: s3://bucket/prefix/blobs/...
    chunk = TraceChunk(header=hdr("sb-s3", 0, T0, "00000"), file_offset=0, length=len(shot),
                       sha256=ref.sha256, blob=ref, content_type="image/png")
    sh = shell_for(s3_store, tmp_path)
    step = sh.process(records([chunk]))
    sh.committed(step.batches + sh.flush_all().batches)
    reader = ArchiveReader(s3_store)
    ep = reader.episode(TASK, "sb-s3", "00000")
    assert ep.column("blob_uri").to_pylist() == [key]
    assert reassemble_trace(ep, reader.fetch_blob) == (shot, [])
    assert reader.connect().execute("SELECT content_type, blob_uri FROM events").fetchall() \
        == [("image/png", key)]


# -- schemas show, help texts ----------------------------------------------------------------
def trajbus(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "trajbus", *argv], cwd=REPO,
                          capture_output=True, text=True, timeout=60, check=False,
                          env={**os.environ, "TRAJBUS_KAFKA__BOOTSTRAP_SERVERS": "127.0.0.1:9"})


def test_schemas_show_prints_a_kinds_avro_fields() -> None:
    res = trajbus("schemas", "show", "LivenessProbe")
    assert res.returncode == 0, res.stderr
    lines = res.stdout.splitlines()
    assert lines[0].startswith("trajbus.events.LivenessProbe  fingerprint ")
    assert "liveness probe" in lines[1]

    def field(name: str) -> list[str]:
        [line] = [ln for ln in lines if ln.split(" ", 1)[0] == name]
        return re.split(r"\s{2,}", line.strip())

    assert field("ok") == ["ok", "boolean", "True when the probe succeeded within its timeout."]
    assert field("latency_ms")[:3] == ["latency_ms", "long", "0"]
    assert field("error")[:3] == ["error", "null | string", "null"]
    assert field("probe")[:3] == ["probe", "string", '"tcp"']
    assert field("header.seq")[:2] == ["header.seq", "long"]
    assert "starting at 0" in field("header.seq")[-1]  # the field's doc
    assert {ln.split(" ", 1)[0] for ln in lines[3:]} == {
        "field", "probe", "target", "ok", "latency_ms", "error",
        *(f"header.{n}" for n in ("event_id", "task", "sandbox", "episode", "seq",
                                  "event_time_ms", "producer_id", "policy_version"))}

    drained = trajbus("schemas", "show", "trajbus.events.Drained").stdout
    assert "array<record EpisodeFinalSeq {episode: string, final_seq: long}>" in drained
    doc = json.loads(trajbus("schemas", "show", "tracechunk", "--json").stdout)
    assert doc["name"] == "TraceChunk" and doc["fields"][0]["type"]["name"] == "Envelope"


def test_an_unknown_kind_is_an_error_listing_the_kinds() -> None:
    res = trajbus("schemas", "show", "ProbeResult")
    assert res.returncode != 0 and res.stdout == ""
    assert "unknown event kind 'ProbeResult'" in res.stderr
    for kind in ("LivenessProbe", "TraceChunk", "Drained", "SchedulingDecision", "DeadLetter"):
        assert kind in res.stderr
    assert "Traceback" not in res.stderr
    helps = " ".join((trajbus("schemas", "--help").stdout
                      + trajbus("schemas", "show", "--help").stdout).split())
    assert "schemas show LivenessProbe" in helps and "unknown kind is an error" in helps
    assert trajbus("schemas").stdout.count("trajbus.") == 18  # without an action: the list


def test_archive_sql_help_lists_every_view_a_connection_has(tmp_path: Path) -> None:
    store = LocalStore(tmp_path / "archive")
    archive(store, tmp_path, context_fleet(TASK, t0_ms=T0))
    con = ArchiveReader(store).connect()
    registered = {name for (name,) in con.execute(
        "SELECT view_name FROM duckdb_views() WHERE NOT internal AND view_name NOT LIKE '\\_%' "
        "ESCAPE '\\'").fetchall()}
    assert registered == set(VIEWS)
    for view in VIEWS:  # each answers (conflicts: none in this fleet)
        n = con.execute(f"SELECT count(*) FROM {view}").fetchone()
        assert n is not None and (n[0] > 0 or view == "conflicts"), view
    help_text = trajbus("archive", "sql", "--help").stdout.split("positional arguments")[0]
    listed = set(re.findall(r"^  ([a-z_]+)\s{2,}", help_text, flags=re.M))
    assert listed == registered, help_text
    assert {"conflicts", "episodes", "decision_acks", "lifecycle"} <= listed


# -- the README's snippets -------------------------------------------------------------------
def test_readme_typed_column_snippets_run_verbatim_over_old_and_new_objects(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The data-team section's typed-column commands and its raw readers over an archive
    holding objects of format 2 (before the typed columns) and of format 3."""
    import shlex

    from test_archive_readme import blocks

    store = LocalStore(tmp_path / ".trajbus" / "archive")
    old_f = context_fleet(TASK, t0_ms=T0)
    old_f.events += lifecycle_stream("sb-old", 0, T0 + 5_000)
    assert archive(store, tmp_path, old_f) == []
    downgrade(store.root)
    every_kind(store, tmp_path)  # sb-probe: typed; the fleet again: duplicates, not written

    env = {**os.environ, "TRAJBUS_ARCHIVE__URL": str(store.root)}
    outputs = []
    for line in blocks("bash")[2].splitlines():
        res = subprocess.run(shlex.split(line, comments=True), cwd=REPO, env=env,
                             capture_output=True, text=True, timeout=120, check=False)
        assert res.returncode == 0, (line, res.stderr)
        outputs.append(res.stdout)
    probes = [row.split("\t") for row in outputs[0].splitlines()[1:]]
    assert probes == [["sb-old", "0", ""], ["sb-probe", "1", "15000"]]  # sb-old: format 2
    datasets = dict(row.split("\t") for row in outputs[1].splitlines()[1:])
    assert datasets["ds-web"] == "1"
    assert re.search(r"^latency_ms +long +0 +How long", outputs[2], flags=re.M), outputs[2]

    monkeypatch.chdir(tmp_path)
    ns: dict[str, Any] = {}
    exec(blocks("python")[5], ns)
    assert ns["probes"] == [("sb-old", None, None), ("sb-old", None, None),
                            ("sb-probe", False, 15_000), ("sb-probe", True, 12)]
    old_json = duckdb.sql(f"SELECT payload_json->>'latency_ms' FROM read_parquet('{store.root}"
                          "/events/**/*.parquet', union_by_name=true) WHERE sandbox = 'sb-old' "
                          "AND kind = 'LivenessProbe' ORDER BY seq").fetchall()
    assert old_json == [("12",), ("15000",)]  # the fields are in payload_json
    assert ns["failed"]["sandbox"].to_list() == ["sb-probe"]
    assert ns["failed"]["latency_ms"].to_list() == [15_000]
    assert ns["failed_too"]["sandbox"].to_list() == ["sb-probe"]
