"""The episode table: one row per (task, sandbox, episode), across topics and objects.

Built from the episode index of the live objects (``index/``: one row per task, sandbox,
episode and object, with the object's ``seq_runs``), so it never reads event data:

* ``first_seq``/``last_seq``: lowest and highest archived seq; ``end_seq``: the EpisodeEnd's
  seq (null until it is archived); ``event_count``: archived events (one row per event);
* ``start_time``/``end_time`` (UTC TIMESTAMP, and the ``*_ms`` integers): event-time span;
* ``outcome``: the EpisodeEnd's (``TERMINAL``/``TRUNCATED``), null without one;
* ``gaps``: the seqs missing from ``[0, end_seq]`` (``[0, last_seq]`` without an end) as
  inclusive ranges ``[{first, last}]``; ``missing_seqs`` counts them;
* ``completeness``: ``has_gaps`` if any seq is missing (whatever else is known), else
  ``truncated`` (ended TRUNCATED), ``complete`` (ended TERMINAL) or ``in_progress`` (no
  EpisodeEnd archived yet: still running, or the sandbox was recycled without one);
* ``topics``: the raw topics its events came from; ``objects``: data objects holding them;
* ``ending`` (complete / truncated / terminated / in_progress), ``truncated_by`` (runtime /
  recycle / drain / reclaim / terminate), ``terminate_decision_id``, ``terminate_decided_by``
  (scheduler / watchdog), ``terminate_ack`` (DONE / FAILED): how the episode ended, from the
  decision context and the sandbox's lifecycle (rules: :mod:`~trajbus.archive.context`).
  Without that context (``facts=None``) only the episode's own EpisodeEnd counts.

Sandbox lifecycle streams (``episode`` null) are not episodes and are not in the table.
:func:`publish_episodes` writes it as plain Parquet to ``episodes/episodes.parquet``.
"""

from __future__ import annotations

import io
import time
from collections import defaultdict
from datetime import UTC, datetime
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from trajbus.archive.context import ContextFacts, episode_ending
from trajbus.archive.index import SEQ_RANGE
from trajbus.archive.storage import ObjectStore

EPISODES_KEY = "episodes/episodes.parquet"
TS = pa.timestamp("ms", tz="UTC")

EPISODES_SCHEMA = pa.schema([
    ("task", pa.string()),
    ("sandbox", pa.string()),
    ("episode", pa.string()),
    ("date", pa.date32()),
    ("first_seq", pa.int64()),
    ("last_seq", pa.int64()),
    ("end_seq", pa.int64()),
    ("event_count", pa.int64()),
    ("start_time", TS),
    ("end_time", TS),
    ("start_time_ms", pa.int64()),
    ("end_time_ms", pa.int64()),
    ("outcome", pa.string()),
    ("completeness", pa.string()),
    ("missing_seqs", pa.int64()),
    ("gaps", pa.list_(SEQ_RANGE)),
    ("has_start", pa.bool_()),
    ("has_end", pa.bool_()),
    ("topics", pa.list_(pa.string())),
    ("objects", pa.int32()),
    ("ending", pa.string()),
    ("truncated_by", pa.string()),
    ("terminate_decision_id", pa.string()),
    ("terminate_decided_by", pa.string()),
    ("terminate_ack", pa.string()),
], metadata={b"trajbus.archive.episodes": b"2"})


