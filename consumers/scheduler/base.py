"""What every room of the scheduler core shares: the fields of its state, the decision
recorder (each decision numbered and counted) and the deadline heap. Each room
(:mod:`.lifecycle`, :mod:`.drain`, :mod:`.admission`, :mod:`.persistence`) is a mixin over
:class:`SchedulerBase`; :class:`~trajbus.consumers.scheduler.core.SchedulerCore` composes them
and builds the state."""

from __future__ import annotations

import heapq
from typing import TYPE_CHECKING, Any

from trajbus.bus.settings import SchedulerSettings
from trajbus.consumers.scheduler.outputs import DecisionOut, Output, decision_event_id
from trajbus.consumers.scheduler.placement import NodeState, Placer
from trajbus.consumers.scheduler.state import (
    _DRAIN,
    _LEASE,
    _PURGE,
    DRAINING,
    LEASED,
    RECYCLED,
    SandboxState,
    TenantState,
)
from trajbus.schemas.models import DecisionKind


class SchedulerBase:
    """The scheduler core's fields (built by ``SchedulerCore.__init__``) and the steps every
    room uses; the steps one room calls in another are declared for the type checker."""

    settings: SchedulerSettings
    tenant_credit: dict[str, float]
    recycled_retention_ms: int
    lease_warning_ms: int
    placer: Placer
    stats: dict[str, int]
    _default_ttl: int
    _lease_window: int
    _gpu_rate: float
    _gpu_burst: float
    _now: int  # the core's clock: the maximum event time seen
    _seq: int  # the last decision's number
    _arrival: int  # the last queued request's arrival number
    _sb: dict[str, SandboxState]
    _nodes: dict[str, NodeState]
    _tenants: dict[str, TenantState]
    _queued: dict[str, str]  # sandbox -> tenant, for queued requests
    _queued_tenants: set[str]
    _heap: list[tuple[int, int, str]]  # (deadline, kind, key)
    _dirty_sb: set[str]
    _dirty_node: set[str]
    _dirty_tenant: set[str]
    _dirty_meta: bool
    _taken_now: int

    def _schedule_sandbox(self, sb: SandboxState) -> None:
        if sb.state in LEASED:
            # The lease covers its deadline: it expires 1 ms after it (a heartbeat stamped
            # exactly at the deadline still renews it).
            sb.lease_q = sb.lease_deadline + 1
            heapq.heappush(self._heap, (sb.lease_q, _LEASE, sb.sandbox))
        elif sb.state == DRAINING:
            heapq.heappush(self._heap, (sb.drain_deadline, _DRAIN, sb.sandbox))
        elif sb.state == RECYCLED:
            heapq.heappush(
                self._heap, (sb.recycled_ms + self.recycled_retention_ms, _PURGE, sb.sandbox))

    # -- decisions --------------------------------------------------------------------------
    def _decide(
        self, out: list[Output], kind: DecisionKind, reason: str, *,
        sb: SandboxState | None = None, sandbox: str | None = None, task: str | None = None,
        node: str | None = None, tenant: str | None = None, request_id: str | None = None,
        suspicious: bool = False, scores: dict[str, float] | None = None,
        details: dict[str, str] | None = None, causes: list[str] | tuple[str, ...] = (),
    ) -> None:
        if sb is not None:
            sandbox, task, node = sb.sandbox, sb.task, sb.node
            tenant, request_id = sb.tenant, sb.request_id
            suspicious = suspicious or sb.suspicious
        self._seq += 1
        self._dirty_meta = True
        value = kind.value  # an enum property: read it once
        stats = self.stats
        stats[value] = stats.get(value, 0) + 1
        now, cause_ids = self._now, tuple(filter(None, causes))
        out.append(DecisionOut(
            decision=value, reason=reason, time_ms=now, seq=self._seq,
            event_id=decision_event_id(value, reason, now, sandbox, request_id, tenant, node,
                                       cause_ids),
            sandbox=sandbox, task=task, node=node, tenant=tenant, request_id=request_id,
            suspicious=suspicious, scores=scores or {}, details=details or {},
            cause_event_ids=cause_ids,
        ))

    def _anomaly(self, out: list[Output], reason: str, sandbox: str | None, task: str | None,
                 event_id: str | None, details: dict[str, str] | None = None,
                 sb: SandboxState | None = None) -> None:
        if sb is not None:
            self._decide(out, DecisionKind.ANOMALY, reason, sb=sb, details=details,
                         causes=[event_id or ""])
        else:
            self._decide(out, DecisionKind.ANOMALY, reason, sandbox=sandbox, task=task,
                         details=details, causes=[event_id or ""])

    def _count(self, name: str) -> None:
        self.stats[name] = self.stats.get(name, 0) + 1
        self._dirty_meta = True

    if TYPE_CHECKING:  # the steps the rooms call in one another
        def _advance(self, t: int, out: list[Output]) -> None: ...

        def _renew(self, sb: SandboxState, t: int, event_id: str) -> None: ...

        def _start_drain(self, sb: SandboxState, out: list[Output], kind: DecisionKind,
                         reason: str, causes: list[str],
                         details: dict[str, str] | None = None) -> None: ...

        def _admit(self, out: list[Output]) -> None: ...

        def _queued_entry(self, sid: str) -> dict[str, Any]: ...

        def _withdraw_queued(self, sid: str, out: list[Output], reason: str,
                             causes: list[str], *, reported: str = ...,
                             suspicious: bool = ...) -> SandboxState: ...
