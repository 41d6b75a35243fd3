"""The watchdog's outputs (alerts; decisions and dead letters, the cores' shared
:mod:`trajbus.consumers.outputs`), their deterministic event ids, their schema records and the
state key of a stream (see :mod:`trajbus.consumers.watchdog.core`)."""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Any

from trajbus.consumers.outputs import DeadLetterOut, DecisionOut

__all__ = ["EVENT_ID_NAMESPACE", "AlertOut", "DeadLetterOut", "DecisionOut", "Output",
           "output_event_id", "state_key", "to_model"]

#: uuid5 namespace of every watchdog output event id.
EVENT_ID_NAMESPACE = uuid.uuid5(uuid.NAMESPACE_URL, "https://trajbus/watchdog")


def state_key(sandbox: str, episode: str | None) -> str:
    """The state/changelog key of a stream: ``sandbox`` or ``sandbox + "\\x1f" + episode``."""
    return sandbox if episode is None else f"{sandbox}\x1f{episode}"



# -- outputs ----------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class AlertOut:
    """A WatchdogAlert (minus header). ``seq``/``event_time_ms``: the input event (or tick)
    that produced it; ``event_id``: deterministic (:func:`output_event_id`)."""

    alert: str  # LOOP | LOOP_ENDED | STALL
    task: str
    sandbox: str
    episode: str | None
    pattern: tuple[str, ...]
    repeat_count: int
    span_ms: int
    first_seq: int
    last_seq: int
    distinct_results: int
    dry_run: bool
    reason: str
    seq: int
    event_time_ms: int
    event_id: str
    cause_event_ids: tuple[str, ...] = ()


Output = AlertOut | DecisionOut | DeadLetterOut


def output_event_id(kind: str, sandbox: str, episode: str | None, seq: int, cycle: int) -> str:
    """uuid5 hex over (output kind, sandbox, episode, anchor seq, cycle length): the same
    evidence always gets the same id, so replays and restarts produce recognisable duplicates."""
    name = f"{kind}\x1f{sandbox}\x1f{'' if episode is None else episode}\x1f{seq}\x1f{cycle}"
    return uuid.uuid5(EVENT_ID_NAMESPACE, name).hex


def to_model(out: AlertOut | DecisionOut, producer_id: str) -> Any:
    """The :mod:`trajbus.schemas.models` record (``WatchdogAlert`` or ``SchedulingDecision``)
    for an output. Deterministic: same output and producer id, same encoded bytes."""
    if isinstance(out, DecisionOut):
        return out.to_model(producer_id)
    from trajbus.schemas.models import AlertKind, Envelope, WatchdogAlert

    header = Envelope(
        event_id=out.event_id, task=out.task, sandbox=out.sandbox, episode=out.episode,
        seq=max(out.seq, 0), event_time_ms=out.event_time_ms, producer_id=producer_id,
    )
    if isinstance(out, AlertOut):
        return WatchdogAlert(
            header=header, alert=AlertKind(out.alert), pattern=list(out.pattern),
            repeat_count=out.repeat_count, span_ms=out.span_ms, first_seq=out.first_seq,
            last_seq=out.last_seq, distinct_results=out.distinct_results, dry_run=out.dry_run,
            reason=out.reason,
        )
    raise TypeError(f"no model for {type(out).__name__}")


