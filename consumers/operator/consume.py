"""``trajbus consume TOPIC``: read any trajbus topic decoded, in the spirit of kcat and
kafka-console-consumer.

A read assigns every partition of the topic (no consumer group, nothing committed), starts
each at the requested position and, unless it follows, stops at the end offsets taken when it
started, so it always terminates. It is ``read_committed``: aborted transactional outputs of
the processors are never shown. Records are decoded with the Avro codec (the writer schema by
fingerprint); a record that does not decode is shown as undecodable, with the reason, never
skipped silently. Ticks (the processors' clock, written into their input topics) are left
out unless asked for.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import AsyncIterator, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from aiokafka import TopicPartition

from trajbus.bus import inventory
from trajbus.bus.clients import new_consumer
from trajbus.bus.closing import close_client
from trajbus.bus.errors import NotFoundError, existing
from trajbus.bus.positions import iso, resolve_offsets
from trajbus.bus.settings import Settings
from trajbus.bus.topics import Topics
from trajbus.consumers.operator.tools import _jsonable, humanize, summarize
from trajbus.schemas.codec import Codec, Decoded, DecodeError, default_codec


def topic_aliases(settings: Settings) -> dict[str, str]:
    """Short names for the catalog topics (``events``, ``decisions``, ...)."""
    t = Topics(settings)
    return {"events": t.sandbox_events, "traces": t.trace_chunks, "control": t.control,
            "nodes": t.nodes, "decisions": t.decisions, "alerts": t.alerts,
            "deadletter": t.deadletter, "deadletters": t.deadletter, "late": t.late,
            "schemas": t.schemas}


def resolve_topic(settings: Settings, name: str, names: Sequence[str]) -> str:
    """The topic a user means: a full name, a name under the prefix (``replay.web-shop``,
    ``sandbox.events``), a short name (``events``, ``alerts``, ``deadletter``) or a task
    (``web-shop``: its replay topic). Raises :class:`NotFoundError` with what exists."""
    have = set(names)
    prefix = settings.topics.prefix
    candidates = [name, f"{prefix}.{name}", topic_aliases(settings).get(name, ""),
                  f"{prefix}.replay.{name}"]
    for c in candidates:
        if c and c in have:
            return c
    mine = sorted(n for n in have if n.startswith(prefix + "."))
    raise NotFoundError(f"no topic {name!r} under the prefix {prefix!r}",
                        hint=existing("topics", mine) + "; short names: "
                        + ", ".join(sorted(topic_aliases(settings))))


@dataclass(frozen=True)
class RecordFilter:
    """Keep records of these tasks/sandboxes/episodes/kinds (None: any). A kind matches the
    record's kind (``ToolCall``, ``DeadLetter``) or its label (a decision such as
    ``TERMINATE``, an alert such as ``LOOP``, a dead letter's reason code), any case."""

    tasks: frozenset[str] | None = None
    sandboxes: frozenset[str] | None = None
    episodes: frozenset[str] | None = None
    kinds: frozenset[str] | None = None
    ticks: bool = False

    @classmethod
    def of(cls, tasks: Iterable[str] = (), sandboxes: Iterable[str] = (),
           episodes: Iterable[str] = (), kinds: Iterable[str] = (), ticks: bool = False
           ) -> RecordFilter:
        def opt(xs: Iterable[str]) -> frozenset[str] | None:
            s = frozenset(xs)
            return s or None

        k = opt(x.lower() for x in kinds)
        return cls(opt(tasks), opt(sandboxes), opt(episodes), k, ticks)


