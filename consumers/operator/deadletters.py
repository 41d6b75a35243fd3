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
a missing schema was registered, a limit was raised):

* **once per source record**: the stages that refused one record (reorder, scheduler,
  archiver) each wrote a dead letter for it; the record is sent once for all of them;
* **never a permanent failure**: a dead letter whose reason can never change by sending the
  same bytes again (:data:`PERMANENT`: not Avro, a malformed event, the losing version of a
  conflict, ...) or whose bytes do not decode with this version is refused, with why;
* **idempotent**: every dead letter sent (or covered by one sent) gets a ``redriven`` status
  on ``<prefix>.deadletter-status`` in the same Kafka transaction as the record sent, so a
  second redrive, even after a crash, skips it.

:func:`resolve` marks dead letters ``resolved`` with a note; :func:`read_statuses` reads the
status topic (compacted, keyed by dead letter id, latest wins); a dead letter without a
status is ``open``. Each re-driven record carries a ``trajbus-redriven-from`` header with the
dead letter's id. The same dead letter written twice (a stage re-reading its input after a
restart, another archive destination) has the same id (derived from stage, source position,
reason and bytes) and is read once.
"""

from __future__ import annotations

import getpass
import hashlib
import json
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from trajbus.bus import inventory
from trajbus.bus.clients import new_producer
from trajbus.bus.closing import close_client
from trajbus.bus.errors import NotFoundError, UserError
from trajbus.bus.kafka import check_broker
from trajbus.bus.positions import iso
from trajbus.bus.settings import Settings
from trajbus.bus.topics import Topics
from trajbus.consumers.operator.tools import _jsonable, read_records, shorten_ids, summarize
from trajbus.schemas.codec import Codec, Decoded, DecodeError, default_codec

REDRIVE_HEADER = "trajbus-redriven-from"

PERMANENT: dict[str, str] = {
    "bad_magic": "the bytes are not a trajbus record",
    "decode_error": "the bytes do not decode",
    "corrupt_body": "the bytes do not decode",
    "codec_error": "the bytes do not decode",
    "undecodable": "the bytes do not decode",
    "invalid_id": "an id in the record is not allowed",
    "invalid_event": "the event is malformed",
    "invalid_seq": "the event's seq is invalid",
    "invalid_record": "the record is malformed",
    "missing_episode": "the event names no episode",
    "missing_sandbox": "the event names no sandbox",
    "missing_outcome": "the EpisodeEnd has no outcome",
    "bad_start_seq": "the EpisodeStart is not seq 0",
    "unknown_kind": "the stage does not take this kind of record",
    "seq_after_end": "the episode's end, which was kept, comes before it",
    "conflicting_end": "the episode already has another end (the first wins)",
    "conflicting_duplicate": "another version of this event was kept (the first wins)",
    "unverified_duplicate": "its seq was already emitted (the first wins)",
}
"""Reason codes that sending the same bytes again can never change: redrive refuses them.
Every other reason (``too_many_open_episodes``, ``unknown_sandbox``, ``unknown_schema`` once
the schema is known, ``internal_error``, ...) is transient: it may succeed after a fix."""

STATUSES = ("open", "redriven", "resolved")


def permanence(reason_code: str) -> str:
    """``permanent`` or ``transient``, for the output."""
    return "permanent" if reason_code in PERMANENT else "transient"


@dataclass(frozen=True)
class Status:
    """What was done about one dead letter (latest record on the status topic)."""

    status: str  # redriven | resolved | open
    at_ms: int
    by: str = ""
    note: str = ""
    source: str = ""  # the source key redriven (redriven)
    to: str = ""  # topic/partition/offset the record was sent to (redriven)
    via: str = ""  # the dead letter whose bytes were sent (redriven)

    def describe(self) -> str:
        if self.status == "redriven":
            return (f"re-driven {iso(self.at_ms)} to {self.to}"
                    + (f" (with {self.via[:12]})" if self.via else "")
                    + (f" by {self.by}" if self.by else ""))
        if self.status == "resolved":
            return (f"resolved {iso(self.at_ms)}" + (f" by {self.by}" if self.by else "")
                    + (f": {self.note}" if self.note else ""))
        return "open" + (f" (reopened {iso(self.at_ms)})" if self.at_ms else "")


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
    status: Status | None = None

    @property
    def short_id(self) -> str:
        return self.event_id[:12]

    @property
    def state(self) -> str:
        return self.status.status if self.status is not None else "open"

    @property
    def source_key(self) -> str:
        """The source record: its position when known, else its bytes' digest."""
        if self.source_offset >= 0 and self.source_partition >= 0:
            return f"{self.source_topic}/{self.source_partition}/{self.source_offset}"
        return f"{self.source_topic}/sha256:{hashlib.sha256(self.original_value).hexdigest()}"

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
        mark = "" if self.state == "open" else f"[{self.state}] "
        return (f"{self.short_id}  {iso(self.time_ms)}  {mark}"
                f"{self.stage + '/' + self.reason_code:<34} "
                f"{self.source_topic} p{self.source_partition}@{self.source_offset}  "
                f"{self.task} {where}: {_clip(shorten_ids(self.reason), 100)}")

    def kept(self, looked_up: bytes | str | None = None) -> bytes | str | None:
        """The kept version of a conflicting duplicate: in the dead letter, or looked up."""
        return self.conflicting_value if self.conflicting_value is not None else looked_up

    def to_dict(self, expand: bool = False, kept: bytes | str | None = None) -> dict[str, Any]:
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
            "permanence": permanence(self.reason_code), "status": self.state,
        }
        if self.status is not None:
            out["status_detail"] = {k: v for k, v in vars(self.status).items() if v}
        found = self.kept(kept)
        if isinstance(found, str):
            out["conflicting"] = {"not_found": found}
        for name, value in (("original", self.original_value),
                            ("conflicting", found if isinstance(found, bytes) else None)):
            if value is None:
                continue
            d = _decode(value, None)
            out[name] = ({"kind": d.kind, "summary": summarize(d.kind, d.record),
                          "record": _jsonable(d.record, expand)}
                         if isinstance(d, Decoded) else
                         {"undecodable": d, "value": _jsonable(value, expand)})
        return out

    def render(self, kept: bytes | str | None = None) -> str:
        """Everything about one dead letter, for ``trajbus deadletters show``."""
        lines = [
            f"dead letter {self.event_id}",
            f"  when:     {iso(self.time_ms)}",
            f"  stage:    {self.stage}",
            f"  reason:   {self.reason_code}: {self.reason}",
            f"  kind:     {permanence(self.reason_code)}"
            + (f" ({PERMANENT[self.reason_code]}; redrive refuses it)"
               if self.reason_code in PERMANENT else " (redrive may succeed after a fix)"),
            f"  status:   {self.status.describe() if self.status else 'open'}",
            f"  source:   {self.source_topic} partition {self.source_partition} offset "
            f"{self.source_offset}",
            f"  about:    task {self.task} sandbox {self.sandbox}"
            + (f" episode {self.episode}" if self.episode else ""),
            f"  key:      {_key(self.original_key)}",
            f"  on:       deadletter partition {self.partition} offset {self.offset}",
        ]
        found = self.kept(kept)
        if isinstance(found, str):
            lines.append(f"  kept version (conflicting duplicate): not found: {found}")
        for title, value in (("original", self.original_value),
                             ("kept version (conflicting duplicate)",
                              found if isinstance(found, bytes) else None)):
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


