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
from dataclasses import dataclass
from typing import Any

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
    """One alert or decision about a sandbox."""

    time_ms: int  # when it was written (the record's timestamp)
    what: str  # LOOP, TERMINATE, ...
    sandbox: str
    task: str
    episode: str | None
    why: str
    event_id: str
    source: str  # watchdog | scheduler
    record: dict[str, Any]

    def line(self, now_ms: int | None = None) -> str:
        where = f"{self.sandbox}/{self.episode}" if self.episode else self.sandbox
        return (f"{iso(self.time_ms)}  {ago(self.time_ms, now_ms):>14}  {self.what:<17} "
                f"{self.task:<14} {where:<28} {self.why}")

    def to_dict(self) -> dict[str, Any]:
        return {"time": iso(self.time_ms), "time_ms": self.time_ms, "what": self.what,
                "sandbox": self.sandbox, "task": self.task, "episode": self.episode,
                "why": self.why, "id": self.event_id, "by": self.source}


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


async def happenings(settings: Settings, since_ms: int, kinds: Sequence[str] = DEFAULT_KINDS,
                     sandboxes: Sequence[str] = (), tasks: Sequence[str] = ()
                     ) -> list[Happening]:
    """Alerts and decisions of ``kinds`` written at or after ``since_ms``, oldest first."""
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
                source="watchdog" if rec.kind == "WatchdogAlert" else "scheduler",
                record=rec.decoded.record))
    return sorted(out, key=lambda x: (x.time_ms, x.sandbox, x.what))


def headline(items: Iterable[Happening], kinds: Sequence[str]) -> str:
    """``3 loops, 3 terminations, 0 anomalies, ...`` over the asked kinds."""
    n = Counter(h.what for h in items)
    return ", ".join(f"{n.get(k, 0)} {_WORDS.get(k, k.lower())}" for k in kinds)
