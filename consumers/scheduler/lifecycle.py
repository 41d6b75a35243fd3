"""The sandboxes' own reports: lifecycle state changes, heartbeats (lease renewals), liveness
probes, the trainer's release, the watchdog's alerts and the runtime's acknowledgements of
decisions (the rules: :mod:`trajbus.consumers.scheduler.core`)."""

from __future__ import annotations

from typing import Any

from trajbus.consumers.scheduler.base import SchedulerBase
from trajbus.consumers.scheduler.outputs import DeadLetterOut, Output
from trajbus.consumers.scheduler.state import (
    _LEGAL,
    _MAX_PROBE_IDS,
    _ORDER,
    _REPORTABLE,
    ACTIVE,
    DRAINING,
    LEASED,
    PROVISIONING,
    RECYCLED,
    SandboxState,
    _require_str,
)
from trajbus.schemas.models import DecisionKind


class LifecycleMixin(SchedulerBase):
    """The scheduler core's handling of what sandboxes report (see the module docstring)."""

    def _renew(self, sb: SandboxState, t: int, event_id: str) -> None:
        deadline = t + min(sb.lease_ttl_ms, self._lease_window)
        if deadline > sb.lease_deadline:
            sb.lease_deadline = deadline
        if t >= sb.last_renewal_ms:
            sb.last_renewal_ms = t
            sb.renewal_event_id = event_id

    def _on_lifecycle(self, rec: dict[str, Any], h: dict[str, Any], out: list[Output]) -> None:
        sid = _require_str(h, "sandbox")
        state = rec["state"]
        if state not in _REPORTABLE:
            raise ValueError(f"unknown lifecycle state {state!r}")
        seq = int(h["seq"])
        eid = h.get("event_id") or ""
        t = h["event_time_ms"]
        sb = self._sb.get(sid)
        if sb is None:
            if sid in self._queued:
                if state in (DRAINING, RECYCLED):  # it ended before it was placed
                    sb = self._withdraw_queued(
                        sid, out, f"sandbox reported {state} while queued: request withdrawn "
                        "(never placed)", [eid], reported=state)
                    sb.seq_lifecycle = seq
                    return
                self._anomaly(out, f"lifecycle {state} for a sandbox that is still queued", sid,
                              h.get("task"), eid, {"state": state})
                return
            if state != PROVISIONING:
                self._anomaly(out, f"lifecycle {state} for unknown sandbox", sid, h.get("task"),
                              eid, {"state": state})
                return
            sb = SandboxState(
                sandbox=sid, task=str(h["task"]), state=PROVISIONING, reported=PROVISIONING,
                tenant=rec.get("tenant"),
                node=rec.get("node"), lease_ttl_ms=self.settings.lease_ttl_ms,
                seq_lifecycle=seq,
            )
            self._renew(sb, t, eid)
            self._sb[sid] = sb
            self._schedule_sandbox(sb)
            self._dirty_sb.add(sid)
            return
        if seq <= sb.seq_lifecycle:
            self._count("duplicate")
            return
        sb.seq_lifecycle = seq
        self._dirty_sb.add(sid)
        prev = sb.reported
        if state == prev:
            return
        if state not in _LEGAL[prev] and state not in _LEGAL[sb.state]:
            self._anomaly(out, f"illegal lifecycle transition {prev} -> {state}", sid, sb.task,
                          eid, {"from": prev, "to": state, "scheduler_state": sb.state,
                                "reported_previous": str(rec.get("previous_state"))}, sb=sb)
            return
        sb.reported = state
        cur = sb.state
        if _ORDER[state] <= _ORDER[cur]:
            return  # the scheduler is already there (its own decision ran ahead of the report)
        if state == RECYCLED:  # cur is DRAINING: noted, the slot waits for drain confirmation
            sb.reported_recycled = True
        elif state == DRAINING:
            reason = rec.get("reason") or ""
            self._start_drain(sb, out, DecisionKind.DRAIN,
                              "sandbox reported DRAINING" + (f": {reason}" if reason else ""),
                              [eid])
        else:
            sb.state = state
            self._renew(sb, t, eid)

    def _on_heartbeat(self, rec: dict[str, Any], h: dict[str, Any], out: list[Output]) -> None:
        # hot path: the renewal of _renew() is inlined
        sid = h["sandbox"]
        sb = self._sb.get(sid)
        ttl = rec.get("lease_ttl_ms")
        if ttl is None:
            ttl = self._default_ttl
        elif type(ttl) is not int or ttl <= 0:
            raise ValueError(f"lease_ttl_ms must be a positive int, got {ttl!r}")
        if sb is None:
            if sid in self._queued:  # known, but no lease to renew until it is placed
                self._count("queued_heartbeat")
                return
            out.append(DeadLetterOut("unknown_sandbox", f"heartbeat for unknown sandbox {sid!r}",
                                     kind="Heartbeat", event_id=h.get("event_id")))
            return
        seq = h["seq"]
        if type(seq) is not int:
            raise ValueError(f"seq must be an int, got {seq!r}")
        if seq <= sb.seq_heartbeat:
            self._count("duplicate")
            return
        sb.seq_heartbeat = seq
        t = h["event_time_ms"]
        state = sb.state
        if state is ACTIVE or state in LEASED:
            sb.lease_ttl_ms = ttl
            deadline = t + (ttl if ttl < self._lease_window else self._lease_window)
            if deadline > sb.lease_deadline:
                sb.lease_deadline = deadline
            if t >= sb.last_renewal_ms:
                sb.last_renewal_ms = t
                sb.renewal_event_id = h.get("event_id") or ""
        elif state == RECYCLED and t > sb.recycled_ms:
            self._anomaly(out, "heartbeat after recycle (zombie sandbox?)", sid, sb.task,
                          h.get("event_id"), {"recycled_ms": str(sb.recycled_ms)}, sb=sb)
        self._dirty_sb.add(sid)

    def _on_probe(self, rec: dict[str, Any], h: dict[str, Any], out: list[Output]) -> None:
        sid = h["sandbox"]
        ok = rec["ok"]
        if not isinstance(ok, bool):
            raise ValueError(f"ok must be a bool, got {ok!r}")
        sb = self._sb.get(sid)
        if sb is None:
            if sid in self._queued:  # known, but nothing runs to be drained yet
                self._count("queued_probe")
                return
            out.append(DeadLetterOut("unknown_sandbox", f"probe for unknown sandbox {sid!r}",
                                     kind="LivenessProbe", event_id=h.get("event_id")))
            return
        seq = h["seq"]
        if type(seq) is not int:
            raise ValueError(f"seq must be an int, got {seq!r}")
        if seq <= sb.seq_probe:
            self._count("duplicate")
            return
        sb.seq_probe = seq
        self._dirty_sb.add(sid)
        if sb.state not in LEASED:
            return
        if ok:
            sb.probe_failures = 0
            sb.probe_ids = []
            return
        sb.probe_failures += 1
        sb.probe_ids = [*sb.probe_ids[-(_MAX_PROBE_IDS - 1):], h.get("event_id") or ""]
        n = self.settings.liveness_failures_to_drain
        if sb.probe_failures >= n:
            err = rec.get("error")
            self._start_drain(
                sb, out, DecisionKind.DRAIN,
                f"{sb.probe_failures} consecutive failed liveness probes"
                + (f" (last: {err})" if err else ""),
                sb.probe_ids[-n:],
                {"probe": str(rec.get("probe", "")), "target": str(rec.get("target", ""))},
            )

    def _on_release(self, rec: dict[str, Any], h: dict[str, Any], out: list[Output]) -> None:
        sid = h["sandbox"]
        why = str(rec.get("reason") or "")
        eid = h.get("event_id") or ""
        sb = self._sb.get(sid)
        if sb is None:
            if sid not in self._queued:
                out.append(DeadLetterOut("unknown_sandbox",
                                         f"release for unknown sandbox {sid!r}",
                                         kind="TrainerRelease", event_id=eid))
                return
            self._withdraw_queued(
                sid, out, "request withdrawn by the trainer while queued (never placed)", [eid])
            return
        if sb.state in LEASED:
            self._start_drain(sb, out, DecisionKind.DRAIN,
                              "released by trainer" + (f": {why}" if why else ""), [eid])

    def _on_watchdog(self, rec: dict[str, Any], h: dict[str, Any], out: list[Output]) -> None:
        sid = h["sandbox"]
        alert = rec["alert"]
        if alert != "LOOP" or rec.get("dry_run", False):
            self._count("watchdog_ignored")
            return
        sb = self._sb.get(sid)
        eid = h.get("event_id") or ""
        if sb is None and sid not in self._queued:
            out.append(DeadLetterOut("unknown_sandbox", f"alert for unknown sandbox {sid!r}",
                                     kind="WatchdogAlert", event_id=eid))
            return
        if sb is not None and (sb.state == RECYCLED or sb.suspicious):
            return
        details = {
            "alert": "LOOP", "repeat_count": str(rec.get("repeat_count", 0)),
            "span_ms": str(rec.get("span_ms", 0)),
            "pattern": ";".join(str(p) for p in rec.get("pattern") or ()),
            "order": "cut_resources,terminate,drain_data",
        }
        reason = "watchdog: agent loop" + (f" ({rec['reason']})" if rec.get("reason") else "")
        if sb is None:  # running while still queued: terminate it; the request is withdrawn
            entry = self._queued_entry(sid)
            self._decide(out, DecisionKind.TERMINATE, reason, sandbox=sid, task=entry["task"],
                         tenant=entry["tenant"], request_id=entry["request_id"],
                         suspicious=True, details={**details, "queued": "true"}, causes=[eid])
            self._withdraw_queued(
                sid, out, "request withdrawn: the watchdog terminated the sandbox while it "
                "was queued (never placed)", [eid], suspicious=True)
            return
        sb.suspicious = True
        self._dirty_sb.add(sid)
        if sb.state in LEASED:
            self._start_drain(sb, out, DecisionKind.TERMINATE, reason, [eid], details)
        else:  # already draining: terminate it anyway, the grace window keeps running
            self._decide(out, DecisionKind.TERMINATE, reason, sb=sb, details=details,
                         causes=[eid])

    def _on_decision_ack(self, rec: dict[str, Any], h: dict[str, Any],
                         out: list[Output]) -> None:
        sid = h["sandbox"]
        sb = self._sb.get(sid)
        if sb is None and sid not in self._queued:
            out.append(DeadLetterOut("unknown_sandbox", f"decision ack for unknown sandbox "
                                     f"{sid!r}", kind="DecisionAck",
                                     event_id=h.get("event_id")))
            return
        outcome = rec["outcome"]
        if outcome == "DONE":
            self._count("decision_ack_done")
            return
        self._count("decision_ack_failed")
        what = rec["decision"]
        detail = rec.get("detail") or "no detail given"
        reason = f"the sandbox runtime could not carry out {what}: {detail}"
        details = {"decision": str(what), "decision_event_id": str(rec["decision_event_id"]),
                   "outcome": str(outcome)}
        if sb is not None:
            self._anomaly(out, reason, sid, sb.task, h.get("event_id"), details, sb=sb)
        else:
            self._anomaly(out, reason, sid, h.get("task"), h.get("event_id"), details)

    def _on_ignored(self, rec: dict[str, Any], h: dict[str, Any], out: list[Output]) -> None:
        self._count("decision_input_ignored")

    def _on_tick(self, rec: dict[str, Any], h: dict[str, Any], out: list[Output]) -> None:
        if self._queued_tenants:
            self._admit(out)
