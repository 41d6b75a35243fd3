"""``trajbus alerts --since 1h``: what happened to the fleet recently.

Reads the watchdog's alerts and the scheduler's decisions written since a time (Kafka's
offsets-for-times on both topics, then the record timestamps) and lists the happenings an
operator asks about: loops (and their end), stalls, terminations, anomalies, reclaimed
sandboxes and recycles with loss -- sandbox, task, when and why. ``--kind`` widens or narrows
the set to any alert or decision kind (``PLACE``, ``DRAIN``, ...).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from typing import Any

from aiokafka.partitioner import murmur2

from trajbus.bus import inventory
from trajbus.bus.kafka import check_broker
from trajbus.bus.positions import ago, duration, iso
from trajbus.bus.settings import Settings
from trajbus.bus.topics import Topics
from trajbus.consumers.operator.consume import consume
from trajbus.consumers.operator.tools import humanize, short_id
from trajbus.schemas.codec import default_codec

DEFAULT_KINDS = ("LOOP", "LOOP_ENDED", "STALL", "TERMINATE", "ANOMALY", "RECLAIM",
                 "RECYCLE_WITH_LOSS")
_WORDS = {"LOOP": "loops", "LOOP_ENDED": "loops ended", "STALL": "stalls",
          "TERMINATE": "terminations", "ANOMALY": "anomalies", "RECLAIM": "reclaims",
          "RECYCLE_WITH_LOSS": "recycles with loss"}


@dataclass(frozen=True)
class Happening:
    """One alert or decision about a sandbox. A termination is one happening however many
    records it took: the watchdog's TERMINATE request(s) are folded into the scheduler's
    TERMINATE that acted on them, with the sandbox runtime's answer (``DecisionAck``)."""

    time_ms: int  # when it was written (the record's timestamp)
    what: str  # LOOP, TERMINATE, ...
    sandbox: str
    task: str
    episode: str | None
    why: str
    event_id: str
    source: str  # the processor that wrote it (header.producer_id): watchdog | scheduler
    record: dict[str, Any]
    requested_by: tuple[str, ...] = ()  # TERMINATE: who asked for it (folded requests)
    request_ids: tuple[str, ...] = ()  # ... and the event ids of those requests
    status: str | None = None  # TERMINATE: done | failed | not acknowledged | requested
    ack_ms: int | None = None  # when the runtime's answer was written
    ack_detail: str = ""

    def line(self, now_ms: int | None = None) -> str:
        where = f"{self.sandbox}/{self.episode}" if self.episode else self.sandbox
        return (f"{iso(self.time_ms)}  {ago(self.time_ms, now_ms):>14}  {self.what:<17} "
                f"{self.task:<14} {where:<28} {self.why}  [{self.provenance()}]")

    def provenance(self) -> str:
        """``by scheduler`` / ``requested by watchdog, by scheduler, runtime: done after 2 s``."""
        parts = [f"requested by {', '.join(self.requested_by)}"] if self.requested_by else []
        parts.append(f"by {self.source}")
        if self.status is not None:
            text = f"runtime: {self.status}"
            if self.ack_ms is not None:
                text += f" after {duration(max(0, self.ack_ms - self.time_ms))}"
            if self.ack_detail:
                text += f" ({humanize(self.ack_detail)})"
            parts.append(text)
        return ", ".join(parts)

    def to_dict(self) -> dict[str, Any]:
        d = {"time": iso(self.time_ms), "time_ms": self.time_ms, "what": self.what,
             "sandbox": self.sandbox, "task": self.task, "episode": self.episode,
             "why": self.why, "id": self.event_id, "by": self.source}
        if self.what == "TERMINATE":
            d.update(requested_by=list(self.requested_by), request_ids=list(self.request_ids),
                     status=self.status, ack_time_ms=self.ack_ms, ack_detail=self.ack_detail)
        return d


def _why(kind: str, r: dict[str, Any]) -> str:
    if kind == "WatchdogAlert":
        calls = " -> ".join(p.split(":", 1)[0] for p in r.get("pattern") or [])
        if r.get("alert") == "STALL":
            return humanize(r.get("reason") or "a call open too long")
        span = duration(r.get("span_ms") or 0)
        text = (f"{calls or 'call'} repeated {r.get('repeat_count')}x over {span}, "
                f"{r.get('distinct_results')} result changes (seq {r.get('first_seq')}.."
                f"{r.get('last_seq')})")
        return text + (" [dry run]" if r.get("dry_run") else "")
    reason = humanize(str(r.get("reason") or ""))
    causes = r.get("cause_event_ids") or []
    extra = f" [causes: {', '.join(short_id(c) for c in causes[:3])}]" if causes else ""
    return reason + extra + (" (suspicious)" if r.get("suspicious") else "")


def processor_of(producer_id: str) -> str:
    """The processor that wrote a derived record: ``trajbus.watchdog`` -> ``watchdog``."""
    return producer_id.removeprefix("trajbus.") if producer_id else "unknown"


