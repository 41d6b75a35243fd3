"""Synthetic archive data for tests, demos and the benchmark (deterministic, no I/O).

* :func:`episode_events` builds real event models (EpisodeStart, ToolCall/ToolResult pairs,
  TraceChunks, EpisodeEnd) for one episode, seq 0..n-1.
* :func:`synthetic_table` builds a large :data:`ARCHIVE_SCHEMA` table with vectorised pyarrow
  compute (tens of millions of rows in seconds): ``sandboxes`` sandboxes spread over ``tasks``
  tasks, each running consecutive episodes of ``events_per_episode`` events.
"""

from __future__ import annotations

import hashlib

import pyarrow as pa
import pyarrow.compute as pc

from trajbus.archive.rows import ARCHIVE_SCHEMA, with_event_time
from trajbus.schemas.models import (
    Envelope,
    EpisodeEnd,
    EpisodeOutcome,
    EpisodeStart,
    Event,
    ToolCall,
    ToolResult,
    ToolStatus,
    TraceChunk,
)


def episode_events(task: str, sandbox: str, episode: str, *, tool_calls: int = 3,
                   t0_ms: int = 1_714_557_600_000, step_ms: int = 1_000,
                   trace: bytes = b"", chunk: int = 64,
                   outcome: EpisodeOutcome = EpisodeOutcome.TERMINAL) -> list[Event]:
    """One whole episode: start, (call, result) * tool_calls, trace chunks, end."""
    seq = 0
    out: list[Event] = []

    def hdr() -> Envelope:
        nonlocal seq
        h = Envelope(event_id=hashlib.sha1(f"{sandbox}/{episode}/{seq}".encode()).hexdigest(),
                     task=task, sandbox=sandbox, episode=episode, seq=seq,
                     event_time_ms=t0_ms + seq * step_ms, producer_id="synth")
        seq += 1
        return h

    out.append(EpisodeStart(header=hdr(), context={"prompt": "p"}))
    for i in range(tool_calls):
        out.append(ToolCall(header=hdr(), call_id=f"c{i}", tool="browser.click",
                            args_hash=f"a{i % 2}", args_summary=f"click #{i}"))
        out.append(ToolResult(header=hdr(), call_id=f"c{i}", tool="browser.click",
                              status=ToolStatus.OK, result_hash=f"r{i}", duration_ms=10 + i))
    for off in range(0, len(trace), chunk):
        piece = trace[off:off + chunk]
        out.append(TraceChunk(header=hdr(), file_offset=off, length=len(piece),
                              sha256=hashlib.sha256(piece).hexdigest(), data=piece))
    out.append(EpisodeEnd(header=hdr(), outcome=outcome))
    return out


KINDS = ["EpisodeStart", "ToolCall", "ToolResult", "TraceChunk", "EpisodeEnd"]


def synthetic_table(n_events: int, *, sandboxes: int = 1_000, tasks: int = 10,
                    events_per_episode: int = 200, t0_ms: int = 1_714_557_600_000,
                    span_ms: int = 3_600_000, data_bytes: int = 0,
                    topic: str = "trajbus.sandbox.events", partitions: int = 6,
                    start: int = 0) -> pa.Table:
    """Rows ``start .. start+n_events-1`` of a simulated fleet, in arrival order: event ``i``
    belongs to sandbox ``i % sandboxes`` and is that sandbox's ``i // sandboxes``-th event;
    episodes are consecutive runs of ``events_per_episode`` events; time spreads over
    ``span_ms``; trace chunks (every 4th event) carry ``data_bytes`` bytes."""
    i = pa.array(range(start, start + n_events), pa.int64())
    total = max(start + n_events, 1)
    sb_num = _mod(i, sandboxes)
    k = pc.divide(i, sandboxes)  # the sandbox's k-th event
    ep_num = pc.divide(k, events_per_episode)
    seq = pc.subtract(k, pc.multiply(ep_num, events_per_episode))
    task_num = _mod(sb_num, tasks)
    t = pc.add(t0_ms, pc.divide(pc.multiply(i, span_ms), total))
    sandbox = pc.binary_join_element_wise("sb-", pc.cast(sb_num, pa.string()), "")
    task = pc.binary_join_element_wise("task-", pc.cast(task_num, pa.string()), "")
    episode = pc.binary_join_element_wise(
        sandbox, "-ep-", pc.cast(ep_num, pa.string()), "")
    kind_idx = pc.if_else(pc.equal(seq, 0), 0, pc.if_else(
        pc.equal(seq, events_per_episode - 1), 4, pc.add(_mod(seq, 3), 1)))
    kind = pc.take(pa.array(KINDS), kind_idx)
    is_chunk = pc.equal(kind_idx, 3)
    data = None
    if data_bytes:
        blob = pa.scalar(b"x" * data_bytes, pa.binary())
        data = pc.if_else(is_chunk, blob, pa.scalar(None, pa.binary()))
    is_tool = pc.or_(pc.equal(kind_idx, 1), pc.equal(kind_idx, 2))
    null_s = pa.scalar(None, pa.string())
    cols = {
        "event_id": pc.binary_join_element_wise(episode, "/", pc.cast(seq, pa.string()), ""),
        "task": task, "sandbox": sandbox, "episode": episode, "seq": seq,
        "event_time_ms": t, "producer_id": pa.nulls(n_events, pa.string()).fill_null("synth"),
        "policy_version": pa.nulls(n_events, pa.int64()), "kind": kind,
        "tool": pc.if_else(is_tool, pa.scalar("browser.click"), null_s),
        "call_id": pc.if_else(is_tool, pc.cast(pc.divide(seq, 3), pa.string()), null_s),
        "status": pc.if_else(pc.equal(kind_idx, 2), pa.scalar("OK"), null_s),
        "outcome": pc.if_else(pc.equal(kind_idx, 4), pa.scalar("TERMINAL"), null_s),
        "kafka_topic": pa.nulls(n_events, pa.string()).fill_null(topic),
        "kafka_partition": pc.cast(_mod(sb_num, partitions), pa.int32()),
        "kafka_offset": pc.divide(i, partitions),
    }
    if data is not None:
        cols["data"] = data
    arrays = []
    for f in ARCHIVE_SCHEMA:
        a = cols.get(f.name)
        arrays.append(pa.nulls(n_events, f.type) if a is None else pc.cast(a, f.type))
    return with_event_time(pa.Table.from_arrays(arrays, schema=ARCHIVE_SCHEMA))


def _mod(a: pa.Array, m: int) -> pa.Array:
    return pc.subtract(a, pc.multiply(pc.divide(a, m), m))
