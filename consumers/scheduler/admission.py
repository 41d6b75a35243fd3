"""Admission: node reports, sandbox requests, tenant credit (burst and demotion), the
per-tenant FIFO queues and placement on a node (the rules:
:mod:`trajbus.consumers.scheduler.core`)."""

from __future__ import annotations

import heapq
import math
from typing import Any

from trajbus.consumers.scheduler.base import SchedulerBase
from trajbus.consumers.scheduler.outputs import Output
from trajbus.consumers.scheduler.placement import EPS, NodeState, Placement, _clean
from trajbus.consumers.scheduler.state import (
    _BURST,
    _PURGE,
    PLACED,
    RECYCLED,
    SandboxState,
    TenantState,
    _fmt,
    _require_str,
)
from trajbus.schemas.models import DecisionKind


class AdmissionMixin(SchedulerBase):
    """The scheduler core's admission and placement (see the module docstring)."""

    def _tenant(self, name: str) -> TenantState:
        t = self._tenants.get(name)
        if t is None:
            credit = self.tenant_credit.get(name, self.settings.tenant_default_credit_cpu)
            t = TenantState(tenant=name, credit=float(credit))
            self._tenants[name] = t
        return t

    def _on_node_report(self, rec: dict[str, Any], h: dict[str, Any], out: list[Output]) -> None:
        name = _require_str(rec, "node")
        for k in ("cpu_total", "cpu_free", "memory_total_mb", "memory_free_mb"):
            v = rec[k]
            if not isinstance(v, int | float) or isinstance(v, bool) or not math.isfinite(v):
                raise ValueError(f"{k} must be a finite number, got {v!r}")
        t = h["event_time_ms"]
        n = self._nodes.get(name)
        if n is None:
            n = self._nodes[name] = NodeState(node=name)
            before = None
        else:
            if t < n.report_ms:
                self._count("stale_node_report")
                return
            before = (n.free_cpu(), n.free_mem(), n.rep_gpu_free - n.since_gpu) \
                if self.placer.is_fresh(n, self._now) else None
        n.apply_report(rec, t, h.get("event_id") or "")
        self._dirty_node.add(name)
        if self._queued_tenants:
            after = (n.free_cpu(), n.free_mem(), n.rep_gpu_free - n.since_gpu)
            if before is None or any(a > b + EPS for a, b in zip(after, before, strict=True)):
                self._admit(out)

    def _on_request(self, rec: dict[str, Any], h: dict[str, Any], out: list[Output]) -> None:
        sid = _require_str(h, "sandbox")
        rid = _require_str(rec, "request_id")
        tenant = _require_str(rec, "tenant")
        cpu = float(rec["cpu"])
        mem = int(rec["memory_mb"])
        gpu = float(rec.get("gpu_share", 0.0) or 0.0)
        ttl = int(rec.get("ttl_ms", self.settings.lease_ttl_ms))
        dataset = rec.get("dataset")
        if not (math.isfinite(cpu) and cpu > 0 and mem >= 0 and math.isfinite(gpu)
                and gpu >= 0 and ttl > 0):
            raise ValueError(f"bad resources cpu={cpu} memory_mb={mem} gpu={gpu} ttl={ttl}")
        if dataset is not None and not isinstance(dataset, str):
            raise ValueError(f"dataset must be a string, got {dataset!r}")
        eid = h.get("event_id") or ""
        task = str(h["task"])
        existing = self._sb.get(sid)
        queued_t = self._queued.get(sid)
        if existing is not None or queued_t is not None:
            same = (existing.request_id == rid if existing is not None else any(
                e["request_id"] == rid for e in self._tenants[queued_t or ""].queue))
            if same:
                self._count("duplicate")
                return
            if existing is not None and existing.request_id is None \
                    and existing.state != RECYCLED:
                # The request raced the sandbox's own lifecycle report (they travel on
                # different topics): the sandbox was adopted; the request is recorded on it.
                existing.request_id = rid
                existing.tenant = existing.tenant or tenant
                self._dirty_sb.add(sid)
                self._decide(out, DecisionKind.ADMIT,
                             "request for a sandbox that already reported itself (adopted): "
                             "recorded, no new placement", sandbox=sid, task=task,
                             tenant=tenant, request_id=rid, causes=[eid])
                return
            self._decide(out, DecisionKind.ANOMALY, "sandbox id already in use", sandbox=sid,
                         task=task, tenant=tenant, request_id=rid, causes=[eid])
            return
        t = self._tenant(tenant)
        bf = self.settings.tenant_burst_factor
        if cpu > t.credit * bf + EPS:
            self._decide(out, DecisionKind.ANOMALY,
                         f"request of {_fmt(cpu)} CPU exceeds the tenant's credit line "
                         f"({_fmt(t.credit)} × {bf})", sandbox=sid, task=task, tenant=tenant,
                         request_id=rid, causes=[eid])
            return
        self._arrival += 1
        entry = {
            "request_id": rid, "sandbox": sid, "task": task, "tenant": tenant, "cpu": cpu,
            "mem": mem, "gpu": gpu, "dataset": dataset, "ttl_ms": ttl,
            "arrival": self._arrival, "queued_ms": self._now, "event_id": eid,
        }
        if t.queue:
            self._enqueue(t, entry, "fifo", out)
            return
        if t.usage + cpu > t.limit(bf) + EPS:
            self._enqueue(t, entry, "credit", out)
            return
        pl = self.placer.choose(self._nodes, self._now, cpu, mem, gpu, dataset)
        if pl is None:
            if self.placer.could_ever_fit(self._nodes, self._now, cpu, mem, gpu) is False:
                self._decide(out, DecisionKind.ANOMALY,
                             "request is larger than every node", sandbox=sid, task=task,
                             tenant=tenant, request_id=rid, causes=[eid])
                return
            self._enqueue(t, entry, "capacity", out)
            return
        self._place(t, entry, pl, out)

    def _enqueue(self, t: TenantState, entry: dict[str, Any], cause: str,
                 out: list[Output]) -> None:
        t.queue.append(entry)
        self._queued[entry["sandbox"]] = t.tenant
        self._queued_tenants.add(t.tenant)
        self._dirty_tenant.add(t.tenant)
        pos = len(t.queue)
        self._decide(
            out, DecisionKind.QUEUE,
            f"queued at position {pos} for tenant {t.tenant} ({cause})",
            sandbox=entry["sandbox"], task=entry["task"], tenant=t.tenant,
            request_id=entry["request_id"],
            details={"position": str(pos), "cause": cause, "usage_cpu": _fmt(t.usage),
                     "credit_cpu": _fmt(t.credit),
                     "limit_cpu": _fmt(t.limit(self.settings.tenant_burst_factor))},
            causes=[entry["event_id"]],
        )

    def _place(self, t: TenantState, e: dict[str, Any], pl: Placement,
               out: list[Output]) -> None:
        now = self._now
        sid = e["sandbox"]
        sb = SandboxState(
            sandbox=sid, task=e["task"], state=PLACED, tenant=t.tenant, node=pl.node,
            request_id=e["request_id"], cpu=e["cpu"], mem=e["mem"], gpu=e["gpu"],
            placed_ms=now, lease_ttl_ms=e["ttl_ms"],
        )
        self._renew(sb, now, e["event_id"])
        self._sb[sid] = sb
        self._schedule_sandbox(sb)
        self._nodes[pl.node].reserve(sid, e["cpu"], e["mem"], e["gpu"], now)
        t.usage = _clean(t.usage + e["cpu"])
        if t.usage > t.credit + EPS and t.over_since_ms is None:
            t.over_since_ms = now
            heapq.heappush(self._heap,
                           (now + self.settings.tenant_burst_max_ms, _BURST, t.tenant))
        self._dirty_sb.add(sid)
        self._dirty_node.add(pl.node)
        self._dirty_tenant.add(t.tenant)
        details = {
            "cpu": _fmt(e["cpu"]), "memory_mb": str(e["mem"]), "gpu_share": _fmt(e["gpu"]),
            "dataset": e["dataset"] or "", "affinity": pl.affinity,
            "candidates": str(pl.candidates), "lease_deadline_ms": str(sb.lease_deadline),
            "tenant_usage_cpu": _fmt(t.usage),
        }
        if t.usage > t.credit + EPS:
            details["burst"] = "true"
        self._decide(out, DecisionKind.PLACE,
                     f"best fit on {pl.node} (score {pl.scores['total']:.2f})", sb=sb,
                     scores=pl.scores, details=details, causes=[e["event_id"]])

    def _admit(self, out: list[Output]) -> None:
        """Retry queue heads (non-demoted tenants first, then by arrival) until none fits."""
        bf = self.settings.tenant_burst_factor
        blocked: set[str] = set()
        while True:
            best: tuple[bool, int, str] | None = None
            for name in self._queued_tenants:
                if name in blocked:
                    continue
                t = self._tenants[name]
                key = (t.demoted, t.queue[0]["arrival"], name)
                if best is None or key < best:
                    best = key
            if best is None:
                return
            t = self._tenants[best[2]]
            e = t.queue[0]
            if t.usage + e["cpu"] > t.limit(bf) + EPS:
                blocked.add(t.tenant)
                continue
            pl = self.placer.choose(self._nodes, self._now, e["cpu"], e["mem"], e["gpu"],
                                    e["dataset"])
            if pl is None:
                blocked.add(t.tenant)
                continue
            t.queue.popleft()
            del self._queued[e["sandbox"]]
            if not t.queue:
                self._queued_tenants.discard(t.tenant)
            self._decide(out, DecisionKind.ADMIT,
                         f"admitted after {self._now - e['queued_ms']} ms in queue",
                         sandbox=e["sandbox"], task=e["task"], tenant=t.tenant,
                         request_id=e["request_id"],
                         details={"waited_ms": str(self._now - e["queued_ms"]),
                                  "queue_left": str(len(t.queue))},
                         causes=[e["event_id"]])
            self._place(t, e, pl, out)

    def _queued_entry(self, sid: str) -> dict[str, Any]:
        t = self._tenants[self._queued[sid]]
        return next(e for e in t.queue if e["sandbox"] == sid)

    def _withdraw_queued(self, sid: str, out: list[Output], reason: str, causes: list[str], *,
                         reported: str = PLACED, suspicious: bool = False) -> SandboxState:
        """A queued request ends before placement (the trainer released it, the sandbox
        drained, recycled or was terminated): it leaves the queue and a ``RECYCLE``
        (``details.queued = "true"``) closes it. The sandbox is kept as a Recycled record that
        holds no node and no credit, so its later reports and a redelivered request are
        recognised (never placed) until the record is purged like any recycled sandbox."""
        entry = self._queued_entry(sid)
        tenant = self._queued.pop(sid)
        t = self._tenants[tenant]
        t.queue.remove(entry)
        if not t.queue:
            self._queued_tenants.discard(tenant)
        self._dirty_tenant.add(tenant)
        sb = SandboxState(
            sandbox=sid, task=entry["task"], state=RECYCLED, reported=reported, tenant=tenant,
            request_id=entry["request_id"], lease_ttl_ms=entry["ttl_ms"], suspicious=suspicious,
            drain_reason=reason, recycled_ms=self._now,
        )
        self._sb[sid] = sb
        self._dirty_sb.add(sid)
        heapq.heappush(self._heap, (self._now + self.recycled_retention_ms, _PURGE, sid))
        self._decide(out, DecisionKind.RECYCLE, reason, sb=sb,
                     details={"queued": "true", "waited_ms": str(self._now - entry["queued_ms"])},
                     causes=causes)
        if self._queued_tenants:  # the queue it left may now admit the next request
            self._admit(out)
        return sb

    def _demote(self, t: TenantState, out: list[Output]) -> None:
        t.demoted = True
        t.demotions += 1
        self._dirty_tenant.add(t.tenant)
        over_since = t.over_since_ms or 0
        self._decide(
            out, DecisionKind.DEMOTE,
            f"tenant {t.tenant} above its credit for {self._now - over_since} ms "
            f"(burst tolerated {self.settings.tenant_burst_max_ms} ms)",
            tenant=t.tenant,
            details={"usage_cpu": _fmt(t.usage), "credit_cpu": _fmt(t.credit),
                     "excess_cpu": _fmt(t.usage - t.credit), "over_since_ms": str(over_since)},
        )