async def happenings(settings: Settings, since_ms: int, kinds: Sequence[str] = DEFAULT_KINDS,
                     sandboxes: Sequence[str] = (), tasks: Sequence[str] = ()
                     ) -> list[Happening]:
    """Alerts and decisions of ``kinds`` written at or after ``since_ms``, oldest first; each
    termination once, with who requested it, who decided it and what the runtime answered."""
    await check_broker(settings.kafka)
    topics = Topics(settings)
    wanted = {k.upper() for k in kinds}
    codec = default_codec()
    out: list[Happening] = []
    for topic in (topics.alerts, topics.decisions):
        async for rec in consume(settings, topic, since_ms, codec=codec):
            if rec.decoded is None or rec.kind not in ("WatchdogAlert", "SchedulingDecision"):
                continue
            if rec.timestamp_ms < since_ms or rec.label not in wanted:
                continue
            h = rec.header
            if (sandboxes and h["sandbox"] not in sandboxes) or (tasks and h["task"] not in tasks):
                continue
            out.append(Happening(
                time_ms=rec.timestamp_ms, what=rec.label, sandbox=str(h["sandbox"]),
                task=str(h["task"]), episode=h.get("episode"),
                why=_why(rec.kind, rec.decoded.record), event_id=str(h["event_id"]),
                source=processor_of(str(h.get("producer_id") or "")),
                record=rec.decoded.record))
    if any(h.what == "TERMINATE" for h in out):
        terminations = fold_terminations([h for h in out if h.what == "TERMINATE"])
        acks = await read_acks(settings, since_ms, {h.sandbox for h in terminations})
        out = [h for h in out if h.what != "TERMINATE"] + [with_ack(t, acks)
                                                           for t in terminations]
    return sorted(out, key=lambda x: (x.time_ms, x.sandbox, x.what))


def _is_request(h: Happening) -> bool:
    """The watchdog's TERMINATE asks; the scheduler's carries it out (it drains the sandbox)."""
    return h.source == "watchdog"


def fold_terminations(items: Sequence[Happening]) -> list[Happening]:
    """One happening per termination: each sandbox's watchdog requests are folded into the
    sandbox's first TERMINATE by another processor (the one that acted); requests nobody acted
    on in the window stay, as ``requested``."""
    acted: dict[str, Happening] = {}
    for h in sorted(items, key=lambda x: x.time_ms):
        if not _is_request(h) and h.sandbox not in acted:
            acted[h.sandbox] = h
    requests: dict[str, list[Happening]] = {}
    out: list[Happening] = []
    for h in items:
        if _is_request(h) and h.sandbox in acted:
            requests.setdefault(h.sandbox, []).append(h)
        elif _is_request(h):
            out.append(replace(h, status="requested"))
        elif acted[h.sandbox] is h:
            continue  # added below, with its requests
        else:
            out.append(h)  # a second termination of the same sandbox
    for sandbox, h in acted.items():
        reqs = sorted(requests.get(sandbox, []), key=lambda x: x.time_ms)
        out.append(replace(
            h, episode=h.episode or next((r.episode for r in reqs if r.episode), None),
            requested_by=tuple(dict.fromkeys(r.source for r in reqs)),
            request_ids=tuple(r.event_id for r in reqs)))
    return out


@dataclass(frozen=True)
class Ack:
    time_ms: int
    decision_event_id: str
    outcome: str
    detail: str


def with_ack(h: Happening, acks: dict[str, Ack]) -> Happening:
    """The runtime's answer to the termination (to its decision, or to a folded request)."""
    for ident in (h.event_id, *h.request_ids):
        a = acks.get(ident)
        if a is not None:
            return replace(h, status="done" if a.outcome == "DONE" else "failed",
                           ack_ms=a.time_ms, ack_detail=a.detail)
    return replace(h, status=h.status or "not acknowledged")


async def read_acks(settings: Settings, since_ms: int, sandboxes: set[str]) -> dict[str, Ack]:
    """The runtimes' ``DecisionAck`` records written since ``since_ms`` by these sandboxes, by
    the decision they answer. Only the sandbox-events partitions of those sandboxes are read
    (the topic is keyed by sandbox)."""
    topic = Topics(settings).sandbox_events
    parts = (await inventory.partitions_of(settings, [topic])).get(topic)
    if not parts or not sandboxes:
        return {}
    chosen = sorted({partition_of(s, len(parts)) for s in sandboxes})
    acks: dict[str, Ack] = {}
    async for rec in consume(settings, topic, since_ms, partitions=chosen,
                             codec=default_codec()):
        if rec.kind != "DecisionAck" or rec.decoded is None:
            continue
        r = rec.decoded.record
        ident = str(r["decision_event_id"])
        if ident not in acks:  # the first answer counts; a repeat changes nothing
            acks[ident] = Ack(rec.timestamp_ms, ident, str(r["outcome"]),
                              str(r.get("detail") or ""))
    return acks


def partition_of(key: str, n: int) -> int:
    """The partition the producers' default partitioner gives ``key`` (Kafka's murmur2)."""
    return (murmur2(key.encode()) & 0x7FFFFFFF) % n


def headline(items: Iterable[Happening], kinds: Sequence[str]) -> str:
    """``3 loops, 3 terminations (2 done, 1 not acknowledged), ...`` over the asked kinds."""
    items = list(items)
    n = Counter(h.what for h in items)
    status = Counter(h.status for h in items if h.what == "TERMINATE")
    parts = []
    for k in kinds:
        text = f"{n.get(k, 0)} {_WORDS.get(k, k.lower())}"
        if k == "TERMINATE" and status:
            text += " (" + ", ".join(f"{c} {s}" for s, c in sorted(status.items())) + ")"
        parts.append(text)
    return ", ".join(parts)
