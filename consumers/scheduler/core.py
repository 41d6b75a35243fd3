"""The scheduler's pure core: sandbox lifecycle, leases, drain-before-recycle, placement and
tenant credit. The Kafka shell around it feeds decoded Avro dicts to
:meth:`SchedulerCore.handle` and publishes what comes back.

Guarantees
==========

* **Pure and deterministic.** No wall clock, no randomness, no I/O. The core's clock ``now`` is
  the monotonic maximum of every input's ``header.event_time_ms`` and of :meth:`tick`. Feeding the
  same inputs (from the same restored state) yields the same outputs, byte for byte once turned
  into :class:`~trajbus.schemas.models.SchedulingDecision` (event ids are uuid5 of the
  decision's identity). Iteration that can reach an output is in a fixed order.
* **Time first, then the event.** When an input moves ``now`` forward, every deadline that falls
  due up to the new ``now`` fires first, in deadline order, and each such decision is stamped with
  its deadline (not with the time it was noticed). Hence an event log gives the same
  deadline-driven decisions with or without interleaved ticks; ticks only make them come out
  sooner (and give queued requests a chance when GPU shares come back from cooldown).
* **Never raises on input.** Malformed records and unknown kinds come back as
  :class:`DeadLetterOut`; lifecycle violations as ``ANOMALY`` decisions. Neither changes state,
  except that a record whose header carries a valid ``event_time_ms`` still advances time.
* **Drain before recycle.** A sandbox's node reservation (its "slot") and its tenant credit are
  only released when it becomes Recycled, and that only happens when the drain is confirmed or
  the grace window ends. So no new sandbox is ever offered a slot whose data may still be in flight.

Inputs (``handle(kind, record)``; ``record["header"]`` is the Envelope)
====================================================================

``SandboxLifecycle``
    Reported state changes. Legal steps: (placed) -> PROVISIONING -> ACTIVE -> DRAINING ->
    RECYCLED, plus (placed) / PROVISIONING -> DRAINING, taken from the sandbox's last reported
    state or from the scheduler's state (so a sandbox told to drain may report RECYCLED straight
    away); a repeat of the last reported state is a no-op. Anything else is an illegal
    transition: an ``ANOMALY`` decision, nothing changes. A legal report only moves the
    scheduler's state forward: reports that lag the scheduler's own decisions (ACTIVE arriving
    after a RECLAIM, DRAINING after the RECYCLE) are no-ops. A reported DRAINING (the sandbox
    drains on its own) starts the grace window, recorded as a ``DRAIN`` decision. A reported
    RECYCLED while DRAINING is noted (``reported_recycled``) but the slot still waits for the
    drain confirmation or the grace window: the scheduler alone frees slots. PROVISIONING for an
    unknown sandbox *adopts* it (node/tenant from the event, no reservation); any other state for
    an unknown sandbox is an ``ANOMALY``. For a sandbox whose request is still **queued**:
    PROVISIONING / ACTIVE is an ``ANOMALY`` (it runs without a placement); DRAINING / RECYCLED
    withdraws the request (see *Queued sandboxes*).
``Heartbeat``
    Renews the lease of a placed / provisioning / active sandbox:
    ``deadline = max(deadline, event_time + min(lease_ttl_ms, missed × heartbeat_interval))``
    (10 min by default either way). The lease covers its deadline (a heartbeat stamped exactly
    at the deadline renews it); once ``now`` has passed it (``deadline + 1``): ``RECLAIM``,
    stamped ``deadline + 1``, and the drain starts. The reason and ``details.missed_heartbeats``
    give the heartbeats that fell due since the last renewal and did not come:
    ``(reclaim time - last renewal) // heartbeat_interval`` (2 by default; fewer when a short
    lease TTL ran out first). A heartbeat newer than a sandbox's recycle time is an
    ``ANOMALY`` (zombie).
``LivenessProbe``
    ``liveness_failures_to_drain`` (3) consecutive failures -> ``DRAIN``; a success resets.
``TrainerRelease``
    ``DRAIN`` ("no longer needed"). For a request still queued: the request is withdrawn.
``WatchdogAlert``
    The watchdog input taken by the scheduler is the **alert**: ``alert == LOOP`` and
    ``dry_run == False`` -> ``TERMINATE`` with ``suspicious=True``, the sandbox is marked
    suspicious (every later decision about it carries the flag) and drains. Other alerts and
    dry-run alerts are ignored. The watchdog's own ``SchedulingDecision`` (TERMINATE) is *not* an
    input: the scheduler publishes to the decisions topic and must not consume its own stream
    (``handle("SchedulingDecision", ...)`` is accepted and ignored).
``Drained``
    The emitter's flush report: final sequence per open episode, ``complete``, ``unflushed``.
    From a sandbox still queued: the request is withdrawn.
``DecisionAck``
    The sandbox runtime's answer to a decision about it (a TERMINATE): ``DONE`` is counted
    (``stats["decision_ack_done"]``); ``FAILED`` is an ``ANOMALY`` naming the decision and the
    runtime's detail. Either way nothing else changes: the drain that TERMINATE started runs on.
``ReplayAck`` (not an Avro kind; the shell builds it)
    ``{"sandbox": str, "episode": str, "last_seq": int, "event_time_ms": int (optional),
    "event_id": str (optional)}``: downstream (the ordered-replay stage) has processed the
    episode's events **contiguously up to and including** ``last_seq``. Cumulative: the maximum
    is kept. The shell derives it from each ``ReplaySegment`` it sees for a sandbox with
    ``gap`` null (``sandbox, episode = header.sandbox, header.episode``, ``last_seq``).
``NodeReport``
    Node headroom (see :mod:`trajbus.consumers.scheduler.placement` for how reports combine with
    reservations). A report older than the node's last one is ignored.
``SandboxRequest``
    The sandbox id is ``header.sandbox``. Outcomes: ``PLACE`` (reserves CPU/memory/GPU on the
    node until Recycled), ``QUEUE`` (``details.position`` = 1-based place in the tenant's FIFO
    queue, ``details.cause`` = credit | capacity | fifo), or ``ANOMALY`` when it can never be
    satisfied (above ``burst × credit``, or larger than every node). A redelivered request (same
    request id) is ignored.
``Tick``
    Time passes (``header.event_time_ms``); queued requests are retried.

Tenant credit (CPU cores)
=========================

Usage = CPU reserved by the tenant's sandboxes not yet Recycled (draining ones still count).
A request is admitted while ``usage + cpu <= burst_factor × credit`` (1.5×); once usage is above
credit for ``tenant_burst_max_ms`` without a break the tenant is **demoted** (``DEMOTE``): while
demoted it is admitted only up to 1.0× credit, and its queue yields to non-demoted tenants.
Demotion lifts when usage drops back to credit. Queues are FIFO per tenant; when credit or
capacity frees (a recycle, a node report with more headroom, a tick, a withdrawn request) heads
are retried in order (non-demoted first, then arrival), each admission giving ``ADMIT`` then
``PLACE``.

Queued sandboxes
================

A sandbox whose request waits in a queue is known; it holds no node and no credit, and its lease
starts when it is placed. A runtime that waits for its placement sends nothing meanwhile;
from one that does not:

* heartbeats and liveness probes are counted (``stats``: ``queued_heartbeat``,
  ``queued_probe``) and otherwise ignored: there is no lease to renew and nothing placed to
  drain (never a dead letter);
* PROVISIONING / ACTIVE is an ``ANOMALY`` (it runs without a placement);
* the sandbox ending before placement -- it reports DRAINING or RECYCLED, sends ``Drained``,
  the trainer releases it, or a watchdog LOOP alert (``TERMINATE`` first) -- **withdraws** the
  request: it leaves the queue and a ``RECYCLE`` with ``details.queued = "true"`` closes it. It
  is never placed afterwards, so nothing is reserved for a sandbox that is gone. It is kept as a
  Recycled record without node or credit (``recycled_retention_ms``, like any recycled
  sandbox), so the rest of its ending and a redelivered request are recognised as no-ops.

Persistence
===========

:meth:`SchedulerCore.take_dirty` returns ``{key: json bytes | None}`` for every key changed since
the last call (``sandbox/<id>``, ``node/<id>``, ``tenant/<name>``, ``meta``; ``None`` = deleted);
a compacted changelog of those keys restores a worker with :meth:`SchedulerCore.restore`. Write a
whole batch before committing input offsets. Recycled sandboxes are kept
``recycled_retention_ms`` (duplicates and zombies stay recognisable), then deleted.

Modules
=======

:class:`SchedulerCore` (here: construction, ``handle`` / ``tick``, time, read-only views)
composes one mixin per concern over :class:`~.base.SchedulerBase` (the shared fields, the
decision recorder, the deadline heap): :mod:`.lifecycle` (what sandboxes report),
:mod:`.drain` (drain before recycle), :mod:`.admission` (requests, tenant credit, queues,
placement) and :mod:`.persistence` (changelog records). :mod:`.outputs` holds the decisions and
dead letters it returns, :mod:`.state` the state records, :mod:`.placement` node state and
best-fit placement.
"""