def merge_runs(runs: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Union of inclusive ranges, as sorted disjoint non-adjacent ranges."""
    out: list[tuple[int, int]] = []
    for lo, hi in sorted(runs):
        if out and lo <= out[-1][1] + 1:
            if hi > out[-1][1]:
                out[-1] = (out[-1][0], hi)
        else:
            out.append((lo, hi))
    return out


def gaps_of(covered: list[tuple[int, int]], upper: int) -> list[tuple[int, int]]:
    """The ranges of ``[0, upper]`` not in ``covered`` (merged, sorted)."""
    gaps: list[tuple[int, int]] = []
    nxt = 0
    for lo, hi in covered:
        if lo > upper:
            break
        if lo > nxt:
            gaps.append((nxt, lo - 1))
        nxt = max(nxt, hi + 1)
    if nxt <= upper:
        gaps.append((nxt, upper))
    return gaps


_AGGREGATE_SQL = """
WITH rows AS (
    SELECT * FROM idx WHERE episode IS NOT NULL
), per_episode AS (
    SELECT task, sandbox, episode,
           min(first_seq) AS first_seq, max(last_seq) AS last_seq, max(end_seq) AS end_seq,
           min(start_time_ms) AS start_ms, max(end_time_ms) AS end_ms,
           max(outcome) AS outcome,
           coalesce(list_sort(list_distinct(
               list(kafka_topic) FILTER (WHERE kafka_topic <> ''))), []) AS topics,
           count(DISTINCT object_key)::INTEGER AS objects
    FROM rows GROUP BY task, sandbox, episode
), runs AS (
    SELECT r.task, r.sandbox, r.episode, u.run.first AS lo, u.run.last AS hi
    FROM rows r, LATERAL (SELECT unnest(r.seq_runs) AS run) u
), flagged AS (
    SELECT *, CASE WHEN lo > max(hi) OVER (
                  PARTITION BY task, sandbox, episode ORDER BY lo, hi
                  ROWS BETWEEN UNBOUNDED PRECEDING AND 1 PRECEDING) + 1
              THEN 1 ELSE 0 END AS starts_island
    FROM runs
), islands AS (
    SELECT task, sandbox, episode, min(lo) AS lo, max(hi) AS hi
    FROM (SELECT *, sum(starts_island) OVER (
                        PARTITION BY task, sandbox, episode ORDER BY lo, hi
                        ROWS UNBOUNDED PRECEDING) AS island FROM flagged)
    GROUP BY task, sandbox, episode, island
), bounded AS (
    SELECT i.*, coalesce(e.end_seq, e.last_seq) AS upper,
           lag(i.hi) OVER (PARTITION BY i.task, i.sandbox, i.episode ORDER BY i.lo) AS prev_hi
    FROM islands i JOIN per_episode e USING (task, sandbox, episode)
), inner_gaps AS (
    SELECT task, sandbox, episode, coalesce(prev_hi, -1) + 1 AS first, lo - 1 AS last
    FROM bounded WHERE lo <= upper AND lo > coalesce(prev_hi, -1) + 1
), covered AS (
    SELECT task, sandbox, episode, sum(hi - lo + 1) AS events,
           max(hi) FILTER (WHERE lo <= upper) AS reach
    FROM bounded GROUP BY task, sandbox, episode
), tail_gaps AS (
    SELECT e.task, e.sandbox, e.episode, coalesce(c.reach, -1) + 1 AS first,
           coalesce(e.end_seq, e.last_seq) AS last
    FROM per_episode e LEFT JOIN covered c USING (task, sandbox, episode)
    WHERE coalesce(c.reach, -1) < coalesce(e.end_seq, e.last_seq)
), gaps AS (
    SELECT task, sandbox, episode,
           list({'first': first, 'last': last} ORDER BY first) AS gaps,
           sum(last - first + 1) AS missing
    FROM (SELECT * FROM inner_gaps UNION ALL SELECT * FROM tail_gaps)
    GROUP BY task, sandbox, episode
)
SELECT e.task, e.sandbox, e.episode, e.first_seq, e.last_seq, e.end_seq,
       coalesce(c.events, 0) AS event_count, e.start_ms, e.end_ms, e.outcome, e.topics,
       e.objects, coalesce(g.gaps, []) AS gaps, coalesce(g.missing, 0) AS missing_seqs,
       CASE WHEN g.missing > 0 THEN 'has_gaps'
            WHEN e.end_seq IS NULL THEN 'in_progress'
            WHEN e.outcome = 'TRUNCATED' THEN 'truncated'
            ELSE 'complete' END AS completeness
FROM per_episode e
LEFT JOIN covered c USING (task, sandbox, episode)
LEFT JOIN gaps g USING (task, sandbox, episode)
ORDER BY e.task, e.sandbox, e.episode
"""


def build_episodes(index: pa.Table, facts: ContextFacts | None = None) -> pa.Table:
    """The episode table from index rows (of live objects only, or events count twice) and
    the decision context (:func:`~trajbus.archive.context.context_facts`).

    The per-episode arithmetic (spans, seq runs merged, gaps) runs in DuckDB over the index;
    only episodes of sandboxes the decision context knows go through
    :func:`~trajbus.archive.context.episode_ending` one by one. Same table as
    :func:`build_episodes_reference`, the rules written out in Python (a test compares
    them)."""
    import duckdb

    facts = facts or ContextFacts()
    con = duckdb.connect()
    try:
        con.register("idx", index.select(_INDEX_COLUMNS))
        agg = con.sql(_AGGREGATE_SQL).to_arrow_table()
    finally:
        con.close()
    n = agg.num_rows
    has_end = pc.is_valid(agg.column("end_seq"))
    outcome = agg.column("outcome")
    truncated_end = pc.fill_null(pc.equal(outcome, "TRUNCATED"), False)
    # without decision context an episode's own EpisodeEnd decides
    endings: dict[str, list[Any]] = {
        "ending": pc.if_else(has_end, pc.if_else(truncated_end, "truncated", "complete"),
                             "in_progress").to_pylist(),
        "truncated_by": pc.if_else(pc.and_(has_end, truncated_end), "runtime",
                                   pa.scalar(None, pa.string())).to_pylist(),
        "terminate_decision_id": [None] * n, "terminate_decided_by": [None] * n,
        "terminate_ack": [None] * n}
    if facts.sandboxes:
        tasks, sandboxes = agg.column("task").to_pylist(), agg.column("sandbox").to_pylist()
        episodes, ends = agg.column("episode").to_pylist(), has_end.to_pylist()
        outcomes = outcome.to_pylist()
        for i in range(n):
            if (tasks[i], sandboxes[i]) in facts.sandboxes:
                ending = episode_ending(facts, tasks[i], sandboxes[i], episodes[i], ends[i],
                                        outcomes[i])
                endings["ending"][i] = ending.ending
                endings["truncated_by"][i] = ending.truncated_by
                endings["terminate_decision_id"][i] = ending.terminate_decision_id
                endings["terminate_decided_by"][i] = ending.terminate_decided_by
                endings["terminate_ack"][i] = ending.terminate_ack
    start = agg.column("start_ms")
    values: dict[str, Any] = {
        "task": agg.column("task"), "sandbox": agg.column("sandbox"),
        "episode": agg.column("episode"),
        "date": pc.cast(pc.cast(start, TS), pa.date32()),
        "first_seq": agg.column("first_seq"), "last_seq": agg.column("last_seq"),
        "end_seq": agg.column("end_seq"), "event_count": agg.column("event_count"),
        "start_time": start, "end_time": agg.column("end_ms"),
        "start_time_ms": start, "end_time_ms": agg.column("end_ms"),
        "outcome": outcome, "completeness": agg.column("completeness"),
        "missing_seqs": agg.column("missing_seqs"), "gaps": agg.column("gaps"),
        "has_start": pc.equal(agg.column("first_seq"), 0), "has_end": has_end,
        "topics": agg.column("topics"), "objects": agg.column("objects"), **endings,
    }
    return pa.table({f.name: _as(values[f.name], f.type) for f in EPISODES_SCHEMA},
                    schema=EPISODES_SCHEMA)


_INDEX_COLUMNS = ["task", "sandbox", "episode", "object_key", "first_seq", "last_seq",
                  "end_seq", "seq_runs", "start_time_ms", "end_time_ms", "outcome",
                  "kafka_topic"]


def _as(values: Any, type_: pa.DataType) -> pa.Array | pa.ChunkedArray:
    if isinstance(values, list):
        return pa.array(values, type_)
    return values.cast(type_)


def build_episodes_reference(index: pa.Table, facts: ContextFacts | None = None) -> pa.Table:
    """:func:`build_episodes`, one episode at a time in Python: the rules as written."""
    facts = facts or ContextFacts()
    cols = ["task", "sandbox", "episode", "object_key", "first_seq", "last_seq", "end_seq",
            "seq_runs", "start_time_ms", "end_time_ms", "outcome", "kafka_topic"]
    groups: dict[tuple[str, str, str], list[dict[str, Any]]] = defaultdict(list)
    for r in index.select(cols).to_pylist():
        if r["episode"] is not None:
            groups[(r["task"], r["sandbox"], r["episode"])].append(r)
    out: dict[str, list[Any]] = {f.name: [] for f in EPISODES_SCHEMA}
    for (task, sandbox, episode), rows in sorted(groups.items()):
        runs = merge_runs([(x["first"], x["last"]) for r in rows for x in r["seq_runs"] or ()])
        ends = [r["end_seq"] for r in rows if r["end_seq"] is not None]
        outcomes = [r["outcome"] for r in rows if r["outcome"] is not None]
        has_end = bool(ends)
        first = min(r["first_seq"] for r in rows)
        last = max(r["last_seq"] for r in rows)
        upper = max(ends) if has_end else last
        gaps = gaps_of(runs, upper)
        if gaps:
            completeness = "has_gaps"
        elif not has_end:
            completeness = "in_progress"
        elif outcomes and max(outcomes) == "TRUNCATED":
            completeness = "truncated"
        else:
            completeness = "complete"
        start = min(r["start_time_ms"] for r in rows)
        end = max(r["end_time_ms"] for r in rows)
        values = {
            "task": task, "sandbox": sandbox, "episode": episode,
            "date": datetime.fromtimestamp(start / 1000, tz=UTC).date(),
            "first_seq": first, "last_seq": last, "end_seq": max(ends) if ends else None,
            "event_count": sum(hi - lo + 1 for lo, hi in runs),
            "start_time": start, "end_time": end, "start_time_ms": start, "end_time_ms": end,
            "outcome": max(outcomes) if outcomes else None, "completeness": completeness,
            "missing_seqs": sum(hi - lo + 1 for lo, hi in gaps),
            "gaps": [{"first": lo, "last": hi} for lo, hi in gaps],
            "has_start": first == 0, "has_end": has_end,
            "topics": sorted({r["kafka_topic"] for r in rows if r["kafka_topic"]}),
            "objects": len({r["object_key"] for r in rows}),
        }
        ending = episode_ending(facts, task, sandbox, episode, has_end, values["outcome"])
        values.update(ending=ending.ending, truncated_by=ending.truncated_by,
                      terminate_decision_id=ending.terminate_decision_id,
                      terminate_decided_by=ending.terminate_decided_by,
                      terminate_ack=ending.terminate_ack)
        for k, v in values.items():
            out[k].append(v)
    return pa.table({f.name: pa.array(out[f.name], f.type) for f in EPISODES_SCHEMA},
                    schema=EPISODES_SCHEMA)


def publish_episodes(store: ObjectStore, table: pa.Table) -> str:
    """Write the episode table as one plain Parquet object (atomic replace); returns its key.
    It is a snapshot: the Parquet metadata ``trajbus.as_of_ms`` says when it was built."""
    buf = io.BytesIO()
    meta = {**(table.schema.metadata or {}), b"trajbus.as_of_ms": str(int(time.time() * 1000))
            .encode()}
    pq.write_table(table.replace_schema_metadata(meta), buf, compression="zstd")
    store.put_bytes(EPISODES_KEY, buf.getvalue())
    return EPISODES_KEY
