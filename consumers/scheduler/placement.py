"""Node state and best-fit placement for the scheduler core (pure, no I/O, no clock).

Headroom model (how a node's report combines with reservations):

* The scheduler keeps a **ledger** per node: the CPU / memory / GPU share reserved by every
  sandbox it placed there that is not yet Recycled, plus the GPU share still **cooling**
  (released by a recycled sandbox, returned through a token bucket).
* A node **report** (about every 500 ms) says what the node itself sees free. Placements made at
  or after the report's event time cannot be reflected in it yet ("since-report" reservations).
* Effective free capacity is the more conservative of the two views::

      free = min(total - reserved - cooling,  reported_free - reserved_since_report)

  (cooling only exists for the GPU). So the node never gets more than the ledger allows, and
  capacity used by things the scheduler does not know about (system daemons, adopted sandboxes)
  still counts because the report shows it. A report older than the node's last report is stale
  and ignored; a node whose last report is older than ``node_stale_ms`` is not offered.

Scoring (higher is better), for every node where the request fits:

* ``fit`` = 100 × (1 - mean leftover fraction) over CPU, memory, and the GPU when the request
  asks for a share: best fit = least leftover fragmentation.
* ``affinity`` = ``affinity_cached_bonus`` (+50) when the request's data set is cached on the
  node, ``affinity_remote_penalty`` (-30) when it must be read remotely, 0 without a data set.
* ``gpu_reserve`` = -1000 for a CPU-only request on a node with a GPU, else 0: GPU nodes are
  kept for GPU work and get CPU-only sandboxes only when no other node fits (otherwise best fit
  fills them with CPU work and strands their GPU shares).
* ``total`` = fit + affinity + gpu_reserve; ties go to the lexicographically smallest node id.

GPU cooldown (token bucket): tokens accrue at ``gpu_cooldown_per_s`` shares/s up to
``burst`` shares; cooling shares are returned as tokens allow. The bucket is settled lazily and
the result does not depend on how often it is settled (so runs with and without ticks agree).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

EPS = 1e-9
GPU_RESERVE_PENALTY = -1000.0


def _clean(x: float) -> float:
    """Round away float residue so ledgers that should be 0 are exactly 0."""
    r = round(x, 9)
    return 0.0 if r == 0 else r


@dataclass(slots=True)
class NodeState:
    """One node: its last report, the scheduler's ledger and the GPU cooldown bucket."""

    node: str
    cpu_total: float = 0.0
    memory_total_mb: int = 0
    gpu_total: float = 0.0
    rep_cpu_free: float = 0.0
    rep_memory_free_mb: int = 0
    rep_gpu_free: float = 0.0
    network_free_mbps: float = 0.0
    datasets: frozenset[str] = frozenset()
    report_ms: int = -1
    report_event_id: str = ""
    # ledger: reservations of placed, not yet recycled sandboxes
    res_cpu: float = 0.0
    res_mem: int = 0
    res_gpu: float = 0.0
    sandboxes: set[str] = field(default_factory=set)
    # placements not yet reflected in the latest report: [place_ms, sandbox, cpu, mem, gpu]
    since: list[list[Any]] = field(default_factory=list)
    since_cpu: float = 0.0
    since_mem: int = 0
    since_gpu: float = 0.0
    # GPU cooldown token bucket
    gpu_cooling: float = 0.0
    gpu_tokens: float = 0.0
    gpu_settled_ms: int = -1

    # -- headroom ---------------------------------------------------------------------------
    def free_cpu(self) -> float:
        return min(self.cpu_total - self.res_cpu, self.rep_cpu_free - self.since_cpu)

    def free_mem(self) -> int:
        return min(self.memory_total_mb - self.res_mem, self.rep_memory_free_mb - self.since_mem)

    def free_gpu(self) -> float:
        """Free GPU share; call :meth:`settle_gpu` first for an up-to-date cooling figure."""
        return min(
            self.gpu_total - self.res_gpu - self.gpu_cooling, self.rep_gpu_free - self.since_gpu
        )

    # -- GPU cooldown ------------------------------------------------------------------------
    def settle_gpu(self, now_ms: int, rate_per_s: float, burst: float) -> None:
        """Advance the token bucket to ``now_ms`` (idempotent, path-independent)."""
        if self.gpu_settled_ms < 0:
            self.gpu_settled_ms = now_ms
            self.gpu_tokens = burst
            return
        dt = now_ms - self.gpu_settled_ms
        if dt <= 0:
            return
        self.gpu_settled_ms = now_ms
        accrued = rate_per_s * dt / 1000.0
        if self.gpu_cooling > 0:
            # While shares are cooling the bucket is empty (tokens are spent as they arrive).
            if accrued >= self.gpu_cooling:
                self.gpu_tokens = min(burst, accrued - self.gpu_cooling)
                self.gpu_cooling = 0.0
            else:
                self.gpu_cooling = _clean(self.gpu_cooling - accrued)
                self.gpu_tokens = 0.0
        else:
            self.gpu_tokens = min(burst, self.gpu_tokens + accrued)

    def cool_gpu(self, share: float, now_ms: int, rate_per_s: float, burst: float) -> None:
        """A recycled sandbox hands back ``share``: it enters the cooldown; tokens on hand
        return part of it at once, the rest trickles back at ``rate_per_s``."""
        self.settle_gpu(now_ms, rate_per_s, burst)
        self.gpu_cooling += share
        spend = min(self.gpu_tokens, self.gpu_cooling)
        self.gpu_tokens = _clean(self.gpu_tokens - spend)
        self.gpu_cooling = _clean(self.gpu_cooling - spend)

    # -- reports and reservations ------------------------------------------------------------
    def apply_report(self, rec: dict[str, Any], report_ms: int, event_id: str) -> None:
        self.cpu_total = float(rec["cpu_total"])
        self.memory_total_mb = int(rec["memory_total_mb"])
        self.gpu_total = float(rec.get("gpu_total", 0.0) or 0.0)
        self.rep_cpu_free = float(rec["cpu_free"])
        self.rep_memory_free_mb = int(rec["memory_free_mb"])
        self.rep_gpu_free = float(rec.get("gpu_free", 0.0) or 0.0)
        self.network_free_mbps = float(rec.get("network_free_mbps", 0.0) or 0.0)
        self.datasets = frozenset(rec.get("cached_datasets") or ())
        self.report_ms = report_ms
        self.report_event_id = event_id
        # Placements strictly before the report are reflected in it; keep the rest.
        if self.since:
            self.since = [s for s in self.since if s[0] >= report_ms]
            self._resum_since()

    def _resum_since(self) -> None:
        self.since_cpu = _clean(sum(s[2] for s in self.since))
        self.since_mem = sum(s[3] for s in self.since)
        self.since_gpu = _clean(sum(s[4] for s in self.since))

    def reserve(self, sandbox: str, cpu: float, mem: int, gpu: float, now_ms: int) -> None:
        self.res_cpu = _clean(self.res_cpu + cpu)
        self.res_mem += mem
        self.res_gpu = _clean(self.res_gpu + gpu)
        self.sandboxes.add(sandbox)
        self.since.append([now_ms, sandbox, cpu, mem, gpu])
        self.since_cpu = _clean(self.since_cpu + cpu)
        self.since_mem += mem
        self.since_gpu = _clean(self.since_gpu + gpu)

    def release(
        self, sandbox: str, cpu: float, mem: int, gpu: float, now_ms: int,
        rate_per_s: float, burst: float,
    ) -> None:
        """Free a recycled sandbox's reservation: CPU and memory at once, GPU via cooldown."""
        if sandbox not in self.sandboxes:
            return
        self.sandboxes.discard(sandbox)
        self.res_cpu = _clean(self.res_cpu - cpu)
        self.res_mem -= mem
        self.res_gpu = _clean(self.res_gpu - gpu)
        if any(s[1] == sandbox for s in self.since):
            self.since = [s for s in self.since if s[1] != sandbox]
            self._resum_since()
        if gpu > 0:
            self.cool_gpu(gpu, now_ms, rate_per_s, burst)

    # -- persistence -------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return {
            "node": self.node, "cpu_total": self.cpu_total,
            "memory_total_mb": self.memory_total_mb, "gpu_total": self.gpu_total,
            "rep_cpu_free": self.rep_cpu_free, "rep_memory_free_mb": self.rep_memory_free_mb,
            "rep_gpu_free": self.rep_gpu_free, "network_free_mbps": self.network_free_mbps,
            "datasets": sorted(self.datasets), "report_ms": self.report_ms,
            "report_event_id": self.report_event_id, "res_cpu": self.res_cpu,
            "res_mem": self.res_mem, "res_gpu": self.res_gpu,
            "sandboxes": sorted(self.sandboxes), "since": self.since,
            "gpu_cooling": self.gpu_cooling, "gpu_tokens": self.gpu_tokens,
            "gpu_settled_ms": self.gpu_settled_ms,
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> NodeState:
        n = cls(node=d["node"])
        for k in (
            "cpu_total", "memory_total_mb", "gpu_total", "rep_cpu_free", "rep_memory_free_mb",
            "rep_gpu_free", "network_free_mbps", "report_ms", "report_event_id", "res_cpu",
            "res_mem", "res_gpu", "gpu_cooling", "gpu_tokens", "gpu_settled_ms",
        ):
            setattr(n, k, d[k])
        n.datasets = frozenset(d["datasets"])
        n.sandboxes = set(d["sandboxes"])
        n.since = [list(s) for s in d["since"]]
        n._resum_since()
        return n