from __future__ import annotations

import heapq
from typing import Any

from trajbus.bus.settings import SchedulerSettings
from trajbus.consumers.scheduler.admission import AdmissionMixin
from trajbus.consumers.scheduler.drain import DrainMixin
from trajbus.consumers.scheduler.lifecycle import LifecycleMixin
from trajbus.consumers.scheduler.outputs import DeadLetterOut, DecisionOut, Output
from trajbus.consumers.scheduler.persistence import PersistenceMixin
from trajbus.consumers.scheduler.placement import NodeState, Placer
from trajbus.consumers.scheduler.state import (
    _BURST,
    _DRAIN,
    _LEASE,
    _STATE_ORDER,
    DRAINING,
    LEASED,
    RECYCLED,
    SandboxState,
    TenantState,
)

__all__ = [
    "REPLAY_ACK",
    "DeadLetterOut",
    "DecisionOut",
    "NodeState",
    "Output",
    "SandboxState",
    "SchedulerCore",
    "TenantState",
]

REPLAY_ACK = "ReplayAck"


class SchedulerCore(LifecycleMixin, DrainMixin, AdmissionMixin, PersistenceMixin):
    """See the module docstring for the rules. Extra knobs beyond :class:`SchedulerSettings`
    come as constructor arguments (defaults are the reference behaviour)."""

    def __init__(
        self,
        settings: SchedulerSettings | None = None,
        tenant_credit: dict[str, float] | None = None,
        *,
        node_stale_ms: int = 10_000,
        gpu_cooldown_burst: float | None = None,
        recycled_retention_ms: int = 600_000,
        lease_warning_ms: int = 60_000,
    ) -> None:
        self.settings = s = settings or SchedulerSettings()
        self.tenant_credit = dict(tenant_credit or {})
        self.recycled_retention_ms = recycled_retention_ms
        self.lease_warning_ms = lease_warning_ms
        self._default_ttl = s.lease_ttl_ms
        self._lease_window = min(s.lease_ttl_ms, s.missed_heartbeats_to_reclaim
                                 * s.heartbeat_interval_ms)
        self._gpu_rate = s.gpu_cooldown_per_s
        self._gpu_burst = s.gpu_cooldown_per_s if gpu_cooldown_burst is None \
            else gpu_cooldown_burst
        self.placer = Placer(
            cached_bonus=s.affinity_cached_bonus, remote_penalty=s.affinity_remote_penalty,
            gpu_rate_per_s=self._gpu_rate, gpu_burst=self._gpu_burst,
            node_stale_ms=node_stale_ms,
        )
        self._now = -(2**62)
        self._seq = 0
        self._arrival = 0
        self.stats: dict[str, int] = {}
        self._sb: dict[str, SandboxState] = {}
        self._nodes: dict[str, NodeState] = {}
        self._tenants: dict[str, TenantState] = {}
        self._queued: dict[str, str] = {}  # sandbox -> tenant, for queued requests
        self._queued_tenants: set[str] = set()
        self._heap: list[tuple[int, int, str]] = []
        self._dirty_sb: set[str] = set()
        self._dirty_node: set[str] = set()
        self._dirty_tenant: set[str] = set()
        self._dirty_meta = False
        self._taken_now = self._now
        self._handlers = {
            "SandboxLifecycle": self._on_lifecycle,
            "Heartbeat": self._on_heartbeat,
            "LivenessProbe": self._on_probe,
            "TrainerRelease": self._on_release,
            "WatchdogAlert": self._on_watchdog,
            "Drained": self._on_drained,
            "NodeReport": self._on_node_report,
            "SandboxRequest": self._on_request,
            "Tick": self._on_tick,
            "SchedulingDecision": self._on_ignored,
            "DecisionAck": self._on_decision_ack,
        }

    # -- public API -------------------------------------------------------------------------
    @property
    def now_ms(self) -> int:
        return self._now

    def handle(self, kind: str, record: dict[str, Any]) -> list[Output]:
        """Apply one decoded input; returns its decisions / dead letters (never raises)."""
        out: list[Output] = []
        handler = self._handlers.get(kind)
        if handler is None:
            if kind == REPLAY_ACK:
                try:
                    self._on_ack(record, out)
                except (KeyError, TypeError, ValueError, AttributeError) as exc:
                    out.append(DeadLetterOut("invalid_record", f"{kind}: {exc!r}", kind=kind))
                return out
            return [DeadLetterOut("unknown_kind", f"scheduler does not consume {kind!r}",
                                  kind=kind)]
        try:
            header = record["header"]
            t = header["event_time_ms"]
            if type(t) is not int:
                raise ValueError(f"event_time_ms must be an int, got {t!r}")
            if t > self._now:
                heap = self._heap
                if heap and heap[0][0] <= t:
                    self._advance(t, out)
                else:
                    self._now = t
            handler(record, header, out)
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            eid = record.get("header", {}).get("event_id") if isinstance(record, dict) \
                and isinstance(record.get("header"), dict) else None
            out.append(DeadLetterOut("invalid_record", f"{kind}: {exc!r}", kind=kind,
                                     event_id=eid if isinstance(eid, str) else None))
        return out

    def tick(self, now_ms: int, event_id: str | None = None) -> list[Output]:
        """Time passes to ``now_ms``: fire due deadlines, retry queued requests."""
        out: list[Output] = []
        if now_ms > self._now:
            self._advance(now_ms, out)
        if self._queued_tenants:
            self._admit(out)
        return out

    # read-only accessors (tests, status)
    def sandbox(self, sandbox: str) -> SandboxState | None:
        return self._sb.get(sandbox)

    def node(self, node: str) -> NodeState | None:
        return self._nodes.get(node)

    def tenant(self, tenant: str) -> TenantState | None:
        return self._tenants.get(tenant)

    def queued(self, tenant: str) -> list[dict[str, Any]]:
        t = self._tenants.get(tenant)
        return list(t.queue) if t else []

    def can_place_now(self, cpu: float, memory_mb: int, gpu_share: float = 0.0,
                      dataset: str | None = None) -> bool:
        """Whether some fresh node has room right now (ignores credit)."""
        return self.placer.choose(self._nodes, self._now, cpu, memory_mb, gpu_share,
                                  dataset) is not None

    def status(self, now_ms: int | None = None) -> dict[str, Any]:
        """For ``trajbus scheduler status``: sandboxes by state, leases close to expiry
        (within ``lease_warning_ms``), queued requests per tenant, nodes by headroom. Pure read:
        ``now_ms`` (default: the core's time) only positions the view."""
        now = self._now if now_ms is None else now_ms
        by_state = dict.fromkeys(_STATE_ORDER, 0)
        expiring = []
        draining = []
        for sb in self._sb.values():
            by_state[sb.state] += 1
            if sb.state in LEASED and sb.lease_deadline - now <= self.lease_warning_ms:
                expiring.append({
                    "sandbox": sb.sandbox, "state": sb.state, "node": sb.node,
                    "tenant": sb.tenant, "lease_deadline_ms": sb.lease_deadline,
                    "remaining_ms": sb.lease_deadline - now,
                })
            elif sb.state == DRAINING:
                draining.append({
                    "sandbox": sb.sandbox, "reason": sb.drain_reason,
                    "grace_ends_ms": sb.drain_deadline,
                    "drained": sb.drained is not None, "suspicious": sb.suspicious,
                })
        expiring.sort(key=lambda e: (e["lease_deadline_ms"], e["sandbox"]))
        draining.sort(key=lambda e: (e["grace_ends_ms"], e["sandbox"]))
        tenants = {}
        for name in sorted(self._tenants):
            t = self._tenants[name]
            tenants[name] = {
                "queued": len(t.queue), "usage_cpu": t.usage, "credit_cpu": t.credit,
                "limit_cpu": t.limit(self.settings.tenant_burst_factor), "demoted": t.demoted,
                "over_since_ms": t.over_since_ms,
                "oldest_queued_ms": t.queue[0]["queued_ms"] if t.queue else None,
            }
        nodes: list[dict[str, Any]] = []
        for name, n in self._nodes.items():
            cooling = self._cooling_view(n, now)
            nodes.append({
                "node": name, "fresh": self.placer.is_fresh(n, now),
                "cpu_free": round(n.free_cpu(), 6), "cpu_total": n.cpu_total,
                "memory_free_mb": n.free_mem(), "memory_total_mb": n.memory_total_mb,
                "gpu_free": round(min(n.gpu_total - n.res_gpu - cooling,
                                      n.rep_gpu_free - n.since_gpu), 6),
                "gpu_cooling": round(cooling, 6), "gpu_total": n.gpu_total,
                "network_free_mbps": n.network_free_mbps, "sandboxes": len(n.sandboxes),
                "cached_datasets": sorted(n.datasets), "report_age_ms": now - n.report_ms,
            })
        nodes.sort(key=lambda e: (-e["cpu_free"], -e["memory_free_mb"], e["node"]))
        return {
            "now_ms": now, "sandboxes_by_state": by_state, "leases_expiring": expiring,
            "draining": draining, "queued_by_tenant": tenants, "nodes_by_headroom": nodes,
            "stats": dict(sorted(self.stats.items())),
        }

    # -- time -------------------------------------------------------------------------------
    def _advance(self, t: int, out: list[Output]) -> None:
        heap = self._heap
        while heap and heap[0][0] <= t:
            d, kind, key = heapq.heappop(heap)
            if d > self._now:
                self._now = d
            if kind == _LEASE:
                sb = self._sb.get(key)
                if sb is None or sb.lease_q != d or sb.state not in LEASED:
                    continue
                expiry = sb.lease_deadline + 1
                if expiry > d:  # renewed since this entry was pushed
                    sb.lease_q = expiry
                    heapq.heappush(heap, (expiry, _LEASE, key))
                    continue
                self._reclaim(sb, out)
            elif kind == _DRAIN:
                sb = self._sb.get(key)
                if sb is not None and sb.state == DRAINING and sb.drain_deadline == d:
                    self._grace_expired(sb, out)
            elif kind == _BURST:
                tn = self._tenants.get(key)
                if (tn is not None and not tn.demoted and tn.over_since_ms is not None
                        and tn.over_since_ms + self.settings.tenant_burst_max_ms == d):
                    self._demote(tn, out)
            else:  # _PURGE
                sb = self._sb.get(key)
                if (sb is not None and sb.state == RECYCLED
                        and sb.recycled_ms + self.recycled_retention_ms == d):
                    del self._sb[key]
                    self._dirty_sb.add(key)
        if t > self._now:
            self._now = t

    def _cooling_view(self, n: NodeState, now: int) -> float:
        """GPU share still cooling at ``now``, without settling (status is a pure read)."""
        if n.gpu_cooling <= 0 or n.gpu_settled_ms < 0 or now <= n.gpu_settled_ms:
            return n.gpu_cooling
        return max(0.0, n.gpu_cooling - self._gpu_rate * (now - n.gpu_settled_ms) / 1000.0)
