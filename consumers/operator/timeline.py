"""A sandbox's events as a human timeline: one :class:`TimelineEntry` per event, summarized,
deduplicated and ordered.

Timeline order
--------------
--------------
Entries are deduplicated by ``event_id`` (the first copy in log order wins) and ordered:
sandbox-level events (``episode`` null: lifecycle, heartbeats, probes, drained) first, by
event time then ``seq``; then each episode, episodes ordered by their earliest event time (then
"""

from __future__ import annotations

import base64
import re
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from trajbus.consumers.engine.runner import InRecord
from trajbus.schemas.codec import Decoded

_TEXTUAL = ("text/", "application/json", "application/x-ndjson", "application/jsonl")

def _iso(ms: int) -> str:
    return datetime.fromtimestamp(ms / 1000, tz=UTC).isoformat(timespec="milliseconds")


@dataclass(frozen=True, slots=True)
class TimelineEntry:
    """One event of a sandbox, decoded, with a one-line human summary.

    ``time_ms`` is the event time (``header.event_time_ms``); ``record`` is the decoded Avro
    record (a dict, ``header`` included); ``raw`` the original single-object-encoded bytes
    (empty when the event came from a source that does not keep them)."""

    time_ms: int
    kind: str
    episode: str | None
    seq: int
    summary: str
    event_id: str
    sandbox: str
    task: str
    record: dict[str, Any] = field(repr=False)
    topic: str = ""
    partition: int = -1
    offset: int = -1
    raw: bytes = field(default=b"", repr=False)
    log_time_ms: int = -1
    """The record's Kafka timestamp (when it was written or appended), -1 when unknown."""

    @property
    def time(self) -> datetime:
        """The event time as an aware UTC datetime."""
        return datetime.fromtimestamp(self.time_ms / 1000, tz=UTC)

    @property
    def time_iso(self) -> str:
        return _iso(self.time_ms)

    def text(self) -> str | None:
        """A trace chunk's inline bytes as text (undecodable bytes replaced), else None."""
        if self.kind != "TraceChunk":
            return None
        data = self.record.get("data")
        if not isinstance(data, bytes | bytearray):
            return None
        return bytes(data).decode("utf-8", errors="replace")

    def line(self, expand: bool = False) -> str:
        """``time  episode#seq  kind  summary`` (with the trace text below when ``expand``)."""
        where = f"{self.episode}#{self.seq}" if self.episode is not None else f"sandbox#{self.seq}"
        out = f"{self.time_iso}  {where:<24} {self.kind:<17} {self.summary}"
        text = self.text() if expand else None
        if text is not None:
            out += "\n" + "\n".join("    | " + ln for ln in text.splitlines() or [""])
        return out

    def to_dict(self, expand: bool = False) -> dict[str, Any]:
        """JSON-ready: bytes become ``"<N bytes>"`` (base64 and ``text`` when ``expand``)."""
        d: dict[str, Any] = {
            "time": self.time_iso, "time_ms": self.time_ms, "kind": self.kind,
            "sandbox": self.sandbox, "task": self.task, "episode": self.episode,
            "seq": self.seq, "event_id": self.event_id, "summary": self.summary,
            "source": {"topic": self.topic, "partition": self.partition, "offset": self.offset},
            "record": _jsonable(self.record, expand),
        }
        text = self.text() if expand else None
        if text is not None:
            d["text"] = text
        return d


def _jsonable(value: Any, expand: bool) -> Any:
    if isinstance(value, bytes | bytearray):
        return base64.b64encode(bytes(value)).decode() if expand else f"<{len(value)} bytes>"
    if isinstance(value, dict):
        return {k: _jsonable(v, expand) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_jsonable(v, expand) for v in value]
    return value


def _ms(x: Any) -> str:
    from trajbus.bus.positions import duration

    n = int(x or 0)
    return f"{n} ms" if n < 10_000 else duration(n)


