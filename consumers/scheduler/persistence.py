"""The scheduler core's state as changelog records: ``sandbox/<id>``, ``node/<id>``,
``tenant/<name>`` and ``meta``, each a JSON object (``None``: deleted). A compacted changelog
of them restores a core to the same state, deadlines included."""

from __future__ import annotations

import heapq
import json

from trajbus.consumers.scheduler.base import SchedulerBase
from trajbus.consumers.scheduler.placement import NodeState
from trajbus.consumers.scheduler.state import _BURST, _META, SandboxState, TenantState, _dumps


class PersistenceMixin(SchedulerBase):
    """The scheduler core's changelog records (see the module docstring)."""

    # SchedulerBase's fields, typed here too (mypy does not follow trajbus.* imports)
    _dirty_meta: bool
    _taken_now: int

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
