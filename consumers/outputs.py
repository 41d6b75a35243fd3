"""The outputs the pure cores share: a refused input (:class:`DeadLetterOut`) and a
scheduling decision (:class:`DecisionOut`).

The reorder, scheduler and watchdog cores return these types (plus their own kinds: segments,
late events, alerts), and the engine turns each into a Kafka record in one place
(``_Adapter.out_record`` in :mod:`trajbus.consumers.engine.processors`). Pure: no client,
no clock; importing it loads no schema model (the reorder core imports it)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NamedTuple, TypeAlias

if TYPE_CHECKING:
    from trajbus.schemas.models import SchedulingDecision

Origin: TypeAlias = tuple[str, int, int, bytes | None, int]
"""A source record's (topic, partition, offset, key, log time)."""


class DeadLetterOut(NamedTuple):
    """Input a core refuses, with a stable reason code and a human reason; the core's state is
    unchanged by it. A NamedTuple: cheap to build on a core's hot path.

    The shell writes the dead letter of the record it fed the core (or of ``origin``, when the
    core names another one), with ``raw`` as its value when given (else the record's own
    bytes) and the envelope fields the core could read. Fields a core does not know stay
    None (``kind``: "")."""

    reason_code: str
    reason: str
    raw: bytes | None = None
    """The refused event's bytes as the core saw them; None: the record's value."""
    task: str | None = None
    sandbox: str | None = None
    episode: str | None = None
    seq: int | None = None
    conflicting_with: bytes | None = None
    """For ``conflicting_duplicate``: the version that was kept, when still buffered."""
    origin: Origin | None = None
    """For an event judged after it was held: its source record, as the shell passed it to
    the core; None: the record the shell is feeding."""
    kind: str = ""
    """The refused record's kind, when the core knows it."""
    event_id: str | None = None


@dataclass(frozen=True, slots=True)
class DecisionOut:
    """One scheduling decision; mirrors ``SchedulingDecision`` (``decision`` is a DecisionKind
    symbol). ``time_ms`` is the core time the decision was made at; ``seq`` its header seq (the
    scheduler's gapless decision counter, the watchdog's seq of the deciding event);
    ``event_id`` its deterministic id, made by the deciding core (the same input always gives
    the same id)."""

    decision: str
    reason: str
    time_ms: int
    seq: int
    event_id: str
    sandbox: str | None = None
    task: str | None = None
    episode: str | None = None
    node: str | None = None
    tenant: str | None = None
    request_id: str | None = None
    suspicious: bool = False
    scores: dict[str, float] = field(default_factory=dict)
    details: dict[str, str] = field(default_factory=dict)
    cause_event_ids: tuple[str, ...] = ()

    def to_model(self, producer_id: str = "trajbus-scheduler") -> SchedulingDecision:
        """The Avro-ready event. ``header.sandbox`` is the sandbox, else ``tenant:<name>``,
        else ``_fleet``; ``header.task`` the task or ``_fleet``. Deterministic: the same
        decision and producer id give the same encoded bytes."""
        from trajbus.schemas.models import DecisionKind, Envelope, SchedulingDecision

        subject = self.sandbox or (f"tenant:{self.tenant}" if self.tenant else "_fleet")
        return SchedulingDecision(
            header=Envelope(
                event_id=self.event_id, task=self.task or "_fleet", sandbox=subject,
                episode=self.episode, seq=self.seq, event_time_ms=self.time_ms,
                producer_id=producer_id,
            ),
            decision=DecisionKind(self.decision), reason=self.reason, node=self.node,
            tenant=self.tenant, request_id=self.request_id, suspicious=self.suspicious,
            scores=dict(self.scores), details=dict(self.details),
            cause_event_ids=list(self.cause_event_ids),
        )