@dataclass(frozen=True, slots=True)
class Placement:
    node: str
    scores: dict[str, float]
    candidates: int
    affinity: str  # "cached" | "remote" | "none"


class Placer:
    """Chooses a node for a request over all fresh nodes (O(nodes) per request)."""

    def __init__(
        self, *, cached_bonus: float, remote_penalty: float, gpu_rate_per_s: float,
        gpu_burst: float, node_stale_ms: int,
    ) -> None:
        self.cached_bonus = cached_bonus
        self.remote_penalty = remote_penalty
        self.gpu_rate_per_s = gpu_rate_per_s
        self.gpu_burst = gpu_burst
        self.node_stale_ms = node_stale_ms

    def is_fresh(self, n: NodeState, now_ms: int) -> bool:
        return n.report_ms >= 0 and now_ms - n.report_ms <= self.node_stale_ms

    def choose(
        self, nodes: dict[str, NodeState], now_ms: int, cpu: float, mem: int, gpu: float,
        dataset: str | None,
    ) -> Placement | None:
        best: tuple[float, str] | None = None
        best_scores: dict[str, float] = {}
        best_aff = "none"
        candidates = 0
        stale = self.node_stale_ms
        for name, n in nodes.items():
            if n.report_ms < 0 or now_ms - n.report_ms > stale:
                continue
            fc = n.free_cpu()
            if fc + EPS < cpu:
                continue
            fm = n.free_mem()
            if fm < mem:
                continue
            lc = (fc - cpu) / n.cpu_total if n.cpu_total > 0 else 0.0
            lm = (fm - mem) / n.memory_total_mb if n.memory_total_mb > 0 else 0.0
            if gpu > 0:
                if n.gpu_total <= 0:
                    continue
                n.settle_gpu(now_ms, self.gpu_rate_per_s, self.gpu_burst)
                fg = n.free_gpu()
                if fg + EPS < gpu:
                    continue
                lg = (fg - gpu) / n.gpu_total
                fit = 100.0 * (1.0 - (lc + lm + lg) / 3.0)
                reserve = 0.0
            else:
                lg = 0.0
                fit = 100.0 * (1.0 - (lc + lm) / 2.0)
                # keep GPU nodes for GPU work: CPU-only goes there only when nothing else fits
                reserve = GPU_RESERVE_PENALTY if n.gpu_total > 0 else 0.0
            candidates += 1
            if dataset is None:
                aff = 0.0
                aff_kind = "none"
            elif dataset in n.datasets:
                aff = self.cached_bonus
                aff_kind = "cached"
            else:
                aff = self.remote_penalty
                aff_kind = "remote"
            total = fit + aff + reserve
            # Higher total wins; on a tie the smaller node id (deterministic).
            if best is None or total > best[0] + EPS or (
                abs(total - best[0]) <= EPS and name < best[1]
            ):
                best = (total, name)
                best_aff = aff_kind
                best_scores = {
                    "fit": round(fit, 6), "affinity": aff, "total": round(total, 6),
                    "leftover_cpu": round(lc, 6), "leftover_mem": round(lm, 6),
                    "leftover_gpu": round(lg, 6), "gpu_reserve": reserve,
                }
        if best is None:
            return None
        return Placement(node=best[1], scores=best_scores, candidates=candidates,
                         affinity=best_aff)

    def could_ever_fit(
        self, nodes: dict[str, NodeState], now_ms: int, cpu: float, mem: int, gpu: float
    ) -> bool | None:
        """Whether any fresh node is big enough in total; None when no node is fresh."""
        fresh = [n for n in nodes.values() if self.is_fresh(n, now_ms)]
        if not fresh:
            return None
        return any(
            n.cpu_total + EPS >= cpu and n.memory_total_mb >= mem
            and (gpu <= 0 or n.gpu_total + EPS >= gpu)
            for n in fresh
        )
