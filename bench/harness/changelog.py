"""An aged reorder state changelog: real state blobs re-keyed per episode (``Blobs``), the
plain producer that writes them (``Writer``), one changelog partition's simulated episodes
(``Partition``), and one in-process restore of the worker's cores from it
(``restore_once``)."""

from __future__ import annotations

import heapq
import logging
import os
import random
import struct
import time
from typing import Any

from harness.worklog import RESTORED_RE

_FIXED = struct.Struct("<qqqqqqqqqBI")  # the reorder core's episode fields (core._pack)
_ACTIVE = 3  # last activity (core clock, ms): the idle timer counts from it
_TIMES = (2, 3, 4, 7, 8)  # last event time, active, gap since, recycle at, expire at


class Blobs:
    """Real reorder state blobs (an open and a closed episode with a full dedupe ring), re-keyed
    per episode with a fresh random ring."""

    def __init__(self) -> None:
        from trajbus.bus.settings import read_settings
        from trajbus.consumers.engine.processors import ReorderProcessor
        from trajbus.consumers.engine.runner import InRecord
        from trajbus.schemas import models as m

        proc = ReorderProcessor(read_settings())
        t0 = int(time.time() * 1000)
        rng = random.Random(7)
        recs = []
        for i, end in ((0, False), (1, True)):
            sb, ep = f"sb-{i:06d}", f"ep-{i:08d}"

            def hdr(seq: int, sb: str = sb, ep: str = ep) -> m.Envelope:
                return m.Envelope(event_id=f"{ep}-{seq}", task="bench", sandbox=sb, episode=ep,
                                  seq=seq, event_time_ms=t0 + seq * 100,
                                  producer_id=f"sandbox/{sb}")

            evs: list[m.Event] = [m.EpisodeStart(header=hdr(0))]
            for c in range(40):
                evs.append(m.ToolCall(header=hdr(2 * c + 1), call_id=f"c{c}", tool="shell",
                                      args_hash=f"{rng.getrandbits(256):064x}"))
                evs.append(m.ToolResult(header=hdr(2 * c + 2), call_id=f"c{c}", tool="shell",
                                        status=m.ToolStatus.OK,
                                        result_hash=f"{rng.getrandbits(256):064x}"))
            if end:
                evs.append(m.EpisodeEnd(header=hdr(81), outcome=m.EpisodeOutcome.TERMINAL))
            recs += [InRecord("in", 0, len(recs) + j, sb.encode(), e.encode(), t0)
                     for j, e in enumerate(evs)]
        proc.handle_batch(recs)
        dirty = proc.take_dirty()
        self.open = self._template(dirty["sb-000000/ep-00000000"] or b"")
        self.closed = self._template(dirty["sb-000001/ep-00000001"] or b"")
        self.clock = dirty["@clock"] or b""
        self._rand = b""
        self._pos = 0

    @staticmethod
    def _template(blob: bytes) -> tuple[bytes, list[int], int, bytes]:
        """(tag + task, fixed fields, ring length, the rest) of a blob."""
        off = 2
        parts = []
        for _ in range(3):  # task, sandbox, episode
            (n,) = struct.unpack_from("<I", blob, off)
            parts.append((off, n))
            off += 4 + n
        head = blob[: parts[1][0]]
        fixed = list(_FIXED.unpack_from(blob, off))
        ring_len = fixed[-1]
        rest = blob[off + _FIXED.size + 8 * ring_len:]
        return head, fixed, ring_len, rest

    def _ring(self, n: int) -> bytes:
        if self._pos + n > len(self._rand):
            self._rand, self._pos = os.urandom(max(n, 1 << 22)), 0
        self._pos += n
        return self._rand[self._pos - n: self._pos]

    def blob(self, sb: str, ep: str, closed: bool = False, at_ms: int | None = None) -> bytes:
        """The state of episode ``sb``/``ep``; ``at_ms``: the core's clock when it was written
        (its last activity, hence its idle timer; a closed one's delete ``tombstone_ttl`` later),
        so that a worker restoring it fires its timers when the history says (default: the
        time the template was built)."""
        head, fixed, ring_len, rest = self.closed if closed else self.open
        if at_ms is not None:
            fixed = list(fixed)
            shift = at_ms - fixed[_ACTIVE]
            for i in _TIMES:
                if fixed[i] >= 0:
                    fixed[i] += shift
        sbb, epb = sb.encode(), ep.encode()
        return b"".join((head, struct.pack("<I", len(sbb)), sbb, struct.pack("<I", len(epb)),
                         epb, _FIXED.pack(*fixed), self._ring(8 * ring_len), rest))

    def clock_at(self, at_ms: int | None) -> bytes:
        """The ``@clock`` record of a core whose clock reads ``at_ms``."""
        return self.clock if at_ms is None else self.clock[:2] + struct.pack("<q", at_ms)


