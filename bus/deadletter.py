"""Dead-letter publishing: bad input is never dropped silently.

A dead letter carries the stage that rejected it, a stable reason code, a human reason and the
original key and bytes, on ``trajbus.deadletter``. Every dead letter also increments an
in-process counter by (stage, reason_code), which the metrics endpoint exports.
"""

from __future__ import annotations

import hashlib
import uuid
from collections import Counter

from prometheus_client import Counter as PromCounter

from trajbus.schemas.models import DeadLetter, Envelope, now_ms

counts: Counter[tuple[str, str]] = Counter()
DEAD_LETTERS = PromCounter("trajbus_dead_letters_total", "Records sent to the dead-letter topic, "
                           "by the stage that refused them and the reason code",
                           ["stage", "reason"])


def dead_letter_event(
    *,
    stage: str,
    reason_code: str,
    reason: str,
    source_topic: str,
    source_partition: int,
    source_offset: int,
    key: bytes | None,
    value: bytes,
    producer_id: str,
    task: str = "_unknown",
    sandbox: str = "_unknown",
    episode: str | None = None,
    event_time_ms: int | None = None,
    conflicting: bytes | None = None,
) -> DeadLetter:
    """Build the dead letter. Its event id is derived from the source position, so republishing
    the same rejection after a restart is recognisable as the same dead letter."""
    ident = f"{stage}|{source_topic}|{source_partition}|{source_offset}|{reason_code}|"
    ident += hashlib.sha256(value).hexdigest()
    return DeadLetter(
        header=Envelope(
            event_id=uuid.uuid5(uuid.NAMESPACE_URL, ident).hex,
            task=task,
            sandbox=sandbox,
            episode=episode,
            seq=max(source_offset, 0),
            event_time_ms=event_time_ms if event_time_ms is not None else now_ms(),
            producer_id=producer_id,
        ),
        reason_code=reason_code,
        reason=reason[:4000],
        stage=stage,
        source_topic=source_topic,
        source_partition=source_partition,
        source_offset=source_offset,
        original_key=key,
        original_value=value,
        conflicting_value=conflicting,
    )


def count(stage: str, reason_code: str) -> None:
    """Count one dead letter (in-process and in the ``trajbus_dead_letters_total`` metric)."""
    counts[(stage, reason_code)] += 1
    DEAD_LETTERS.labels(stage, reason_code).inc()