_LONG_HEX = re.compile(r"\b([0-9a-f]{8})[0-9a-f]{8,}\b")


def shorten_ids(text: str) -> str:
    """Long hex runs (event ids, 64-hex hashes) cut to their first 8 characters and '…'."""
    return _LONG_HEX.sub(r"\1…", text)


def short_id(event_id: str) -> str:
    """An event id as operators read it: 8 characters of a hex id, other ids whole."""
    return shorten_ids(event_id).rstrip("…") if _LONG_HEX.fullmatch(event_id) else event_id


def _clip(text: str, n: int = 80) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= n else text[: n - 1] + "…"


def summarize(kind: str, record: dict[str, Any]) -> str:
    """A human one-liner for an event record (any kind; unknown kinds get a generic line)."""
    r = record
    if kind == "ToolCall":
        args = r.get("args_summary") or _clip(r.get("args_canonical") or "", 60) \
            or f"args {str(r.get('args_hash', ''))[:12]}"
        return f"call {r.get('call_id')}: {r.get('tool')}({_clip(args)})"
    if kind == "ToolResult":
        s = f"result {r.get('call_id')}: {r.get('tool')} {r.get('status')} in " \
            f"{_ms(r.get('duration_ms'))}"
        res = r.get("result_summary")
        return f"{s}: {_clip(res)}" if res else s
    if kind == "SandboxLifecycle":
        prev = r.get("previous_state")
        s = f"lifecycle {prev + ' -> ' if prev else ''}{r.get('state')}"
        if r.get("node"):
            s += f" on {r['node']}"
        if r.get("tenant"):
            s += f" (tenant {r['tenant']})"
        return s + (f": {_clip(r['reason'])}" if r.get("reason") else "")
    if kind == "Heartbeat":
        return f"heartbeat (lease {_ms(r.get('lease_ttl_ms'))})"
    if kind == "LivenessProbe":
        ok = "ok" if r.get("ok") else "FAILED"
        s = f"probe {r.get('probe')} {r.get('target') or ''} {ok} in {_ms(r.get('latency_ms'))}"
        return " ".join(s.split()) + (f": {_clip(r['error'])}" if r.get("error") else "")
    if kind == "TraceChunk":
        s = f"trace {r.get('length')} bytes at offset {r.get('file_offset')} " \
            f"(sha {str(r.get('sha256', ''))[:12]})"
        blob = r.get("blob")
        if isinstance(blob, dict):
            s += f" claim-check {blob.get('uri')}"
        if r.get("reset"):
            s += f" RESET: {_clip(r['reset'], 40)}"
        return s
    if kind == "EpisodeStart":
        parts = [f"tenant {r['tenant']}" if r.get("tenant") else "",
                 f"env {r['env_snapshot']}" if r.get("env_snapshot") else ""]
        extra = ", ".join(p for p in parts if p)
        return "episode start" + (f" ({extra})" if extra else "")
    if kind == "EpisodeEnd":
        s = f"episode end {r.get('outcome')}"
        if r.get("reward") is not None:
            s += f" reward {r['reward']:g}"
        return s + (f": {_clip(r['reason'])}" if r.get("reason") else "")
    if kind == "Drained":
        finals = ", ".join(f"{f['episode']}@{f['final_seq']}" for f in r.get("final_seqs") or [])
        return (f"drained complete={r.get('complete')} unflushed={r.get('unflushed')}"
                + (f" final seqs {finals}" if finals else ""))
    if kind == "SandboxRequest":
        return (f"request {r.get('request_id')} tenant {r.get('tenant')} cpu {r.get('cpu')} "
                f"mem {r.get('memory_mb')} MB gpu {r.get('gpu_share')}"
                + (f" dataset {r['dataset']}" if r.get("dataset") else ""))
    if kind == "TrainerRelease":
        return "trainer release" + (f": {_clip(r['reason'])}" if r.get("reason") else "")
    if kind == "NodeReport":
        return (f"node {r.get('node')} cpu {r.get('cpu_free')}/{r.get('cpu_total')} "
                f"mem {r.get('memory_free_mb')}/{r.get('memory_total_mb')} MB "
                f"gpu {r.get('gpu_free')}/{r.get('gpu_total')}")
    if kind == "SchedulingDecision":
        return f"decision {r.get('decision')}: {_clip(r.get('reason', ''))}"
    if kind == "WatchdogAlert":
        return (f"alert {r.get('alert')} x{r.get('repeat_count')} over {_ms(r.get('span_ms'))} "
                f"seq {r.get('first_seq')}..{r.get('last_seq')}: {_clip(r.get('reason', ''))}")
    if kind == "ReplaySegment":
        flags = [f for f, on in (("FIRST", r.get("is_first")), ("LAST", r.get("is_last")),
                                 ("TRUNCATED", r.get("is_last") and not r.get("is_terminal")))
                 if on]
        gap = r.get("gap")
        return (f"segment seq {r.get('first_seq')}..{r.get('last_seq')} "
                f"({len(r.get('events') or [])} events)"
                + (f" after gap {gap['from_seq']}..{gap['to_seq']}" if gap else "")
                + (" " + " ".join(flags) if flags else ""))
    if kind == "DeadLetter":
        where = f"{r.get('source_topic')} p{r.get('source_partition')}@{r.get('source_offset')}"
        extra = " (with the kept version)" if r.get("conflicting_value") else ""
        return (f"dead letter {r.get('stage')}/{r.get('reason_code')} from {where}, "
                f"{len(r.get('original_value') or b'')} bytes{extra}: {_clip(r.get('reason', ''))}")
    if kind == "Tick":
        return "tick"
    return kind