class Writer:
    def __init__(self, bootstrap: str, topic: str) -> None:
        from confluent_kafka import Producer

        self.topic = topic
        self.errors: list[str] = []
        self.records = 0
        self.bytes = 0
        self.p = Producer({"bootstrap.servers": bootstrap, "compression.type": "lz4",
                           "linger.ms": 5, "batch.size": 1_048_576, "enable.idempotence": True,
                           "queue.buffering.max.messages": 2_000_000,
                           "queue.buffering.max.kbytes": 1_048_576})

    def _cb(self, err: Any, _msg: Any) -> None:
        if err is not None:
            self.errors.append(str(err))

    def put(self, partition: int, key: str, value: bytes | None) -> None:
        k = key.encode()
        while True:
            try:
                self.p.produce(self.topic, value, key=k, partition=partition, on_delivery=self._cb)
                break
            except BufferError:
                self.p.poll(0.05)
        self.records += 1
        self.bytes += len(k) + (len(value) if value else 0)
        if self.records % 20_000 == 0:
            self.p.poll(0)

    def flush(self) -> None:
        if self.p.flush(120) or self.errors:
            raise RuntimeError(f"producing to {self.topic}: {self.errors[:3] or 'flush timed out'}")


class Partition:
    """One changelog partition's simulated episodes (keys i = partition mod P)."""

    def __init__(self, p: int, n_partitions: int, open_eps: int, closed_eps: int,
                 ttl_s: float, start_index: int) -> None:
        self.p = p
        self.step = n_partitions
        self.next_i = start_index + p
        self.open: list[str] = [self._new() for _ in range(open_eps)]
        # (due simulated time, key) of closed episodes still remembered
        self.deletes: list[tuple[float, str]] = [
            (ttl_s * (j + 0.5) / max(1, closed_eps), self._new()) for j in range(closed_eps)]
        self.closed_initial = list(self.deletes)
        self.in_changelog: set[str] = set(self.open)  # open episodes with a state written
        heapq.heapify(self.deletes)
        self.written = 0

    def _new(self) -> str:
        i = self.next_i
        self.next_i += self.step
        return f"sb-{i % 1_000_000:06d}/ep-{i:08d}"


async def restore_once(bootstrap: str, prefix: str, partitions: int) -> dict[str, Any]:
    from aiokafka import TopicPartition

    from trajbus.bus.settings import KafkaSettings, Settings, TopicSettings
    from trajbus.consumers.engine.processors import reorder_spec
    from trajbus.consumers.engine.runner import Runner

    settings = Settings(kafka=KafkaSettings(bootstrap_servers=bootstrap),
                        topics=TopicSettings(prefix=prefix, partitions=partitions))
    runner = Runner(settings, reorder_spec(settings), "bench")
    lines: list[str] = []

    class Grab(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            lines.append(record.getMessage())

    lg = logging.getLogger("trajbus.ops")  # where the runner logs its restore line
    handler = Grab()
    lg.addHandler(handler)
    lg.setLevel(logging.INFO)
    t = time.monotonic()
    try:
        await runner._restore([TopicPartition(f"{prefix}.sandbox.events", p)
                               for p in range(partitions)])
    finally:
        lg.removeHandler(handler)
    wall = time.monotonic() - t
    m = next((m for m in map(RESTORED_RE.search, lines) if m), None)
    if m is None:
        raise RuntimeError(f"no restore line in {lines}")
    eps = sum(len(getattr(c, "core", c)._eps) for c in runner.cores.values())
    return {"records": int(m.group(1)), "restore_s": float(m.group(3)), "wall_s": round(wall, 3),
            "episodes_in_cores": eps}
