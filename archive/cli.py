"""``trajbus archive ...``: run the archiver, read episodes and their decision context, SQL,
compaction, retention.

The lead wires :func:`register` into the main CLI::

    sub = parser.add_subparsers(...)
    trajbus.archive.cli.register(sub)
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import datetime
import json
import signal
import sys
import textwrap
import time
from typing import Any

from trajbus.archive import layout
from trajbus.bus.cliargs import add_command, add_flags, add_target

ARCHIVE_HELP = """\
The Parquet archive of every sandbox event and trace chunk, and of the decision context:
scheduling decisions (the scheduler's and the watchdog's), watchdog alerts, dead letters.

Layout (local directory or s3://bucket/prefix, set TRAJBUS_ARCHIVE__URL):
  events/date=YYYY-MM-DD/hour=HH/task=T/<topic>-<partition>-<first>-<last>-hHH.parquet
  index/date=YYYY-MM-DD/task=T/<same name>   one row per (task, sandbox, episode, object)
  decisions/, alerts/, dead_letters/ (same layout), with decisions_index/, alerts_index/, ...
  conflicts/ (same layout)                   conflicting copies, never in events/
  blobs/sha256/ab/cd/<sha256>                claim-check blobs; blob_uri is relative to here
Rows are sorted by (sandbox, episode, seq) inside each object. Every kind of event shares one
schema: header columns (non-null), typed columns analysts filter on (tool, status, state,
outcome, ok, latency_ms, content_type, final_seqs, dataset, decision, alert, ...),
payload_json with the record's fields, data for trace chunk bytes, and the Kafka source
position; each column: archive/README.md, a kind's fields: `trajbus schemas show KIND`.
`archive run` writes a batch once its first event is 30 s old in the log's time
(TRAJBUS_ARCHIVE__FLUSH_AFTER_MS): an acknowledged event is queryable about 30 s later;
`archive compact` merges the small objects. Reads of a location that holds no archive (no
events/, index/ or _trajbus_archive.json) fail with exit 2 and create nothing.

Examples:
  trajbus archive run --until-idle
  trajbus archive episode --task web --sandbox sb-17 --episode ep-3 --trace-out ep3.trace
  trajbus archive sql "SELECT tool, count(*) FROM events WHERE task='web' GROUP BY tool"
  trajbus archive sql "SELECT * FROM episodes WHERE completeness <> 'complete'"
  trajbus archive sql "SELECT ending, truncated_by, count(*) FROM episodes GROUP BY ALL"
  trajbus archive sql "SELECT sandbox, max(latency_ms) FROM events WHERE NOT ok GROUP BY 1"
  trajbus archive context --task web --sandbox sb-17 --episode ep-3
  trajbus archive files > events.txt       # the live objects: exact during compaction
  trajbus archive compact --dry-run
  trajbus archive retention --days 90 --dry-run
"""


def _sql_help() -> str:
    """``archive sql --help``: every view (``views.VIEWS``) and where the columns are
    described."""
    from trajbus.archive.views import VIEWS

    lines = ["Run one SQL query with DuckDB over the archive's live objects (a consistent",
             "snapshot, even while compaction runs). Views:", ""]
    for name, what in VIEWS.items():
        lines += textwrap.wrap(what, 88, initial_indent=f"  {name:<16} ",
                               subsequent_indent=" " * 19)
    lines += ["", *textwrap.wrap(
        'Columns: `trajbus archive sql "DESCRIBE events"`; what each means (type, '
        "nullability): the column reference linked from the README's data-team section, "
        "archive/README.md. Filter on task, date, sandbox and episode to let row-group "
        "statistics prune.", 90)]
    return "\n".join(lines)


def register(subparsers: Any) -> argparse.ArgumentParser:
    """Add the ``archive`` command (and its subcommands) to an argparse subparsers object."""
    p: argparse.ArgumentParser = subparsers.add_parser(
        "archive", help="the Parquet archive: run the archiver, query, compact, retention",
        description=ARCHIVE_HELP, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", help="archive location (default: TRAJBUS_ARCHIVE__URL, "
                   "'.trajbus/archive'); a directory or s3://bucket/prefix")
    p.add_argument("--endpoint-url", help="S3 endpoint for non-AWS stores (MinIO, moto); "
                   "default TRAJBUS_ARCHIVE__S3_ENDPOINT_URL")
    sub = p.add_subparsers(dest="archive_cmd", required=True, metavar="COMMAND")

    r = add_command(sub, "run", _cmd_run, key="archive_func",
                    help="consume the raw event topics and the decision context into the archive")
    r.add_argument("--until-idle", "--once", action="store_true", dest="until_idle",
                   help="stop once caught up with the end offsets seen at start (demo, tests)")
    r.add_argument("--group", help="consumer group (default: one per destination, derived from "
                   "the archive URL: '<prefix>.archiver.s3.<bucket>.<path>' or "
                   "'<prefix>.archiver.local.<dir>-<hash>')")
    from trajbus.bus.ops import add_ops_arguments

    add_ops_arguments(r)
    r.add_argument("-v", "--verbose", action="store_true", help="log progress")

    e = add_command(sub, "episode", _cmd_episode, key="archive_func",
                    help="print one episode's events in sequence order")
    add_target(e, task="the episode's task",
               episode="episode id; omit for the sandbox's lifecycle stream")
    add_flags(e, json="one JSON object per line (bytes as base64) instead of a table")
    e.add_argument("--trace-out", metavar="FILE", help="also reassemble the episode's trace "
                   "file from its TraceChunk events into FILE (chunks stored as claim-check "
                   "blobs are fetched and verified against their sha256)")
    add_flags(e, no_blobs="with --trace-out: write the inline chunks only, listing the "
              "claim-check blobs left out")

    s = add_command(sub, "sql", _cmd_sql, key="archive_func",
                    help="run SQL with DuckDB over the archive", description=_sql_help())
    s.add_argument("query", help='e.g. "SELECT kind, count(*) FROM events GROUP BY kind"')
    add_flags(s, json="JSON lines output")

    ep = add_command(sub, "episodes", _cmd_episodes, key="archive_func",
                     help="the episode table: one row per episode")
    ep.add_argument("--task", help="only this task")
    ep.add_argument("--out", metavar="FILE", help="write the table to this Parquet file")
    add_flags(ep, publish="write it to episodes/episodes.parquet in the archive")

    x = add_command(sub, "context", _cmd_context, key="archive_func",
                    help="one episode's decision context: outcome, decisions, alerts, dead "
                    "letters, acks, lifecycle")
    add_target(x, task="the episode's task", episode="episode id; omit for the whole sandbox")

    c = add_command(sub, "compact", _cmd_compact, key="archive_func",
                    help="merge small objects; swap them in atomically")
    c.add_argument("--target-mb", type=float, default=None,
                   help="output object size (default: TRAJBUS_ARCHIVE__TARGET_OBJECT_BYTES)")
    c.add_argument("--min-age-hours", type=float, default=2.0,
                   help="leave hours younger than this alone (default 2)")
    c.add_argument("--grace-seconds", type=float, default=3600.0,
                   help="delete replaced objects only this long after the switch (default "
                   "3600): a snapshot taken before the switch stays readable that long")
    c.add_argument("--task", help="only this task")
    add_flags(c, dry_run="report, change nothing")

    f = add_command(sub, "files", _cmd_files, key="archive_func",
                    help="the live objects to read: a consistent snapshot")
    f.add_argument("--area", default="events",
                   choices=[*layout.DATA_AREAS, "conflicts", *layout.INDEX_AREAS],
                   help="events (default), decisions, alerts, dead_letters, conflicts, or an "
                   "index area (index, decisions_index, ...)")
    add_flags(f, json="one JSON object: generation, base, files")

    t = add_command(sub, "retention", _cmd_retention, key="archive_func",
                    help="delete archive partitions older than N days")
    t.add_argument("--days", type=int, default=None,
                   help="keep this many days (default TRAJBUS_ARCHIVE__RETENTION_DAYS)")
    add_flags(t, dry_run="list what would be deleted")
    p.set_defaults(func=_dispatch)
    return p


def _dispatch(args: argparse.Namespace) -> int:
    rc: int = args.archive_func(args)
    return rc


def _settings() -> Any:
    from trajbus.bus.settings import get_settings

    return get_settings()


def _store(args: argparse.Namespace, *, ride_out_outages: bool = False,
           existing: bool = True) -> Any:
    """The archive's store. Long-running writers (run, compact, retention) ride out S3
    outages of up to TRAJBUS_ARCHIVE__STORE_RETRY_S; interactive queries fail at once.
    ``existing`` (every command but ``run``): the location must hold an archive -- a wrong
    path or prefix is an error (exit 2) saying what was expected, and nothing is created."""
    from trajbus.archive.storage import StoreConfigError, open_store, require_archive

    cfg = _settings().archive
    try:
        store = open_store(args.url or cfg.url, args.endpoint_url or cfg.s3_endpoint_url,
                           retry_s=cfg.store_retry_s if ride_out_outages else 0.0,
                           create=not existing)
        return require_archive(store) if existing else store
    except StoreConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        raise SystemExit(2) from exc


def _cmd_run(args: argparse.Namespace) -> int:
    """Consume sandbox events and trace chunks, and the decision context (scheduling
    decisions, watchdog alerts, dead letters) into decisions/, alerts/, dead_letters/ (one
    consumer group per destination, see --group), write Parquet objects + index, and commit
    offsets only after the objects are durable. Stops on SIGINT/SIGTERM after flushing open
    batches."""
    from trajbus.archive.archiver import ArchiverState, run_archiver
    from trajbus.bus.kafka import check_broker
    from trajbus.bus.ops import start_ops

    settings = _settings()
    ops = start_ops(args, settings)
    state = ArchiverState()
    store = _store(args, ride_out_outages=True, existing=False)
    asyncio.run(check_broker(settings.kafka))  # a clear error, not a half-started archiver

    async def main() -> int:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        if ops is not None:  # /readyz asks the archiver, /healthz the loop
            ops.ready = state.ready
            ops.attach()
        stats = await run_archiver(settings, stop, store=store, until_idle=args.until_idle,
                                   group_id=args.group, state=state)
        if stats.note:
            print(stats.note, file=sys.stderr)
        print(json.dumps({"group": stats.group_id, "records": stats.records, "rows": stats.rows,
                          "duplicates": stats.duplicates, "conflicts": stats.conflicts,
                          "dead_letters": stats.dead_letters,
                          "dead_letters_already_on_topic": stats.dead_letters_known,
                          "batches": stats.batches,
                          "objects": stats.objects, "committed": stats.committed}))
        return 0

    return asyncio.run(main())


def _jsonable(v: Any) -> Any:
    """Bytes as base64, timestamps and dates as ISO 8601 (UTC), the rest as is."""
    if isinstance(v, bytes):
        return base64.b64encode(v).decode("ascii")
    if isinstance(v, datetime.date):  # datetime.datetime is a date too
        return v.isoformat()
    return v


def _cmd_episode(args: argparse.Namespace) -> int:
    """Find the episode through the index, read only its row groups, print its events ordered
    by seq (duplicates removed)."""
    from trajbus.archive.query import ArchiveReader, fetch_row_blob, reassemble_trace
    from trajbus.archive.storage import StoreError

    reader = ArchiveReader(_store(args), require=False)
    table = reader.episode(args.task, args.sandbox, args.episode)
    if table.num_rows == 0:
        print(f"no archived events for task={args.task} sandbox={args.sandbox} "
              f"episode={args.episode}", file=sys.stderr)
        return 1
    rows = table.to_pylist()
    if args.json:
        for r in rows:
            print(json.dumps({k: _jsonable(v) for k, v in r.items()}, sort_keys=True))
    else:
        for r in rows:
            detail = r.get("tool") or r.get("state") or r.get("outcome") or ""
            size = f" {len(r['data'])}B" if r.get("data") is not None else ""
            print(f"{r['seq']:>8} {r['event_time_ms']} {r['kind']:<16} {detail}{size}")
    if args.trace_out:
        from trajbus.bus.blobref import BlobIntegrityError

        endpoint = args.endpoint_url or _settings().archive.s3_endpoint_url
        fetch = None if args.no_blobs else (
            lambda row: fetch_row_blob(row, endpoint, reader.store))
        try:
            data, missing = reassemble_trace(rows, fetch)
        except (BlobIntegrityError, StoreError) as exc:
            print(f"error: cannot fetch a claim-check blob of this episode: {exc}. Use "
                  "--no-blobs to write the inline chunks only", file=sys.stderr)
            return 1
        with open(args.trace_out, "wb") as fh:
            fh.write(data)
        print(f"wrote {len(data)} bytes to {args.trace_out}"
              + (f"; {len(missing)} claim-check chunks left out (--no-blobs): {missing[:3]}"
                 if missing else ""), file=sys.stderr)
    return 0


def _cmd_sql(args: argparse.Namespace) -> int:
    import duckdb

    from trajbus.archive.query import ArchiveReader

    reader = ArchiveReader(_store(args), require=False)
    for attempt in range(3):
        # resolves the compaction manifest (again, on a retry)
        con = reader.connect(episodes="episodes" in args.query.lower())
        try:
            cur = con.execute(args.query)
            cols = [d[0] for d in cur.description] if cur.description else []
            rows = cur.fetchall()
            break
        except duckdb.IOException:
            if attempt == 2:  # a file vanished under the query (a compaction): re-resolve
                raise
        except duckdb.Error as exc:  # the user's SQL: DuckDB's own message, and what is there
            print(f"error: {exc}", file=sys.stderr)
            print("hint: the views are 'events' (one row per archived event), 'episodes' "
                  "(one row per episode, with its ending), 'episode_objects' (the per-object "
                  "index), 'conflicts' (conflicting copies), and the decision context: "
                  "'decisions', 'alerts', 'dead_letters', 'decision_acks', 'lifecycle'; "
                  "`trajbus archive sql \"DESCRIBE events\"` lists the columns",
                  file=sys.stderr)
            return 1
    if args.json:
        for row in rows:
            print(json.dumps({c: _jsonable(v) for c, v in zip(cols, row, strict=True)},
                             default=str))
    else:
        print("\t".join(cols))
        for row in rows:
            print("\t".join("" if v is None else str(_jsonable(v)) for v in row))
    return 0


def _cmd_context(args: argparse.Namespace) -> int:
    """How an episode ended and why, from the archive alone: its ending (complete / truncated /
    terminated / in_progress) and truncated_by / terminate_decision_id, the decisions about it
    or its sandbox (with who decided: scheduler or watchdog), the watchdog's alerts, its dead
    letters, the runtime's acknowledgements and the sandbox's lifecycle. Without --episode:
    the sandbox's."""
    from trajbus.archive.query import ArchiveReader

    ctx = ArchiveReader(_store(args)).context(args.task, args.sandbox, args.episode)
    if args.episode is not None and ctx.outcome is None:
        print(f"error: no episode {args.episode!r} of sandbox {args.sandbox!r} in task "
              f"{args.task!r} in the archive", file=sys.stderr)
        return 1
    print(json.dumps(ctx.summary(), indent=2, default=str))
    return 0


def _cmd_episodes(args: argparse.Namespace) -> int:
    """One row per (task, sandbox, episode) across topics and objects: seq range, event count,
    start/end time, outcome, completeness (complete / truncated / has_gaps / in_progress), the
    gap ranges and the ending (complete / truncated / terminated / in_progress, truncated_by,
    terminate_decision_id). Printed as JSON lines, written to --out, or published into the
    archive as plain Parquet (episodes/episodes.parquet) with --publish. `trajbus archive sql`
    has it as the view 'episodes'."""
    import pyarrow.parquet as pq

    from trajbus.archive.episodes import publish_episodes
    from trajbus.archive.query import ArchiveReader

    store = _store(args)
    table = ArchiveReader(store, require=False).episodes(args.task)
    if args.out:
        pq.write_table(table, args.out, compression="zstd")
    if args.publish:
        print(f"published {table.num_rows} episodes to {publish_episodes(store, table)}",
              file=sys.stderr)
    if not args.out and not args.publish:
        for r in table.to_pylist():
            print(json.dumps(r, default=str, sort_keys=True))
    return 0


def _cmd_compact(args: argparse.Namespace) -> int:
    """Merge small objects of each (area, date, hour, task) (events/ and the decision context's
    areas) into large ones, then switch the manifest pointer in one write: readers see the old
    set or the new set, never both. Replaced objects are deleted by a later run once
    --grace-seconds have passed, so a snapshot a reader took before the switch (`trajbus
    archive files`, trajbus.archive.snapshot) stays readable that long."""
    from trajbus.archive.maintenance import compact

    cfg = _settings().archive
    target = int(args.target_mb * 1024 * 1024) if args.target_mb else cfg.target_object_bytes
    store = _store(args, ride_out_outages=True)
    rep = compact(store, target_bytes=target, min_age_ms=int(args.min_age_hours * 3.6e6),
                  grace_ms=int(args.grace_seconds * 1000), row_group_rows=cfg.row_group_rows,
                  dry_run=args.dry_run, task=args.task, now_ms=int(time.time() * 1000))
    print(json.dumps({"generation": rep.generation, "groups": rep.groups,
                      "inputs": len(rep.inputs), "outputs": rep.outputs, "rows": rep.rows,
                      "purged": len(rep.purged), "orphans": len(rep.orphans),
                      "dry_run": rep.dry_run}))
    return 0


def _cmd_files(args: argparse.Namespace) -> int:
    """Print the live objects of an area (one path per line: a local path or s3://bucket/key),
    resolved through the compaction manifest once: exact while `archive compact` and `archive
    run` write (a raw glob over events/ is not). Feed them to any Parquet reader (hive
    partitions: date, hour, task; Spark: basePath = the area's directory, printed by --json).
    They stay readable for the compaction's --grace-seconds after a newer switch."""
    from trajbus.archive.snapshot import describe, snapshot_of

    snap = snapshot_of(_store(args), args.area)
    if args.json:
        print(json.dumps(describe(snap)))
    else:
        for path in snap.files:
            print(path)
    return 0


def _cmd_retention(args: argparse.Namespace) -> int:
    """Delete data and index objects whose date partition is older than N days (UTC). Use
    --dry-run first: it lists and deletes nothing."""
    from trajbus.archive.maintenance import retention

    days = args.days if args.days is not None else _settings().archive.retention_days
    keys = retention(_store(args, ride_out_outages=True), days, dry_run=args.dry_run)
    verb = "would delete" if args.dry_run else "deleted"
    for k in keys:
        print(k)
    print(f"{verb} {len(keys)} objects older than {days} days", file=sys.stderr)
    return 0
