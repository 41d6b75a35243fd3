"""What the scheduler core returns: scheduling decisions and dead letters (the cores' shared
:mod:`trajbus.consumers.outputs`), and the deterministic id of its decisions."""

from __future__ import annotations

import uuid

from trajbus.consumers.outputs import DeadLetterOut, DecisionOut

__all__ = ["DeadLetterOut", "DecisionOut", "Output", "decision_event_id"]

_NS = uuid.uuid5(uuid.NAMESPACE_URL, "https://trajbus/scheduler/decision")


def decision_event_id(decision: str, reason: str, time_ms: int, sandbox: str | None,
                      request_id: str | None, tenant: str | None, node: str | None,
                      cause_event_ids: tuple[str, ...]) -> str:
    """uuid5 (hex) over a decision's identity: identical across replays."""
    ident = "|".join((decision, sandbox or "", request_id or "", tenant or "", node or "",
                      str(time_ms), reason, *cause_event_ids))
    return uuid.uuid5(_NS, ident).hex


Output = DecisionOut | DeadLetterOut
