"""Synthetic archive data for tests, demos and the benchmark (deterministic, no I/O).

* :func:`episode_events` builds real event models (EpisodeStart, ToolCall/ToolResult pairs,
  TraceChunks, EpisodeEnd) for one episode, seq 0..n-1.
* :func:`synthetic_table` builds a large :data:`ARCHIVE_SCHEMA` table with vectorised pyarrow
  compute (tens of millions of rows in seconds): ``sandboxes`` sandboxes spread over ``tasks``
  tasks, each running consecutive episodes of ``events_per_episode`` events.
* :func:`context_fleet` builds a small fleet with its decision context: a watchdog-terminated
  episode, a crashed one, a complete one, one still running, alerts, both producers'
  decisions, the runtime's acknowledgement and dead letters.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

import pyarrow as pa
import pyarrow.compute as pc

from trajbus.archive.rows import ARCHIVE_SCHEMA, with_event_time
from trajbus.bus.deadletter import dead_letter_event
from trajbus.schemas.models import (
    AckOutcome,
    AlertKind,
    DecisionAck,
    DecisionKind,
    Drained,
    Envelope,
    EpisodeEnd,
    EpisodeFinalSeq,
    EpisodeOutcome,
    EpisodeStart,
    Event,
    LifecycleState,
    SandboxLifecycle,
    SchedulingDecision,
    ToolCall,
    ToolResult,
    ToolStatus,
    TraceChunk,
    WatchdogAlert,
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
        "event_digest": i,  # a stand-in: unique per event, never null
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


@dataclass
class ContextFleet:
    """Events (``events``: sandbox events; ``decisions``, ``alerts``, ``dead_letters``: the
    processors' outputs) and what the archive must conclude (``endings``: (sandbox, episode)
    -> (ending, truncated_by, terminate decision id))."""

    events: list[Event] = field(default_factory=list)
    decisions: list[Event] = field(default_factory=list)
    alerts: list[Event] = field(default_factory=list)
    dead_letters: list[Event] = field(default_factory=list)
    endings: dict[tuple[str, str], tuple[str, str | None, str | None]] = \
        field(default_factory=dict)


def _sid(*parts: object) -> str:
    return hashlib.sha1("/".join(map(str, parts)).encode()).hexdigest()


def context_fleet(task: str = "web-shop", t0_ms: int = 1_714_557_600_000,
                  prefix: str = "trajbus") -> ContextFleet:
    """Four sandboxes of ``task``:

    * ``sb-loop``: episode 00000 loops; the watchdog alerts (LOOP) and decides TERMINATE about
      the episode, the scheduler decides TERMINATE about the sandbox (cause: the alert), the
      runtime acknowledges the scheduler's decision (DONE), the sandbox drains and recycles;
    * ``sb-crash``: 00000 complete, 00001 crashes without an EpisodeEnd (drained, recycled,
      the scheduler's RECYCLE_WITH_LOSS), 00002 never ran; two dead letters about it;
    * ``sb-trunc``: 00000 ends TRUNCATED (the runtime's own "agent process crashed");
    * ``sb-run``: 00000 complete, 00001 still running (no end, sandbox alive).
    """
    f = ContextFleet()
    seqs: dict[str, int] = {}

    def hdr(sandbox: str, t: int, episode: str | None = None, producer: str = "synth",
            eid: str | None = None, seq: int | None = None) -> Envelope:
        if seq is None:
            seq = seqs.get(sandbox, 0)
            seqs[sandbox] = seq + 1
        return Envelope(event_id=eid or _sid(sandbox, "life", seq, producer), task=task,
                        sandbox=sandbox, episode=episode, seq=seq, event_time_ms=t,
                        producer_id=producer)

    def life(sandbox: str, state: LifecycleState, t: int, reason: str = "") -> str:
        h = hdr(sandbox, t)
        f.events.append(SandboxLifecycle(header=h, state=state, reason=reason))
        return h.event_id

    def decide(sandbox: str, kind: DecisionKind, t: int, by: str, episode: str | None = None,
               causes: tuple[str, ...] = (), reason: str = "") -> str:
        eid = _sid(sandbox, kind.value, by, t)
        f.decisions.append(SchedulingDecision(
            header=hdr(sandbox, t, episode, f"trajbus.{by}", eid, seq=len(f.decisions)),
            decision=kind, reason=reason or kind.value.lower(), suspicious=kind is
            DecisionKind.TERMINATE, cause_event_ids=list(causes)))
        return eid

    for i, sb in enumerate(("sb-loop", "sb-crash", "sb-trunc", "sb-run")):
        t = t0_ms + i * 1_000
        decide(sb, DecisionKind.PLACE, t, "scheduler")
        life(sb, LifecycleState.PROVISIONING, t + 10)
        life(sb, LifecycleState.ACTIVE, t + 20)

    def ended(sb: str) -> None:
        t = max(e.header.event_time_ms for e in f.events if e.header.sandbox == sb) + 1_000
        draining = life(sb, LifecycleState.DRAINING, t, "recycle")
        if sb != "sb-loop":  # the scheduler answers the sandbox's own report with a DRAIN
            decide(sb, DecisionKind.DRAIN, t + 1, "scheduler", causes=(draining,))
        f.events.append(Drained(header=hdr(sb, t + 10), complete=True))
        life(sb, LifecycleState.RECYCLED, t + 20)

    # sb-loop: the watchdog's alert and TERMINATE about 00000, the scheduler's TERMINATE
    loop = episode_events(task, "sb-loop", "00000", tool_calls=25, t0_ms=t0_ms + 60_000)
    f.events += loop
    t_alert = loop[-2].header.event_time_ms
    alert_id = _sid("sb-loop", "alert")
    f.alerts.append(WatchdogAlert(
        header=hdr("sb-loop", t_alert, "00000", "trajbus.watchdog", alert_id, seq=2),
        alert=AlertKind.LOOP, pattern=["browser.click"], repeat_count=25, span_ms=150_000,
        first_seq=1, last_seq=49, reason="same call, unchanged result"))
    wd = decide("sb-loop", DecisionKind.TERMINATE, t_alert, "watchdog", "00000",
                reason="watchdog: loop")
    sched = decide("sb-loop", DecisionKind.TERMINATE, t_alert + 5, "scheduler",
                   causes=(alert_id,), reason="watchdog: agent loop")
    f.events.append(DecisionAck(header=hdr("sb-loop", t_alert + 50), decision_event_id=sched,
                                decision="TERMINATE", outcome=AckOutcome.DONE,
                                detail="agent stopped"))
    ended("sb-loop")
    decide("sb-loop", DecisionKind.RECYCLE, t_alert + 3_000, "scheduler")
    f.endings[("sb-loop", "00000")] = ("terminated", None, sched)
    del wd

    # sb-crash: 00001 has no end; the sandbox is drained with it open
    f.events += episode_events(task, "sb-crash", "00000", t0_ms=t0_ms + 60_000)
    crashed = episode_events(task, "sb-crash", "00001", t0_ms=t0_ms + 120_000)[:-3]
    f.events += crashed
    t = crashed[-1].header.event_time_ms + 1_000
    draining = life("sb-crash", LifecycleState.DRAINING, t, "recycle")
    decide("sb-crash", DecisionKind.DRAIN, t + 1, "scheduler", causes=(draining,),
           reason="sandbox reported DRAINING: recycle")
    f.events.append(Drained(header=hdr("sb-crash", t + 10), complete=True, final_seqs=[
        EpisodeFinalSeq(episode="00001", final_seq=crashed[-1].header.seq)]))
    life("sb-crash", LifecycleState.RECYCLED, t + 20)
    decide("sb-crash", DecisionKind.RECYCLE_WITH_LOSS, t + 30, "scheduler")
    for n, src in enumerate((f"{prefix}.sandbox.events", f"{prefix}.trace.chunks")):
        f.dead_letters.append(dead_letter_event(
            stage="reorder", reason_code="seq_after_end", reason="seq after the end",
            source_topic=src, source_partition=0, source_offset=7, key=b"sb-crash",
            value=b"bytes %d" % n, producer_id="trajbus.reorder", task=task,
            sandbox="sb-crash", episode="00001", event_time_ms=t + 40 + n))
    f.endings[("sb-crash", "00000")] = ("complete", None, None)
    f.endings[("sb-crash", "00001")] = ("truncated", "recycle", None)

    # sb-trunc: the runtime ends 00000 TRUNCATED
    f.events += episode_events(task, "sb-trunc", "00000", t0_ms=t0_ms + 60_000,
                               outcome=EpisodeOutcome.TRUNCATED)
    ended("sb-trunc")
    f.endings[("sb-trunc", "00000")] = ("truncated", "runtime", None)

    # sb-run: 00001 still running
    f.events += episode_events(task, "sb-run", "00000", t0_ms=t0_ms + 60_000)
    f.events += episode_events(task, "sb-run", "00001", t0_ms=t0_ms + 120_000)[:-2]
    f.endings[("sb-run", "00000")] = ("complete", None, None)
    f.endings[("sb-run", "00001")] = ("in_progress", None, None)

    # a fleet-wide decision (no sandbox) and a tenant's
    f.decisions.append(SchedulingDecision(
        header=Envelope(event_id=_sid("demote"), task="_fleet", sandbox="tenant:acme",
                        seq=len(f.decisions), event_time_ms=t0_ms + 90_000,
                        producer_id="trajbus.scheduler"),
        decision=DecisionKind.DEMOTE, reason="sustained overuse", tenant="acme"))
    return f
