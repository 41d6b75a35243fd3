"""What the archiver does with a record it refuses (:class:`~trajbus.archive.shell.Rejected`):
a dead letter on ``Topics.deadletter``, published with the process's shared producer.

Guarantee: each refused record is dead-lettered once for all archive destinations. Its id is
derived from the stage, the source position, the reason and the bytes, and a dead letter
already retained on the topic is not written again (the callback returns False).
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable

from trajbus.bus.settings import Settings
from trajbus.bus.topics import Topics

log = logging.getLogger("trajbus.archive.archiver")

DeadLetterFn = Callable[[str, int, int, bytes | None, bytes, str, str],
                        Awaitable[bool | None] | bool | None]
"""``dead_letter(topic, partition, offset, key, value, reason_code, reason)``; returns False
when the dead letter was already on the topic (written by another archive destination, or
before a restart) and was not written again."""


def kafka_dead_letter(settings: Settings, stage: str = "archiver") -> DeadLetterFn:
    """A dead-letter callback publishing to ``Topics.deadletter`` with the shared producer.

    A dead letter's id is derived from the stage, the source position, the reason and the
    bytes, not from the destination: every archive destination (each its own consumer group,
    reading the raw topics from their beginning) refuses the same records with the same ids.
    On its first refusal the callback reads the ids already on the dead-letter topic; one
    already there is not written again (returns False; ``ArchiverStats.dead_letters_known``),
    so a new destination does not dead-letter old garbage a second time."""
    from trajbus.bus.deadletter import count, dead_letter_event
    from trajbus.bus.producer import get_producer

    topic = Topics(settings).deadletter
    known: set[str] | None = None

    async def send(src_topic: str, partition: int, offset: int, key: bytes | None,
                   value: bytes, reason_code: str, reason: str) -> bool:
        nonlocal known
        ev = dead_letter_event(stage=stage, reason_code=reason_code, reason=reason,
                               source_topic=src_topic, source_partition=partition,
                               source_offset=offset, key=key, value=value,
                               producer_id=f"{settings.kafka.client_id}-{stage}")
        if known is None:
            known = await dead_letter_ids(settings, stage)
        if ev.header.event_id in known:
            log.info("%s:%d@%d: %s, already dead-lettered as %s", src_topic, partition, offset,
                     reason_code, ev.header.event_id[:12])
            return False
        producer = await get_producer(settings.kafka)
        await (await producer.send(topic, ev.encode(), key=key))
        known.add(ev.header.event_id)
        count(stage, reason_code)
        return True

    return send


async def dead_letter_ids(settings: Settings, stage: str) -> set[str]:
    """The ids of the dead letters of ``stage`` retained on the dead-letter topic."""
    from trajbus.consumers.operator.tools import read_records
    from trajbus.schemas.codec import DecodeError, default_codec

    codec = default_codec()
    out: set[str] = set()
    for recs in (await read_records(settings, [Topics(settings).deadletter])).values():
        for rec in recs:
            try:
                d = codec.decode(rec.value)
            except DecodeError:
                continue
            if d.kind == "DeadLetter" and d.record["stage"] == stage:
                out.add(str(d.header["event_id"]))
    return out

