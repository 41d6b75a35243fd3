"""The ticker: Tick events published into every partition of a processor's tick topics, so
time-driven rules fire without traffic and an offline replay of the log sees the same time."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import Any

from aiokafka import AIOKafkaProducer
from aiokafka.errors import KafkaConnectionError, KafkaError, KafkaTimeoutError

from trajbus.bus.admin import TOPIC_SETUP_PATIENCE_S
from trajbus.bus.clients import new_producer
from trajbus.bus.closing import close_client
from trajbus.bus.kafka import lasting_delivery_error, retry_while_broker_restarts, sender_crash
from trajbus.consumers.engine.records import TICK_KEY
from trajbus.consumers.engine.state import RunnerState
from trajbus.schemas.models import Envelope, Tick

log = logging.getLogger("trajbus.runner")

# How long the ticker's producer may take to close on a stop (see SETTLE_ON_STOP_S).
TICKER_CLOSE_S = 2.0


def _lasting_failure(deliveries: list[asyncio.Future[Any]]) -> BaseException | None:
    """Drop the settled deliveries from ``deliveries`` (reading their errors, which asyncio
    would otherwise log one by one), and return the last error a retry of the same producer
    cannot cure (:func:`~trajbus.bus.kafka.lasting_delivery_error`), if any."""
    lasting: BaseException | None = None
    pending = []
    for fut in deliveries:
        if not fut.done():
            pending.append(fut)
        elif not fut.cancelled() and (exc := fut.exception()) is not None:
            if lasting_delivery_error(exc):
                lasting = exc
    deliveries[:] = pending
    return lasting


class TickerMixin(RunnerState):
    """The runner's ticker (see the module docstring)."""

    async def _ticker(self) -> None:
        """Publish Tick events into every partition of the tick topics (default: the input
        topics), so time-driven rules fire even when no traffic arrives, the ticks are
        replayable from the log, and a tick inside an input partition marks how far that
        partition has been written (a processing-time watermark).

        A broker restart does not stop it: its producer's start is retried as topic set-up
        is (``TOPIC_SETUP_PATIENCE_S``), and a tick that cannot be sent is skipped (the next
        one carries the time). If it fails all the same, the main loop raises its error: a
        worker never runs on without ticks."""
        interval = self.settings.scheduler.tick_interval_ms / 1000
        tick_topics = self.spec.tick_topics or self.spec.input_topics

        async def start() -> tuple[AIOKafkaProducer, list[tuple[str, int]]]:
            producer = new_producer(
                self.settings.kafka, client_id=f"{self.group_id}-{self.worker_id}-ticker")
            try:
                await producer.start()
                targets = [(t, p) for t in tick_topics
                           for p in sorted(await producer.partitions_for(t))]
            except BaseException:
                with contextlib.suppress(Exception):
                    await close_client(producer, "tick producer")
                raise
            return producer, targets

        async def started() -> tuple[AIOKafkaProducer, list[tuple[str, int]]]:
            return await retry_while_broker_restarts(
                start, transient=(KafkaConnectionError, KafkaTimeoutError),
                patience_s=lambda: TOPIC_SETUP_PATIENCE_S, what=f"{self.spec.name}: ticker")

        producer, targets = await started()
        deliveries: list[asyncio.Future[Any]] = []
        try:
            seq = 0
            skipped = 0
            while True:
                await asyncio.sleep(interval)
                broken = sender_crash(producer) or _lasting_failure(deliveries)
                if broken is not None:
                    # An idempotent producer that lost a sequence (OutOfOrderSequenceNumber on
                    # every later batch, seen after a long broker restart) or whose sender
                    # died never delivers again: the clock would stop for good
                    log.warning("%s: ticker: its producer can no longer deliver (%s: %s); "
                                "starting a new one", self.spec.name, type(broken).__name__,
                                broken)
                    await self._close(producer, "ticker producer")
                    deliveries = []
                    producer, targets = await started()
                now = int(time.time() * 1000)
                try:
                    for topic, p in targets:
                        tick = Tick(header=Envelope(
                            task="_tick", sandbox="_tick", seq=seq, event_time_ms=now,
                            producer_id=f"{self.group_id}.{self.worker_id}"))
                        deliveries.append(await producer.send(topic, tick.encode(),
                                                              key=TICK_KEY, partition=p))
                except KafkaError as exc:  # the broker is away: the next tick tells the time
                    skipped += 1
                    if skipped == 1 or skipped % 60 == 0:
                        log.warning("%s: ticker: %d tick(s) not sent (%s: %s); still trying",
                                    self.spec.name, skipped, type(exc).__name__, exc)
                else:
                    skipped = 0
                seq += 1
        finally:
            await self._close(producer, "ticker producer", TICKER_CLOSE_S)
