"""``trajbus deadletters``: what is on the dead-letter topic, and sending it back.

Every record the processors (reorder, watchdog, scheduler) or the archiver could not accept
is a ``DeadLetter`` on ``<prefix>.deadletter``: the stage, a stable reason code, a human
reason, the source topic/partition/offset, the original key and bytes (cut only when they do
not fit the topic's record limit; the reason then says so and where the whole record is) and,
for a conflicting duplicate, the version that was kept (``conflicting_value``).

:func:`read_dead_letters` reads them all (bounded, ``read_committed``); :func:`counts` groups
them by stage and reason; :func:`find` resolves an id or an unambiguous id prefix;
:func:`redrive` produces the original bytes, with the original key, to the source topic again
after a fix (e.g. the episode that blocked a sandbox's ``too_many_open_episodes`` has ended,
a missing schema was registered, a limit was raised). Re-driving is idempotent: the
processors drop events they have already applied (by sandbox, episode and sequence number),
so re-driving a dead letter twice, or one whose event arrived meanwhile, changes nothing.
Each re-driven record carries a ``trajbus-redriven-from`` header with the dead letter's id.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from aiokafka import AIOKafkaProducer

from trajbus.bus import inventory
from trajbus.bus.closing import close_client
from trajbus.bus.errors import NotFoundError, UserError
from trajbus.bus.kafka import check_broker
from trajbus.bus.positions import iso
from trajbus.bus.settings import Settings
from trajbus.bus.topics import Topics
from trajbus.consumers.operator.tools import _jsonable, read_records, shorten_ids, summarize
from trajbus.schemas.codec import Codec, Decoded, DecodeError, default_codec

REDRIVE_HEADER = "trajbus-redriven-from"


@dataclass(frozen=True)
class DeadLetterRecord:
    """A decoded dead letter and where it is on the dead-letter topic."""

    event_id: str
    time_ms: int
    stage: str
    reason_code: str
    reason: str
    source_topic: str
    source_partition: int
    source_offset: int
    task: str
    sandbox: str
    episode: str | None
    original_key: bytes | None = field(repr=False)
    original_value: bytes = field(repr=False)
    conflicting_value: bytes | None = field(repr=False)
    partition: int = -1
    offset: int = -1

    @property
    def short_id(self) -> str:
        return self.event_id[:12]

    @property
    def truncated(self) -> bool:
        """The original bytes were cut to fit the topic (the reason says where they are)."""
        return "truncated to" in self.reason

    def decode_original(self, codec: Codec | None = None) -> Decoded | str:
        """The original record decoded, or why it does not decode."""
        return _decode(self.original_value, codec)

    def decode_conflicting(self, codec: Codec | None = None) -> Decoded | str | None:
        return None if self.conflicting_value is None else _decode(self.conflicting_value,
                                                                    codec)

    def line(self) -> str:
        where = f"{self.sandbox}/{self.episode}" if self.episode else self.sandbox
        return (f"{self.short_id}  {iso(self.time_ms)}  "
                f"{self.stage + '/' + self.reason_code:<34} "
                f"{self.source_topic} p{self.source_partition}@{self.source_offset}  "
                f"{self.task} {where}: {_clip(shorten_ids(self.reason), 100)}")

    def to_dict(self, expand: bool = False) -> dict[str, Any]:
        out: dict[str, Any] = {
            "id": self.event_id, "time": iso(self.time_ms), "stage": self.stage,
            "reason_code": self.reason_code, "reason": self.reason,
            "source": {"topic": self.source_topic, "partition": self.source_partition,
                       "offset": self.source_offset},
            "task": self.task, "sandbox": self.sandbox, "episode": self.episode,
            "deadletter": {"partition": self.partition, "offset": self.offset},
            "original_key": self.original_key.decode(errors="replace")
            if self.original_key is not None else None,
            "original_bytes": len(self.original_value), "truncated": self.truncated,
        }
        for name, value in (("original", self.original_value),
                            ("conflicting", self.conflicting_value)):
            if value is None:
                continue
            d = _decode(value, None)
            out[name] = ({"kind": d.kind, "summary": summarize(d.kind, d.record),
                          "record": _jsonable(d.record, expand)}
                         if isinstance(d, Decoded) else
                         {"undecodable": d, "value": _jsonable(value, expand)})
        return out

    def render(self) -> str:
        """Everything about one dead letter, for ``trajbus deadletters show``."""
        lines = [
            f"dead letter {self.event_id}",
            f"  when:     {iso(self.time_ms)}",
            f"  stage:    {self.stage}",
            f"  reason:   {self.reason_code}: {self.reason}",
            f"  source:   {self.source_topic} partition {self.source_partition} offset "
            f"{self.source_offset}",
            f"  about:    task {self.task} sandbox {self.sandbox}"
            + (f" episode {self.episode}" if self.episode else ""),
            f"  key:      {_key(self.original_key)}",
            f"  on:       deadletter partition {self.partition} offset {self.offset}",
        ]
        for title, value in (("original", self.original_value),
                             ("kept version (conflicting duplicate)", self.conflicting_value)):
            if value is None:
                continue
            d = _decode(value, None)
            lines.append(f"  {title}: {len(value)} bytes"
                         + (" (TRUNCATED, see the reason)" if self.truncated
                            and title == "original" else ""))
            if isinstance(d, Decoded):
                lines.append(f"    {d.kind}: {summarize(d.kind, d.record)}")
                for k, v in _jsonable(d.record, False).items():
                    lines.append(f"    {k}: {json.dumps(v) if isinstance(v, dict | list) else v}")
            else:
                lines.append(f"    does not decode: {d}")
                lines.append(f"    first bytes: {value[:48]!r}")
        return "\n".join(lines)


def _key(key: bytes | None) -> str:
    if key is None:
        return "(none)"
    text = key.decode(errors="replace")
    return text if text.isprintable() else repr(key)


def _clip(text: str, n: int) -> str:
    text = " ".join(text.split())
    return text if len(text) <= n else text[: n - 1] + "…"


def _decode(value: bytes, codec: Codec | None) -> Decoded | str:
    try:
        return (codec or default_codec()).decode(value)
    except DecodeError as exc:
        return f"{exc.reason_code}: {exc}"


async def read_dead_letters(settings: Settings, codec: Codec | None = None
                            ) -> list[DeadLetterRecord]:
    """Every dead letter retained on the topic, oldest first (by time, then position)."""
    await check_broker(settings.kafka)
    codec = codec or default_codec()
    parts = await read_records(settings, [Topics(settings).deadletter])
    out = []
    for tp, recs in parts.items():
        for rec in recs:
            d = _decode(rec.value, codec)
            if not isinstance(d, Decoded) or d.kind != "DeadLetter":
                continue
            r, h = d.record, d.header
            out.append(DeadLetterRecord(
                event_id=str(h["event_id"]), time_ms=int(h["event_time_ms"]),
                stage=r["stage"], reason_code=r["reason_code"], reason=r["reason"],
                source_topic=r["source_topic"], source_partition=r["source_partition"],
                source_offset=r["source_offset"], task=str(h["task"]),
                sandbox=str(h["sandbox"]), episode=h.get("episode"),
                original_key=r.get("original_key"), original_value=r["original_value"],
                conflicting_value=r.get("conflicting_value"), partition=tp.partition,
                offset=rec.offset))
    return sorted(out, key=lambda x: (x.time_ms, x.partition, x.offset))


def select(dls: Iterable[DeadLetterRecord], *, stages: Sequence[str] = (),
           reasons: Sequence[str] = (), tasks: Sequence[str] = (),
           sandboxes: Sequence[str] = (), since_ms: int | None = None
           ) -> list[DeadLetterRecord]:
    return [d for d in dls
            if (not stages or d.stage in stages) and (not reasons or d.reason_code in reasons)
            and (not tasks or d.task in tasks) and (not sandboxes or d.sandbox in sandboxes)
            and (since_ms is None or d.time_ms >= since_ms)]


@dataclass(frozen=True)
class Count:
    stage: str
    reason_code: str
    count: int
    first_ms: int
    last_ms: int
    example: str  # short id of the latest


def counts(dls: Iterable[DeadLetterRecord]) -> list[Count]:
    """Dead letters per (stage, reason code), most numerous first."""
    groups: dict[tuple[str, str], list[DeadLetterRecord]] = {}
    for d in dls:
        groups.setdefault((d.stage, d.reason_code), []).append(d)
    rows = [Count(stage, code, len(g), min(x.time_ms for x in g), max(x.time_ms for x in g),
                  max(g, key=lambda x: x.time_ms).short_id)
            for (stage, code), g in groups.items()]
    return sorted(rows, key=lambda c: (-c.count, c.stage, c.reason_code))


def find(dls: Sequence[DeadLetterRecord], ident: str) -> DeadLetterRecord:
    """The dead letter whose id is ``ident`` or starts with it (at least 4 characters)."""
    ident = ident.strip().lower()
    exact = [d for d in dls if d.event_id == ident]
    if exact:
        return exact[0]
    matches = [d for d in dls if len(ident) >= 4 and d.event_id.startswith(ident)]
    if len(matches) == 1:
        return matches[0]
    if matches:
        raise UserError(f"{len(matches)} dead letters have ids starting with {ident!r}",
                        hint="give more characters: "
                        + ", ".join(d.short_id for d in matches[:5]))
    latest = ", ".join(d.short_id for d in list(reversed(dls))[:5])
    raise NotFoundError(f"no dead letter with id {ident!r}",
                        hint=f"{len(dls)} on the topic, latest: {latest} (`trajbus "
                        "deadletters list`)" if dls else "the dead-letter topic is empty")


@dataclass(frozen=True)
class Redriven:
    dead_letter: DeadLetterRecord
    topic: str
    partition: int
    offset: int


def redrivable(settings: Settings, d: DeadLetterRecord, topics_now: set[str]) -> str | None:
    """Why this dead letter cannot be re-driven, or None."""
    if d.truncated:
        return ("its original bytes were cut to fit the dead-letter topic; the whole record is "
                f"still at {d.source_topic} partition {d.source_partition} offset "
                f"{d.source_offset}")
    if d.source_topic not in topics_now:
        return f"its source topic {d.source_topic!r} does not exist (any more)"
    if not d.source_topic.startswith(settings.topics.prefix + "."):
        return f"its source topic {d.source_topic!r} is not a {settings.topics.prefix} topic"
    return None


async def redrive(settings: Settings, dls: Sequence[DeadLetterRecord], *,
                  dry_run: bool = False) -> list[Redriven]:
    """Produce each dead letter's original key and bytes to its source topic (the original
    partition when it still exists, so the source's ordering by key is kept). Refuses the
    whole batch, producing nothing, if any of them cannot be re-driven."""
    have = set(await inventory.topic_names(settings))
    refused = [(d, why) for d in dls if (why := redrivable(settings, d, have)) is not None]
    if refused:
        d, why = refused[0]
        raise UserError(f"cannot re-drive dead letter {d.short_id}: {why}"
                        + (f" (and {len(refused) - 1} more)" if len(refused) > 1 else ""),
                        hint="narrow the selection (ids, --stage, --reason)")
    if dry_run or not dls:
        return [Redriven(d, d.source_topic, d.source_partition, -1) for d in dls]
    from trajbus.bus.producer import producer_options

    parts = await inventory.partitions_of(settings, sorted({d.source_topic for d in dls}))
    producer = AIOKafkaProducer(**producer_options(
        settings.kafka, client_id=f"{settings.kafka.client_id}-redrive"))
    await producer.start()
    try:
        futures = []
        for d in dls:
            partition = d.source_partition if d.source_partition in parts.get(
                d.source_topic, []) else None
            futures.append((d, await producer.send(
                d.source_topic, d.original_value, key=d.original_key, partition=partition,
                headers=[(REDRIVE_HEADER, d.event_id.encode())])))
        out = []
        for d, fut in futures:
            meta = await fut
            out.append(Redriven(d, meta.topic, meta.partition, meta.offset))
    finally:
        await close_client(producer, "redrive producer")
    return out


def stage_reason_table(rows: Sequence[Count]) -> list[str]:
    if not rows:
        return []
    out = [f"{'stage':<10} {'reason':<26} {'count':>6}  {'first':<24} {'last':<24} latest id"]
    for c in rows:
        out.append(f"{c.stage:<10} {c.reason_code:<26} {c.count:>6}  {iso(c.first_ms):<24} "
                   f"{iso(c.last_ms):<24} {c.example}")
    return out
