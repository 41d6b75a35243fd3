"""The scheduler's pure core: sandbox lifecycle, leases, drain-before-recycle, placement and
tenant credit (issue 6). The Kafka shell around it feeds decoded Avro dicts to
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
"""

from __future__ import annotations

import heapq
import json
import math
import uuid
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from trajbus.bus.settings import SchedulerSettings
from trajbus.consumers.scheduler.placement import EPS, NodeState, Placement, Placer, _clean
from trajbus.schemas.models import DecisionKind, Envelope, SchedulingDecision

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
_NS = uuid.uuid5(uuid.NAMESPACE_URL, "https://trajbus/scheduler/decision")
_MAX_PROBE_IDS = 8


# -- outputs -------------------------------------------------------------------------------
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


# -- state ---------------------------------------------------------------------------------
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


# -- the core ------------------------------------------------------------------------------
class SchedulerCore:
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
                    out.append(DeadLetterOut("invalid_record", f"{kind}: {exc!r}", kind))
                return out
            return [DeadLetterOut("unknown_kind", f"scheduler does not consume {kind!r}", kind)]
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
            out.append(DeadLetterOut("invalid_record", f"{kind}: {exc!r}", kind,
                                     eid if isinstance(eid, str) else None))
        return out

    def tick(self, now_ms: int, event_id: str | None = None) -> list[Output]:
        """Time passes to ``now_ms``: fire due deadlines, retry queued requests."""
        out: list[Output] = []
        if now_ms > self._now:
            self._advance(now_ms, out)
        if self._queued_tenants:
            self._admit(out)
        return out

    def take_dirty(self) -> dict[str, bytes | None]:
        """Changed state since the last call, for the changelog (None = key deleted)."""
        keys = [f"sandbox/{k}" for k in self._dirty_sb]
        keys += [f"node/{k}" for k in self._dirty_node]
        keys += [f"tenant/{k}" for k in self._dirty_tenant]
        if self._dirty_meta or self._now != self._taken_now:
            keys.append(_META)
        res = {key: self._serialize(key) for key in sorted(keys)}
        self._dirty_sb.clear()
        self._dirty_node.clear()
        self._dirty_tenant.clear()
        self._dirty_meta = False
        self._taken_now = self._now
        return res

    def snapshot(self) -> dict[str, bytes]:
        """The whole state as changelog records (what a fully compacted changelog holds)."""
        keys = [_META]
        keys += [f"sandbox/{k}" for k in self._sb]
        keys += [f"node/{k}" for k in self._nodes]
        keys += [f"tenant/{k}" for k in self._tenants]
        snap = {}
        for k in sorted(keys):
            blob = self._serialize(k)
            if blob is not None:
                snap[k] = blob
        return snap

    def restore(self, key: str, blob: bytes | None) -> None:
        """Load one changelog record (the latest per key, any order; ``None`` deletes)."""
        kind, _, name = key.partition("/")
        if kind == _META:
            if blob is not None:
                d = json.loads(blob)
                self._now, self._seq, self._arrival = d["now_ms"], d["seq"], d["arrival"]
                self.stats = dict(d["stats"])
            return
        if kind == "sandbox":
            if blob is None:
                self._sb.pop(name, None)
                return
            sb = SandboxState.from_dict(json.loads(blob))
            self._sb[name] = sb
            self._schedule_sandbox(sb)
        elif kind == "node":
            if blob is None:
                self._nodes.pop(name, None)
            else:
                self._nodes[name] = NodeState.from_dict(json.loads(blob))
        elif kind == "tenant":
            old = self._tenants.pop(name, None)
            if old is not None:
                for e in old.queue:
                    self._queued.pop(e["sandbox"], None)
                self._queued_tenants.discard(name)
            if blob is None:
                return
            t = TenantState.from_dict(json.loads(blob))
            self._tenants[name] = t
            for e in t.queue:
                self._queued[e["sandbox"]] = name
            if t.queue:
                self._queued_tenants.add(name)
            if t.over_since_ms is not None and not t.demoted:
                heapq.heappush(
                    self._heap, (t.over_since_ms + self.settings.tenant_burst_max_ms, _BURST,
                                 name))

    def restore_snapshot(self, snap: dict[str, bytes | None]) -> None:
        for key in sorted(snap):
            self.restore(key, snap[key])

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
        out.append(DecisionOut(
            decision=value, reason=reason, time_ms=self._now, seq=self._seq,
            sandbox=sandbox, task=task, node=node, tenant=tenant, request_id=request_id,
            suspicious=suspicious, scores=scores or {}, details=details or {},
            cause_event_ids=tuple(filter(None, causes)),
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

    # -- lifecycle ------------------------------------------------------------------------------
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
                                     "Heartbeat", h.get("event_id")))
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
                                     "LivenessProbe", h.get("event_id")))
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
                                         "TrainerRelease", eid))
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
                                     "WatchdogAlert", eid))
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
                                     f"{sid!r}", "DecisionAck", h.get("event_id")))
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

    # -- drain / recycle ----------------------------------------------------------------------
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
                                     "Drained", eid))
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

    # -- placement / tenants ------------------------------------------------------------------
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

    # -- persistence helpers ------------------------------------------------------------------
    def _serialize(self, key: str) -> bytes | None:
        kind, _, name = key.partition("/")
        if kind == _META:
            return _dumps({"now_ms": self._now, "seq": self._seq, "arrival": self._arrival,
                           "stats": self.stats})
        if kind == "sandbox":
            sb = self._sb.get(name)
            return None if sb is None else _dumps(sb.to_dict())
        if kind == "node":
            n = self._nodes.get(name)
            return None if n is None else _dumps(n.to_dict())
        t = self._tenants.get(name)
        return None if t is None else _dumps(t.to_dict())

    def _cooling_view(self, n: NodeState, now: int) -> float:
        """GPU share still cooling at ``now``, without settling (status is a pure read)."""
        if n.gpu_cooling <= 0 or n.gpu_settled_ms < 0 or now <= n.gpu_settled_ms:
            return n.gpu_cooling
        return max(0.0, n.gpu_cooling - self._gpu_rate * (now - n.gpu_settled_ms) / 1000.0)