@dataclass(frozen=True)
class ConsumedRecord:
    """One record of a topic, decoded when it could be."""

    topic: str
    partition: int
    offset: int
    timestamp_ms: int
    key: bytes | None
    value: bytes = field(repr=False)
    decoded: Decoded | None = field(default=None, repr=False)
    error: str | None = None

    @property
    def kind(self) -> str:
        return self.decoded.kind if self.decoded is not None else "undecodable"

    @property
    def header(self) -> dict[str, Any]:
        return self.decoded.header if self.decoded is not None else {}

    @property
    def label(self) -> str:
        """The decision, alert or dead-letter reason code; else the kind."""
        r = self.decoded.record if self.decoded is not None else {}
        return str(r.get("decision") or r.get("alert") or r.get("reason_code") or self.kind)

    def matches(self, f: RecordFilter) -> bool:
        if self.kind == "Tick" and not f.ticks:
            return False
        h = self.header
        if f.tasks is not None and h.get("task") not in f.tasks:
            return False
        if f.sandboxes is not None and h.get("sandbox") not in f.sandboxes:
            return False
        if f.episodes is not None and h.get("episode") not in f.episodes:
            return False
        return f.kinds is None or self.kind.lower() in f.kinds or self.label.lower() in f.kinds

    def summary(self) -> str:
        if self.decoded is None:
            return f"undecodable ({len(self.value)} bytes): {self.error}"
        return humanize(summarize(self.kind, self.decoded.record))

    def line(self) -> str:
        """``time  p<partition>@<offset>  kind  task sandbox/episode#seq  summary``."""
        h = self.header
        if h:
            where = f"{h.get('sandbox')}/{h['episode']}" if h.get("episode") else h.get("sandbox")
            who = f"{h.get('task')} {where}#{h.get('seq')}"
        else:
            who = f"key={self.key.decode(errors='replace') if self.key else '-'}"
        return (f"{iso(self.timestamp_ms)}  p{self.partition}@{self.offset:<6} "
                f"{self.label:<17} {who}  {self.summary()}")

    def to_dict(self, expand: bool = False) -> dict[str, Any]:
        """JSON-ready; bytes become ``"<N bytes>"`` (base64 with ``expand``)."""
        d: dict[str, Any] = {
            "topic": self.topic, "partition": self.partition, "offset": self.offset,
            "timestamp": iso(self.timestamp_ms), "timestamp_ms": self.timestamp_ms,
            "key": self.key.decode(errors="replace") if self.key is not None else None,
            "kind": self.kind, "summary": self.summary(),
        }
        if self.decoded is not None:
            d["record"] = _jsonable(self.decoded.record, expand)
        else:
            d["error"] = self.error
            d["value"] = _jsonable(self.value, expand)
        return d


def decode_record(topic: str, partition: int, offset: int, timestamp_ms: int,
                  key: bytes | None, value: bytes | None, codec: Codec) -> ConsumedRecord:
    value = value or b""
    try:
        decoded = codec.decode(value)
    except DecodeError as exc:
        return ConsumedRecord(topic, partition, offset, timestamp_ms, key, value, None,
                              f"{exc.reason_code}: {exc}")
    return ConsumedRecord(topic, partition, offset, timestamp_ms, key, value, decoded)


async def consume(settings: Settings, topic: str,
                  start: Literal["earliest", "latest"] | int = "earliest", *,
                  follow: bool = False, partitions: Sequence[int] | None = None,
                  codec: Codec | None = None, idle_timeout_s: float | None = None,
                  ) -> AsyncIterator[ConsumedRecord]:
    """Every record of ``topic`` from ``start`` (per partition, in offset order; partitions
    interleaved as fetched) up to the end offsets of the moment it started, or on and on with
    ``follow`` (until ``idle_timeout_s`` without a record, when given)."""
    codec = codec or default_codec()
    parts = (await inventory.partitions_of(settings, [topic])).get(topic)
    if parts is None:
        raise NotFoundError(f"no topic {topic!r}")
    if partitions is not None:
        unknown = sorted(set(partitions) - set(parts))
        if unknown:
            raise NotFoundError(f"{topic} has no partition {unknown[0]}",
                                hint=f"its partitions are 0..{len(parts) - 1}")
        parts = sorted(partitions)
    tps = [TopicPartition(topic, p) for p in parts]
    k = settings.kafka
    consumer = new_consumer(
        k, enable_auto_commit=False, isolation_level="read_committed",
        auto_offset_reset="earliest", client_id=f"{k.client_id}-consume",
        max_partition_fetch_bytes=k.max_request_size, fetch_max_bytes=4 * k.max_request_size)
    await consumer.start()
    try:
        consumer.assign(tps)
        begin = await resolve_offsets(consumer, tps, start)
        end = await consumer.end_offsets(tps)
        for tp in tps:
            consumer.seek(tp, begin[tp])
        pending = {tp for tp in tps if follow or begin[tp] < end[tp]}
        loop = asyncio.get_running_loop()
        idle_since = loop.time()
        while pending:
            batch = await consumer.getmany(*pending, timeout_ms=300)
            if batch:
                idle_since = loop.time()
            elif idle_timeout_s is not None and loop.time() - idle_since > idle_timeout_s:
                return
            for tp, msgs in sorted(batch.items(), key=lambda kv: kv[0].partition):
                for msg in msgs:
                    if not follow and msg.offset >= end[tp]:
                        continue
                    yield decode_record(tp.topic, tp.partition, msg.offset, msg.timestamp,
                                        msg.key, msg.value, codec)
            if not follow:
                for tp in list(pending):
                    if await consumer.position(tp) >= end[tp]:
                        pending.discard(tp)
    finally:
        await close_client(consumer, "consumer")


_PARTITION_LIST = re.compile(r"^\d+(,\d+)*$")


def parse_partitions(text: str | None) -> list[int] | None:
    """``"0,3"`` -> [0, 3]; None -> None (every partition)."""
    if text is None:
        return None
    if not _PARTITION_LIST.match(text.strip()):
        raise ValueError(f"--partition {text!r}: give partition numbers like 0 or 0,3")
    return [int(x) for x in text.split(",")]