async def read_statuses(settings: Settings) -> dict[str, Status]:
    """The latest status of every dead letter that has one (by dead letter id)."""
    parts = await read_records(settings, [Topics(settings).deadletter_status])
    out: dict[str, Status] = {}
    for recs in parts.values():
        for rec in recs:
            if rec.key is None:
                continue
            ident = rec.key.decode(errors="replace")
            if not rec.value:
                out.pop(ident, None)
                continue
            try:
                v = json.loads(rec.value)
                out[ident] = Status(str(v["status"]), int(v["at_ms"]), str(v.get("by", "")),
                                    str(v.get("note", "")), str(v.get("source", "")),
                                    str(v.get("to", "")), str(v.get("via", "")))
            except (ValueError, KeyError, TypeError):
                continue  # not a status record (written by hand?): ignored
    return out


async def read_dead_letters(settings: Settings, codec: Codec | None = None, *,
                            statuses: bool = True) -> list[DeadLetterRecord]:
    """Every dead letter retained on the topic, oldest first (by time, then position), each
    once (a dead letter written again by a restarted stage or another archive destination has
    the same id), with its status."""
    await check_broker(settings.kafka)
    codec = codec or default_codec()
    parts = await read_records(settings, [Topics(settings).deadletter])
    status = await read_statuses(settings) if statuses else {}
    out = []
    seen: set[str] = set()
    for tp, recs in parts.items():
        for rec in recs:
            d = _decode(rec.value, codec)
            if not isinstance(d, Decoded) or d.kind != "DeadLetter":
                continue
            if str(d.header["event_id"]) in seen:
                continue
            seen.add(str(d.header["event_id"]))
            r, h = d.record, d.header
            out.append(DeadLetterRecord(
                event_id=str(h["event_id"]), time_ms=int(h["event_time_ms"]),
                stage=r["stage"], reason_code=r["reason_code"], reason=r["reason"],
                source_topic=r["source_topic"], source_partition=r["source_partition"],
                source_offset=r["source_offset"], task=str(h["task"]),
                sandbox=str(h["sandbox"]), episode=h.get("episode"),
                original_key=r.get("original_key"), original_value=r["original_value"],
                conflicting_value=r.get("conflicting_value"), partition=tp.partition,
                offset=rec.offset, status=status.get(str(h["event_id"]))))
    return sorted(out, key=lambda x: (x.time_ms, x.partition, x.offset))