def entry_from_decoded(decoded: Decoded, rec: InRecord | None = None) -> TimelineEntry:
    """A :class:`TimelineEntry` for a decoded record (``rec``: where it was read from)."""
    h = decoded.header
    return TimelineEntry(
        time_ms=int(h["event_time_ms"]), kind=decoded.kind, episode=h.get("episode"),
        seq=int(h["seq"]), summary=summarize(decoded.kind, decoded.record),
        event_id=str(h["event_id"]), sandbox=str(h["sandbox"]), task=str(h["task"]),
        record=decoded.record,
        topic=rec.topic if rec else "", partition=rec.partition if rec else -1,
        offset=rec.offset if rec else -1, raw=rec.value if rec else b"",
        log_time_ms=rec.timestamp_ms if rec else -1,
    )


def order_timeline(entries: Iterable[TimelineEntry]) -> list[TimelineEntry]:
    """Deduplicate by event id (first in the given order wins) and order as the module
    docstring describes: sandbox-level by time, then episodes (earliest first) by seq."""
    seen: set[str] = set()
    sandbox_level: list[TimelineEntry] = []
    episodes: dict[str, list[TimelineEntry]] = defaultdict(list)
    for e in entries:
        if e.event_id in seen:
            continue
        seen.add(e.event_id)
        if e.episode is None:
            sandbox_level.append(e)
        else:
            episodes[e.episode].append(e)
    sandbox_level.sort(key=lambda e: (e.time_ms, e.seq))
    groups = sorted(episodes.items(), key=lambda kv: (min(e.time_ms for e in kv[1]), kv[0]))
    out = sandbox_level
    for _, evs in groups:
        out.extend(sorted(evs, key=lambda e: (e.seq, e.time_ms)))
    return out


_MS_AMOUNT = re.compile(r"\b(\d{4,}) ?ms\b")


def humanize(text: str) -> str:
    """Long hex ids shortened, millisecond amounts of 1 s and more as durations."""
    from trajbus.bus.positions import duration

    return _MS_AMOUNT.sub(lambda m: duration(int(m[1])), shorten_ids(text))
