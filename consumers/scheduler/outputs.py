"""What the scheduler core returns: scheduling decisions and dead letters."""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field

from trajbus.schemas.models import DecisionKind, Envelope, SchedulingDecision

_NS = uuid.uuid5(uuid.NAMESPACE_URL, "https://trajbus/scheduler/decision")


@dataclass(frozen=True, slots=True)
class DecisionOut:
    """One scheduling decision; mirrors ``SchedulingDecision`` (``decision`` is a DecisionKind
    symbol). ``time_ms`` is the core time the decision was made at, ``seq`` the core's gapless
    decision counter (persisted)."""

    decision: str
    reason: str
    time_ms: int
    seq: int
    sandbox: str | None = None
    task: str | None = None
    node: str | None = None
    tenant: str | None = None
    request_id: str | None = None
    suspicious: bool = False
    scores: dict[str, float] = field(default_factory=dict)
    details: dict[str, str] = field(default_factory=dict)
    cause_event_ids: tuple[str, ...] = ()

    @property
    def event_id(self) -> str:
        """uuid5 (hex) over the decision's identity: identical across replays."""
        ident = "|".join((
            self.decision, self.sandbox or "", self.request_id or "", self.tenant or "",
            self.node or "", str(self.time_ms), self.reason, *self.cause_event_ids,
        ))
        return uuid.uuid5(_NS, ident).hex

    def to_model(self, producer_id: str = "trajbus-scheduler") -> SchedulingDecision:
        """The Avro-ready event. ``header.sandbox`` is the sandbox, else ``tenant:<name>``,
        else ``_fleet``; ``header.task`` the sandbox's task or ``_fleet``."""
        subject = self.sandbox or (f"tenant:{self.tenant}" if self.tenant else "_fleet")
        return SchedulingDecision(
            header=Envelope(
                event_id=self.event_id, task=self.task or "_fleet", sandbox=subject,
                episode=None, seq=self.seq, event_time_ms=self.time_ms, producer_id=producer_id,
            ),
            decision=DecisionKind(self.decision), reason=self.reason, node=self.node,
            tenant=self.tenant, request_id=self.request_id, suspicious=self.suspicious,
            scores=dict(self.scores), details=dict(self.details),
            cause_event_ids=list(self.cause_event_ids),
        )


@dataclass(frozen=True, slots=True)
class DeadLetterOut:
    """Input the core could not use; state is unchanged by it."""

    reason_code: str
    reason: str
    kind: str = ""
    event_id: str | None = None


Output = DecisionOut | DeadLetterOut

