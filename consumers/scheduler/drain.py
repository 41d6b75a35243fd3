"""Drain before recycle: a sandbox's drain starts (reclaim, release, failed probes, a
watchdog LOOP), the emitter's ``Drained`` report and downstream acknowledgements complete it,
or its grace window ends; only then is its slot and tenant credit released (the rules:
:mod:`trajbus.consumers.scheduler.core`)."""

from __future__ import annotations

import heapq
from typing import Any

from trajbus.consumers.scheduler.base import SchedulerBase
from trajbus.consumers.scheduler.outputs import DeadLetterOut, Output
from trajbus.consumers.scheduler.placement import EPS, _clean
from trajbus.consumers.scheduler.state import _DRAIN, _PURGE, DRAINING, RECYCLED, SandboxState, _fmt
from trajbus.schemas.models import DecisionKind


class DrainMixin(SchedulerBase):
    """The scheduler core's drains and recycles (see the module docstring)."""

    def _reclaim(self, sb: SandboxState, out: list[Output]) -> None:
        """The lease's deadline has passed (``now == deadline + 1``). The reason counts the
        heartbeats that fell due since the last renewal and did not come."""
        interval = self.settings.heartbeat_interval_ms
        missed = (self._now - sb.last_renewal_ms) // interval if interval > 0 else 0
        noun = "heartbeat" if missed == 1 else "heartbeats"
        why = f"missed {missed} {noun}"
        if missed == 0:
            why += (f": its lease of {min(sb.lease_ttl_ms, self._lease_window)} ms is shorter "
                    f"than the {interval} ms heartbeat interval")
        self._start_drain(
            sb, out, DecisionKind.RECLAIM,
            f"lease deadline {sb.lease_deadline} passed with no heartbeat since "
            f"{sb.last_renewal_ms} ({why})",
            [sb.renewal_event_id],
            {"lease_deadline_ms": str(sb.lease_deadline),
             "last_renewal_ms": str(sb.last_renewal_ms), "missed_heartbeats": str(missed),
             "heartbeat_interval_ms": str(interval)},
        )

    def _start_drain(self, sb: SandboxState, out: list[Output], kind: DecisionKind, reason: str,
                     causes: list[str], details: dict[str, str] | None = None) -> None:
        sb.state = DRAINING
        sb.drain_reason = reason
        sb.drain_started_ms = self._now
        sb.drain_deadline = self._now + self.settings.drain_grace_ms
        sb.drain_causes = [c for c in causes if c]
        heapq.heappush(self._heap, (sb.drain_deadline, _DRAIN, sb.sandbox))
        self._dirty_sb.add(sb.sandbox)
        d = {"grace_ends_ms": str(sb.drain_deadline)}
        d.update(details or {})
        self._decide(out, kind, reason, sb=sb, details=d, causes=causes)
        self._try_complete(sb, out, [])

    def _on_drained(self, rec: dict[str, Any], h: dict[str, Any], out: list[Output]) -> None:
        sid = h["sandbox"]
        finals: dict[str, int] = {}
        for item in rec.get("final_seqs") or ():
            ep = item["episode"]
            fs = int(item["final_seq"])
            if not isinstance(ep, str):
                raise ValueError(f"episode must be a string, got {ep!r}")
            finals[ep] = max(fs, finals.get(ep, fs))
        complete = rec["complete"]
        if not isinstance(complete, bool):
            raise ValueError(f"complete must be a bool, got {complete!r}")
        unflushed = int(rec.get("unflushed", 0) or 0)
        sb = self._sb.get(sid)
        eid = h.get("event_id") or ""
        seq = int(h["seq"])
        if sb is None:
            if sid in self._queued:  # it drained before it was placed
                sb = self._withdraw_queued(
                    sid, out, "sandbox drained while queued: request withdrawn (never placed)",
                    [eid], reported=DRAINING)
                sb.seq_drained = seq
                return
            out.append(DeadLetterOut("unknown_sandbox", f"drained for unknown sandbox {sid!r}",
                                     kind="Drained", event_id=eid))
            return
        if seq <= sb.seq_drained:
            self._count("duplicate")
            return
        sb.seq_drained = seq
        self._dirty_sb.add(sid)
        if sb.state == RECYCLED:
            return
        merged = dict(sb.drained or {})
        for ep, fs in finals.items():
            merged[ep] = max(fs, merged.get(ep, fs))
        sb.drained = merged
        sb.drained_complete = complete
        sb.drained_unflushed = unflushed
        sb.drained_event_id = eid
        self._try_complete(sb, out, [eid])

    def _on_ack(self, rec: dict[str, Any], out: list[Output]) -> None:
        sid = rec["sandbox"]
        ep = rec["episode"]
        last = rec["last_seq"]
        if type(sid) is not str or type(ep) is not str or not sid or not ep:
            raise ValueError(f"sandbox and episode must be non-empty strings: {sid!r}, {ep!r}")
        if type(last) is not int:
            raise ValueError(f"last_seq must be an int, got {last!r}")
        t = rec.get("event_time_ms")
        if t is not None:
            if type(t) is not int:
                raise ValueError(f"event_time_ms must be an int, got {t!r}")
            if t > self._now:
                self._advance(t, out)
        sb = self._sb.get(sid)
        if sb is None or sb.state == RECYCLED:
            self._count("ack_ignored")
            return
        if last > sb.acked.get(ep, -1):
            sb.acked[ep] = last
            self._dirty_sb.add(sid)
            if sb.state == DRAINING and sb.drained is not None:
                self._try_complete(sb, out, [rec.get("event_id") or ""])

    def _try_complete(self, sb: SandboxState, out: list[Output], causes: list[str]) -> None:
        if sb.state != DRAINING or sb.drained is None:
            return
        acked = sb.acked
        for ep, fs in sb.drained.items():
            if acked.get(ep, -1) < fs:
                return
        all_causes = [*sb.drain_causes, sb.drained_event_id, *causes]
        details = {"final_seqs": self._fmt_seqs(sb.drained), "drained": "true",
                   "unflushed": str(sb.drained_unflushed)}
        if sb.drained_complete and sb.drained_unflushed == 0:
            self._recycle(sb, out, DecisionKind.RECYCLE,
                          "drain confirmed: emitter drained and downstream processed every "
                          "final sequence", details, all_causes)
        else:
            details["lost"] = f"unflushed:{sb.drained_unflushed}"
            self._recycle(sb, out, DecisionKind.RECYCLE_WITH_LOSS,
                          f"emitter could not flush {sb.drained_unflushed} event(s) before its "
                          "deadline", details, all_causes)

    def _grace_expired(self, sb: SandboxState, out: list[Output]) -> None:
        details = {"drained": "false" if sb.drained is None else "true",
                   "acked": self._fmt_seqs(sb.acked)}
        if sb.drained is None:
            lost = "unknown: no Drained event; events after the acked seqs"
            reason = "drain grace window ended without a Drained event"
        else:
            parts = []
            for ep in sorted(sb.drained):
                a, fs = sb.acked.get(ep, -1), sb.drained[ep]
                if a < fs:
                    parts.append(f"{ep}:{a + 1}-{fs}")
            if sb.drained_unflushed:
                parts.append(f"unflushed:{sb.drained_unflushed}")
            lost = ",".join(parts)
            details["final_seqs"] = self._fmt_seqs(sb.drained)
            details["unflushed"] = str(sb.drained_unflushed)
            reason = "drain grace window ended before downstream acknowledged " + lost
        details["lost"] = lost
        details["grace_ended_ms"] = str(sb.drain_deadline)
        self._recycle(sb, out, DecisionKind.RECYCLE_WITH_LOSS, reason, details,
                      [*sb.drain_causes, sb.drained_event_id])

    @staticmethod
    def _fmt_seqs(seqs: dict[str, int]) -> str:
        return ",".join([f"{ep}:{seqs[ep]}" for ep in sorted(seqs)])

    def _recycle(self, sb: SandboxState, out: list[Output], kind: DecisionKind, reason: str,
                 details: dict[str, str], causes: list[str]) -> None:
        sb.state = RECYCLED
        sb.recycled_ms = self._now
        self._dirty_sb.add(sb.sandbox)
        heapq.heappush(
            self._heap, (self._now + self.recycled_retention_ms, _PURGE, sb.sandbox))
        if sb.node is not None and sb.request_id is not None:
            n = self._nodes.get(sb.node)
            if n is not None:
                n.release(sb.sandbox, sb.cpu, sb.mem, sb.gpu, self._now, self._gpu_rate,
                          self._gpu_burst)
                self._dirty_node.add(sb.node)
            if sb.tenant is not None:
                t = self._tenants.get(sb.tenant)
                if t is not None:
                    t.usage = _clean(t.usage - sb.cpu)
                    if t.usage <= t.credit + EPS:
                        t.over_since_ms = None
                        t.demoted = False
                    self._dirty_tenant.add(t.tenant)
        if sb.gpu > 0:
            details["gpu_cooldown"] = _fmt(sb.gpu)
        self._decide(out, kind, reason, sb=sb, details=details, causes=causes)
        if self._queued_tenants:
            self._admit(out)
