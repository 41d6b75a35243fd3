"""Committing an idle input partition's position past what holds no record (commit markers,
aborted records), so an idle group shows no lag."""

from __future__ import annotations

import asyncio
import time

from aiokafka import TopicPartition
from aiokafka.errors import KafkaError

from trajbus.consumers.engine.state import RunnerState

PASS_MARKERS_AFTER_S = 2.0
"""An input partition's position is committed past what holds no record (a transaction's
commit marker, aborted records) after this long without input other than ticks (see
``_commit_passed``)."""


class IdleCommitMixin(RunnerState):
    """The runner's idle commit (see the module docstring)."""

    # RunnerState's fields, typed here too (mypy does not follow trajbus.* imports)
    _inflight: asyncio.Task[None] | None

    async def _commit_passed(self) -> None:
        """Commit, in a transaction of its own, the position of each idle input partition that
        is past the group's commit with nothing of it left to process: what lies between is
        what a reader never gets (the commit marker that follows each transaction of the
        producer upstream, aborted records). Without it an idle worker's group reads lag 1
        per partition written transactionally in Kafka's own tools and a lag exporter's, for
        good. Skipped while a transaction is in flight or failed, or a restore runs: the next
        idle poll tries again."""
        consumer = self._consumer
        if consumer is None or self._restoring is not None:
            return
        async with self._lock:
            task = self._inflight
            if task is not None and (not task.done() or task.cancelled()
                                     or task.exception() is not None):
                return  # a failure is raised by the main loop
            paused = consumer.paused()
            offsets: dict[TopicPartition, int] = {}
            for tp in consumer.assignment():
                if tp in paused or self._pending.get(tp) or \
                        self._slot(tp.partition) not in self.cores or tp not in self._committed:
                    continue
                try:
                    position = await asyncio.wait_for(consumer.position(tp), 1.0)
                except (TimeoutError, KafkaError):
                    continue  # no position yet, or revoked meanwhile
                committed = self._committed[tp]
                if position > (committed if committed is not None else 0):
                    offsets[tp] = position
            if offsets:
                self._inflight = asyncio.create_task(
                    self._commit([], [], offsets, {}, 0, time.perf_counter()))