def select(dls: Iterable[DeadLetterRecord], *, stages: Sequence[str] = (),
           reasons: Sequence[str] = (), tasks: Sequence[str] = (),
           sandboxes: Sequence[str] = (), since_ms: int | None = None,
           statuses: Sequence[str] = ()) -> list[DeadLetterRecord]:
    bad = [x for x in statuses if x not in STATUSES]
    if bad:
        raise UserError(f"no status {bad[0]!r}", hint="one of " + ", ".join(STATUSES))
    return [d for d in dls
            if (not statuses or d.state in statuses)
            and (not stages or d.stage in stages) and (not reasons or d.reason_code in reasons)
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
    """What redrive did with one selected dead letter. ``action``: ``sent`` (its bytes were
    produced to ``topic``/``partition``/``offset``; -1 on a dry run), ``same_source`` (another
    selected dead letter of the same source record was sent for it: ``with_id``),
    ``already`` (re-driven or resolved before: ``why``), ``refused`` (``why``)."""

    dead_letter: DeadLetterRecord
    topic: str
    partition: int
    offset: int
    action: str = "sent"
    why: str = ""
    with_id: str = ""


def redrivable(settings: Settings, d: DeadLetterRecord, topics_now: set[str],
               codec: Codec | None = None) -> str | None:
    """Why this dead letter cannot be re-driven, or None."""
    if d.reason_code in PERMANENT:
        return (f"permanent failure ({d.reason_code}: {PERMANENT[d.reason_code]}); sending the "
                "same bytes again would fail the same way")
    if d.truncated:
        return ("its original bytes were cut to fit the dead-letter topic; the whole record is "
                f"still at {d.source_topic} partition {d.source_partition} offset "
                f"{d.source_offset}")
    if d.source_topic not in topics_now:
        return f"its source topic {d.source_topic!r} does not exist (any more)"
    if not d.source_topic.startswith(settings.topics.prefix + "."):
        return f"its source topic {d.source_topic!r} is not a {settings.topics.prefix} topic"
    decoded = _decode(d.original_value, codec)
    if not isinstance(decoded, Decoded):
        return (f"its bytes still do not decode ({decoded}); permanent until a trajbus version "
                "that decodes them runs")
    return None


def _status_value(status: str, **fields: object) -> bytes:
    return json.dumps({"status": status, "at_ms": int(time.time() * 1000),
                       "by": _who(), **fields}, sort_keys=True).encode()


def _who() -> str:
    try:
        return getpass.getuser()
    except Exception:  # no user name in a container: not an error
        return ""


async def redrive(settings: Settings, dls: Sequence[DeadLetterRecord], *,
                  dry_run: bool = False, codec: Codec | None = None,
                  every: Sequence[DeadLetterRecord] | None = None) -> list[Redriven]:
    """Send each selected source record once back to its source topic (the original partition
    when it still exists, so the source's ordering by key is kept), in one transaction with a
    ``redriven`` status for every dead letter it covers. Skips dead letters re-driven or
    resolved before (and any whose source record was re-driven); refuses permanent failures.
    ``every``: all the dead letters the selection was made from (the topic is read when it
    is not given), to find the other stages' dead letters of a selected record.
    Returns one :class:`Redriven` per selected dead letter, in selection order."""
    from trajbus.bus.admin import ensure_topics

    topics = Topics(settings)
    have = set(await inventory.topic_names(settings))
    statuses = {d.event_id: d.status for d in dls if d.status is not None}
    done_sources = {st.source for st in (await read_statuses(settings)).values()
                    if st.status == "redriven" and st.source}
    out: dict[str, Redriven] = {}
    groups: dict[str, list[DeadLetterRecord]] = {}
    refused_sources: dict[str, tuple[DeadLetterRecord, str]] = {}
    for d in dls:
        st = statuses.get(d.event_id)
        if st is not None and st.status != "open":
            out[d.event_id] = Redriven(d, d.source_topic, d.source_partition, -1, "already",
                                       st.describe())
        elif d.source_key in done_sources:
            out[d.event_id] = Redriven(d, d.source_topic, d.source_partition, -1, "already",
                                       "its source record was re-driven (with another dead "
                                       "letter of it)")
        elif (why := redrivable(settings, d, have, codec)) is not None:
            out[d.event_id] = Redriven(d, d.source_topic, d.source_partition, -1, "refused", why)
            refused_sources.setdefault(d.source_key, (d, why))
        else:
            groups.setdefault(d.source_key, []).append(d)
    # Sent back, a record goes through every stage again: if one stage's verdict on it is
    # permanent, that stage refuses it again, so none of its dead letters is re-driven
    # (the other stages' dead letters of it count even when not selected).
    if groups:
        selected = {d.event_id for d in dls}
        for d in every if every is not None else await read_dead_letters(settings, codec):
            if (d.source_key in groups and d.event_id not in selected
                    and d.source_key not in refused_sources
                    and (why := redrivable(settings, d, have, codec)) is not None):
                refused_sources[d.source_key] = (d, why)
    for key in [k for k in groups if k in refused_sources]:
        first, why = refused_sources[key]
        for d in groups.pop(key):
            out[d.event_id] = Redriven(d, d.source_topic, d.source_partition, -1, "refused",
                                       f"the {first.stage} stage's dead letter of the same "
                                       f"record ({first.short_id}) is refused: {why}")
    sends = [(g[0], g[1:]) for g in groups.values()]
    for lead, rest in sends:
        for d in rest:
            out[d.event_id] = Redriven(d, d.source_topic, d.source_partition, -1,
                                       "same_source", "", lead.event_id)
    if dry_run or not sends:
        for lead, _ in sends:
            out[lead.event_id] = Redriven(lead, lead.source_topic, lead.source_partition, -1)
        return [out[d.event_id] for d in dls if d.event_id in out]

    await ensure_topics(settings, [s for s in topics.specs if s.name == topics.deadletter_status])
    parts = await inventory.partitions_of(settings, sorted({d.source_topic for d, _ in sends}))
    producer = new_producer(
        settings.kafka, client_id=f"{settings.kafka.client_id}-redrive",
        transactional_id=f"{topics.prefix}.deadletter-redrive")  # fences a crashed one
    await producer.start()
    try:
        async with producer.transaction():
            futures = []
            for d, rest in sends:
                partition = d.source_partition if d.source_partition in parts.get(
                    d.source_topic, []) else None
                futures.append((d, rest, await producer.send(
                    d.source_topic, d.original_value, key=d.original_key, partition=partition,
                    headers=[(REDRIVE_HEADER, d.event_id.encode())])))
            for d, rest, fut in futures:
                meta = await fut
                out[d.event_id] = Redriven(d, meta.topic, meta.partition, meta.offset)
                to = f"{meta.topic}/{meta.partition}/{meta.offset}"
                for x in (d, *rest):
                    await producer.send(topics.deadletter_status, _status_value(
                        "redriven", source=d.source_key, to=to,
                        via="" if x is d else d.event_id), key=x.event_id.encode())
    finally:
        await close_client(producer, "redrive producer")
    return [out[d.event_id] for d in dls if d.event_id in out]


async def resolve(settings: Settings, dls: Sequence[DeadLetterRecord], note: str, *,
                  reopen: bool = False) -> int:
    """Mark dead letters ``resolved`` with ``note`` (or ``open`` again with ``reopen``) on the
    status topic. Returns how many were marked."""
    from trajbus.bus.admin import ensure_topics

    if not dls:
        return 0
    topics = Topics(settings)
    await ensure_topics(settings, [s for s in topics.specs if s.name == topics.deadletter_status])
    producer = new_producer(
        settings.kafka, client_id=f"{settings.kafka.client_id}-resolve")
    await producer.start()
    try:
        futs = [await producer.send(topics.deadletter_status,
                                    _status_value("open" if reopen else "resolved",
                                                  note=note[:2000]),
                                    key=d.event_id.encode()) for d in dls]
        for f in futs:
            await f
    finally:
        await close_client(producer, "resolve producer")
    return len(dls)


async def kept_version(settings: Settings, d: DeadLetterRecord, codec: Codec | None = None
                       ) -> bytes | str:
    """For a conflicting duplicate whose kept version was already emitted (not in the dead
    letter): that version's bytes from the episode's replay segments, or why it is not
    there."""
    codec = codec or default_codec()
    orig = _decode(d.original_value, codec)
    if not isinstance(orig, Decoded) or not d.episode:
        return "the original does not decode: its kept version cannot be looked up"
    seq = int(orig.header["seq"])
    try:
        topic = Topics(settings).replay(d.task)
    except ValueError as exc:
        return str(exc)
    key = f"{d.sandbox}/{d.episode}".encode()
    parts = await read_records(settings, [topic])
    for recs in parts.values():
        for rec in recs:
            if rec.key != key or not rec.value:
                continue
            seg = _decode(rec.value, codec)
            if not isinstance(seg, Decoded) or seg.kind != "ReplaySegment":
                continue
            r = seg.record
            if not r["first_seq"] <= seq <= r["last_seq"]:
                continue
            for raw in r["events"]:
                e = _decode(raw, codec)
                if isinstance(e, Decoded) and int(e.header["seq"]) == seq:
                    return bytes(raw)
    return (f"seq {seq} of {d.sandbox}/{d.episode} is not on {topic} (any more: retention, "
            "or the topic was deleted)")


def stage_reason_table(rows: Sequence[Count]) -> list[str]:
    if not rows:
        return []
    out = [f"{'stage':<10} {'reason':<26} {'count':>6}  {'first':<24} {'last':<24} latest id"]
    for c in rows:
        out.append(f"{c.stage:<10} {c.reason_code:<26} {c.count:>6}  {iso(c.first_ms):<24} "
                   f"{iso(c.last_ms):<24} {c.example}")
    return out
