"""The scheduler core's state records (a sandbox, a tenant) with their JSON form, the lifecycle
states and their legal steps, and the small value helpers the rooms share."""

from __future__ import annotations

import json
from collections import deque
from dataclasses import dataclass, field
from typing import Any

PLACED = "PLACED"  # internal pre-state: placed by the scheduler, no lifecycle event yet
PROVISIONING = "PROVISIONING"
ACTIVE = "ACTIVE"
DRAINING = "DRAINING"
RECYCLED = "RECYCLED"
LEASED = frozenset({PLACED, PROVISIONING, ACTIVE})
_REPORTABLE = frozenset({PROVISIONING, ACTIVE, DRAINING, RECYCLED})
_LEGAL: dict[str, frozenset[str]] = {
    PLACED: frozenset({PROVISIONING, DRAINING}),
    PROVISIONING: frozenset({ACTIVE, DRAINING}),
    ACTIVE: frozenset({DRAINING}),
    DRAINING: frozenset({RECYCLED}),
    RECYCLED: frozenset(),
}
_STATE_ORDER = (PLACED, PROVISIONING, ACTIVE, DRAINING, RECYCLED)
_ORDER = {st: i for i, st in enumerate(_STATE_ORDER)}

# deadline kinds in the heap (ties at equal time fire in this order)
_LEASE, _DRAIN, _BURST, _PURGE = 0, 1, 2, 3
_META = "meta"
_MAX_PROBE_IDS = 8


@dataclass(slots=True)
class SandboxState:
    sandbox: str
    task: str
    state: str
    reported: str = PLACED  # last state the sandbox itself reported
    tenant: str | None = None
    node: str | None = None
    request_id: str | None = None
    cpu: float = 0.0
    mem: int = 0
    gpu: float = 0.0
    placed_ms: int = -1
    lease_ttl_ms: int = 0
    lease_deadline: int = 0
    last_renewal_ms: int = -1
    renewal_event_id: str = ""
    probe_failures: int = 0
    probe_ids: list[str] = field(default_factory=list)
    suspicious: bool = False
    drain_reason: str = ""
    drain_started_ms: int = -1
    drain_deadline: int = -1
    drain_causes: list[str] = field(default_factory=list)
    drained: dict[str, int] | None = None
    drained_complete: bool = False
    drained_unflushed: int = 0
    drained_event_id: str = ""
    acked: dict[str, int] = field(default_factory=dict)
    reported_recycled: bool = False
    recycled_ms: int = -1
    seq_lifecycle: int = -1
    seq_heartbeat: int = -1
    seq_probe: int = -1
    seq_drained: int = -1
    lease_q: int = -1  # time of the live lease entry in the heap (transient)

    def to_dict(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in _SB_FIELDS}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> SandboxState:
        sb = cls(sandbox=d["sandbox"], task=d["task"], state=d["state"])
        for k in _SB_FIELDS:
            setattr(sb, k, d[k])
        return sb


_SB_FIELDS = tuple(
    f for f in SandboxState.__dataclass_fields__ if f != "lease_q"
)


@dataclass(slots=True)
class TenantState:
    tenant: str
    credit: float
    usage: float = 0.0
    over_since_ms: int | None = None
    demoted: bool = False
    demotions: int = 0
    queue: deque[dict[str, Any]] = field(default_factory=deque)

    def limit(self, burst_factor: float) -> float:
        return self.credit if self.demoted else self.credit * burst_factor

    def to_dict(self) -> dict[str, Any]:
        return {
            "tenant": self.tenant, "credit": self.credit, "usage": self.usage,
            "over_since_ms": self.over_since_ms, "demoted": self.demoted,
            "demotions": self.demotions, "queue": list(self.queue),
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> TenantState:
        return cls(
            tenant=d["tenant"], credit=d["credit"], usage=d["usage"],
            over_since_ms=d["over_since_ms"], demoted=d["demoted"], demotions=d["demotions"],
            queue=deque(d["queue"]),
        )


def _dumps(obj: Any) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()


def _require_str(rec: dict[str, Any], key: str) -> str:
    v = rec[key]
    if not isinstance(v, str) or not v:
        raise ValueError(f"{key} must be a non-empty string, got {v!r}")
    return v


def _fmt(x: float) -> str:
    return repr(round(x, 6))

