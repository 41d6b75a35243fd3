"""The closed loop of a simulated fleet: :class:`Placements` reads the scheduler's decisions
about the fleet's requests from ``Topics.decisions`` (from the end offsets it had before the
first request, read_committed) and tells each waiting sandbox when it is placed, withdrawn or
refused, and which TERMINATE concerns it.

Guarantees: a sandbox registers (:meth:`Placements.expect`) before it sends its request, so no
decision about it is missed; every wait is bounded and ends in :class:`PlacementError` naming
the sandbox, the request and the decisions seen; a consumer that breaks fails every waiter at
once, not at its deadline.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass, field
from typing import Any

from aiokafka import AIOKafkaConsumer, TopicPartition
from aiokafka.errors import KafkaError

from trajbus.bus.clients import new_consumer
from trajbus.bus.closing import close_client
from trajbus.bus.producer import get_producer
from trajbus.bus.settings import Settings
from trajbus.bus.topics import Topics
from trajbus.schemas.codec import CodecError, default_codec

from .simulator_manifest import SimConfig

log = logging.getLogger("trajbus.producers.simulator")


class PlacementError(RuntimeError):
    """A closed-loop sandbox could not start: no scheduling decision or no placement in time,
    or its request was refused."""


@dataclass
class PlacementWaiter:
    sandbox: str
    request_id: str
    answered: asyncio.Event
    outcome: asyncio.Future[dict[str, Any]]
    decisions: list[str] = field(default_factory=list)


class Placements:
    """The scheduler's decisions about this fleet's requests, read from ``Topics.decisions``
    starting at the end offsets it had before the first request was sent."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.topic = Topics(settings).decisions
        self.codec = default_codec()
        self.waiters: dict[str, PlacementWaiter] = {}
        self.placed: dict[str, dict[str, Any]] = {}
        # the scheduler's TERMINATE about each sandbox: its event id, once seen
        self.terminations: dict[str, str] = {}
        self._terminated: dict[str, asyncio.Event] = {}
        self._consumer: AIOKafkaConsumer | None = None
        self._task: asyncio.Task[None] | None = None
        self._error: BaseException | None = None

    async def start(self) -> None:
        k = self.settings.kafka
        consumer = new_consumer(
            k, client_id=f"{k.client_id}-sim-placements", group_id=None,
            enable_auto_commit=False, isolation_level="read_committed")
        await consumer.start()
        self._consumer = consumer
        try:
            producer = await get_producer(k)
            try:
                parts = await asyncio.wait_for(producer.partitions_for(self.topic),
                                               k.connect_timeout_s)
            except Exception as exc:
                raise PlacementError(
                    f"the scheduler's decisions topic {self.topic} is not available ({exc!r}): "
                    "create the topics first (trajbus simulate --create-topics)") from exc
            tps = [TopicPartition(self.topic, p) for p in sorted(parts)]
            consumer.assign(tps)
            await consumer.seek_to_end(*tps)
            for tp in tps:  # pin the start now: decisions about our requests all come later
                await asyncio.wait_for(consumer.position(tp), k.connect_timeout_s)
        except BaseException:
            await self.stop()
            raise
        self._task = asyncio.create_task(self._read(), name="sim-placements")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        if self._consumer is not None:
            await close_client(self._consumer, "placements consumer")
            self._consumer = None

    def expect(self, sandbox: str, request_id: str) -> PlacementWaiter:
        """Register before sending the request, so no decision about it can be missed."""
        loop = asyncio.get_running_loop()
        w = PlacementWaiter(sandbox, request_id, asyncio.Event(), loop.create_future())
        if self._error is not None:
            w.outcome.set_exception(PlacementError(f"reading {self.topic} failed: "
                                                   f"{self._error!r}"))
            w.answered.set()
        self.waiters[request_id] = w
        return w

    async def wait(self, w: PlacementWaiter, cfg: SimConfig) -> bool:
        """True once placed; False when the request was withdrawn while queued; raises
        :class:`PlacementError` when refused or past a deadline."""
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        try:
            try:
                await asyncio.wait_for(w.answered.wait(), cfg.first_decision_timeout_s)
            except TimeoutError:
                raise PlacementError(
                    f"sandbox {w.sandbox}: no scheduling decision about request {w.request_id} "
                    f"on {self.topic} within {cfg.first_decision_timeout_s:g}s: is a scheduler "
                    "running on these topics (`trajbus worker`)? To run the fleet without one, "
                    "pass wait_for_placement=False (trajbus simulate --no-wait-for-placement)"
                ) from None
            remaining = cfg.placement_timeout_s - (loop.time() - t0)
            try:
                rec = await asyncio.wait_for(asyncio.shield(w.outcome), max(0.0, remaining))
            except TimeoutError:
                raise PlacementError(
                    f"sandbox {w.sandbox}: request {w.request_id} not placed within "
                    f"{cfg.placement_timeout_s:g}s (decisions so far: "
                    f"{', '.join(w.decisions)}); is capacity or tenant credit ever freed?"
                ) from None
        finally:
            self.waiters.pop(w.request_id, None)
        kind = rec["decision"]
        self.placed[w.sandbox] = {"decisions": list(w.decisions), "node": rec.get("node"),
                                  "waited_s": round(loop.time() - t0, 3)}
        if kind == "PLACE":
            return True
        if kind == "RECYCLE":
            return False
        raise PlacementError(f"sandbox {w.sandbox}: request {w.request_id} refused by the "
                             f"scheduler ({kind}): {rec.get('reason')}")

    async def _read(self) -> None:
        consumer = self._consumer
        assert consumer is not None
        try:
            while True:
                try:
                    batch = await consumer.getmany(timeout_ms=500)
                except KafkaError as exc:
                    # e.g. the broker restarting: keep reading (each wait has its deadline)
                    log.warning("reading %s: %r (retrying)", self.topic, exc)
                    await asyncio.sleep(0.5)
                    continue
                for recs in batch.values():
                    for r in recs:
                        self._on_decision(r.value)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # the consumer broke: fail every waiter now, not at a deadline
            self._error = exc
            for w in self.waiters.values():
                if not w.outcome.done():
                    w.outcome.set_exception(PlacementError(f"reading {self.topic} failed: "
                                                           f"{exc!r}"))
                w.answered.set()

    async def termination(self, sandbox: str, wait_s: float) -> str | None:
        """The event id of the scheduler's TERMINATE about ``sandbox``, waiting up to
        ``wait_s`` for it; None if none came."""
        ev = self._terminated.setdefault(sandbox, asyncio.Event())
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(ev.wait(), wait_s)
        return self.terminations.get(sandbox)

    def _on_decision(self, value: bytes | None) -> None:
        if not value:
            return
        try:
            d = self.codec.decode(value)
        except CodecError:
            return  # not ours to judge; the scheduler's topic is checked elsewhere
        if d.kind == "SchedulingDecision" and d.record["decision"] == "TERMINATE" and \
                str(d.header.get("producer_id", "")).endswith("scheduler"):
            sandbox = str(d.header["sandbox"])
            self.terminations.setdefault(sandbox, str(d.header["event_id"]))
            self._terminated.setdefault(sandbox, asyncio.Event()).set()
        rid = d.record.get("request_id") if d.kind == "SchedulingDecision" else None
        w = self.waiters.get(rid) if isinstance(rid, str) else None
        if w is None or w.outcome.done():
            return
        kind = str(d.record["decision"])
        w.decisions.append(kind)
        w.answered.set()
        if kind == "PLACE" or kind == "ANOMALY" or (
                kind == "RECYCLE" and (d.record.get("details") or {}).get("queued") == "true"):
            w.outcome.set_result(d.record)
