"""The replay client's life: starting (the group's commits, the consumer and its subscription,
the notices of waits that are not errors) and stopping (the last commit, closing), and the
tasks it reads.

Guarantees: ``start()`` leaves no consumer behind when it fails; the subscription is a topic
pattern, so a task whose replay topic does not exist yet is waited for, not an error.
``stop()`` never raises -- what went wrong is logged -- except the caller's own cancellation;
its last commit is one attempt bounded by :data:`STOP_COMMIT_TIMEOUT_S`, and every
acknowledgement ``ack()`` returned True for that no commit carried is counted
(``stats["acks_lost_at_stop"]``) and logged.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Self

from aiokafka.errors import CommitFailedError, IllegalStateError

from trajbus.bus import inventory
from trajbus.bus.clients import new_admin, new_consumer
from trajbus.bus.closing import close_client
from trajbus.bus.kafka import check_broker
from trajbus.consumers.replay import notices, ratelimit
from trajbus.consumers.replay.rebalance import _GroupRebalancing, _StartAt
from trajbus.consumers.replay.state import ClientState

log = logging.getLogger("trajbus.consumers.replay.client")

STOP_COMMIT_TIMEOUT_S = 10.0
"""How long ``stop()`` tries its last commit (the broker away: aiokafka retries for ever)."""


class LifecycleMixin(ClientState):
    """Starting and stopping the client (see the module docstring)."""

    async def start(self) -> None:
        await check_broker(self.settings.kafka)
        await self._load_committed()
        if self.start_position == "latest":
            self._latest_at_start = await self._end_offsets_now()
        self._consumer = new_consumer(
            self.settings.kafka,
            group_id=self.group_id,
            enable_auto_commit=False,
            auto_offset_reset="earliest",
            isolation_level="read_committed",
            metadata_max_age_ms=5000,  # a task's replay topic may be created after we subscribe
            max_partition_fetch_bytes=self.settings.kafka.max_request_size,
            fetch_max_wait_ms=self.settings.kafka.fetch_max_wait_ms,  # idle topics: see there
            group_instance_id=self.group_instance_id,  # static membership (KIP-345)
        )
        try:
            await self._consumer.start()
            # A pattern, not a topic list: a topic that does not exist yet is no error
            # (aiokafka would log it missing every few hundred ms, then fail): it is read
            # once it is created.
            self._consumer.subscribe(pattern=self.pattern, listener=_StartAt(self))
        except BaseException:
            await close_client(self._consumer, "trainer consumer")
            self._consumer = None
            raise
        self._start_watchers()

    def _start_watchers(self) -> None:
        """The notices of waits that are not errors (see ``notices.py``): a task without a
        replay topic, a new group, a wait to join the group."""
        consumer = self._consumer

        def joined() -> bool:  # a generation: the JoinGroup was answered
            coordinator = getattr(consumer, "_coordinator", None)
            return consumer is None or getattr(coordinator, "generation", 1) > 0

        def subscribed() -> bool:  # a topic matches (else no group to join: notices say so)
            return consumer is None or bool(consumer.subscription())

        async def members() -> list[dict[str, str]]:
            admin = new_admin(self.settings.kafka, "admin")
            await admin.start()
            try:
                return notices.members_of(
                    (await admin.describe_consumer_groups([self.group_id]))[0])
            finally:
                await close_client(admin, "admin client")

        async def new_group() -> None:
            if notices.new_group_message(self.group_id, self.start_position,
                                         self._committed_at_start, ()) is None:
                return
            groups: list[str] = []
            admin = new_admin(self.settings.kafka, "admin")
            try:
                await admin.start()
                groups = [str(g[0]) for g in await admin.list_consumer_groups()]
            except Exception as exc:
                log.debug("replay client %s: no group list (%s)", self.group_id, exc)
            finally:
                await close_client(admin, "admin client")
            message = notices.new_group_message(self.group_id, self.start_position,
                                                self._committed_at_start, groups)
            if message:
                log.warning("%s", message)

        async def outage_log_ticks() -> None:
            while True:
                await asyncio.sleep(1.0)
                ratelimit.tick()

        ratelimit.attach(self)  # the Kafka client's log during an outage (ratelimit.py)
        self._watchers = [asyncio.create_task(c) for c in (
            outage_log_ticks(),
            new_group(),
            notices.watch_subscription(
                self.group_id, self.tasks, self.pattern,
                lambda: inventory.topic_names(self.settings),
                lambda topic: inventory.replay_task(self.settings, topic)),
            notices.watch_join(self.group_id, joined, subscribed, members,
                               self.group_instance_id is not None),
        )]

    async def _stop_watchers(self) -> None:
        watchers, self._watchers = self._watchers, []
        if watchers:
            ratelimit.detach(self)
        for task in watchers:
            task.cancel()
        await asyncio.gather(*watchers, return_exceptions=True)

    async def missing_tasks(self) -> list[str]:
        """The named tasks that have no replay topic yet (the client waits for them)."""
        have = set(await inventory.topic_names(self.settings))
        return [t for t, topic in zip(self.tasks, self.topics, strict=True) if topic not in have]

    async def list_tasks(self, include_debug: bool = False) -> list[str]:
        """The tasks that have a replay topic on the broker (see :func:`list_tasks`)."""
        return await inventory.list_tasks(self.settings, include_debug)

    async def stop(self) -> None:
        """Commit what is acknowledged (one attempt, at most :data:`STOP_COMMIT_TIMEOUT_S`)
        and close the consumer (bounded too). Never raises -- what went wrong is logged --
        except the caller's own cancellation: not a ``CancelledError`` from inside aiokafka
        after the broker went away (aiokafka#647), nor a commit the broker cannot take."""
        await self._stop_watchers()
        if self._consumer is not None:
            committer, self._committer = self._committer, None
            if committer is not None:
                committer.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await committer
            try:
                if self._commit_error is None:
                    await self._final_commit()
            finally:
                self._count_lost_at_stop()
                await close_client(self._consumer, "trainer consumer")
                self._consumer = None

    def _count_lost_at_stop(self) -> None:
        """Coalesced commits: acknowledgements ``ack()`` returned True for that no commit
        carried by the end of ``stop()`` (its last commit failed or was not made: the broker
        away, the group rebalancing, an earlier commit error) are delivered again to the
        partitions' next reader: counted in ``stats["acks_lost_at_stop"]`` and logged."""
        lost = {tp: p.promised - p.durable for tp, p in self._progress.items()
                if p.promised > p.durable}
        for p in self._progress.values():
            p.durable = max(p.durable, p.promised)  # counted once (stop() may run twice)
        if not lost:
            return
        self.stats["acks_lost_at_stop"] += sum(lost.values())
        log.warning("replay client %s: %d acknowledged offset(s) (ack() returned True) of %s "
                    "were not committed when the client stopped; the partitions' next reader "
                    "delivers them again", self.group_id, sum(lost.values()),
                    ", ".join(f"{tp.topic}[{tp.partition}]" for tp in sorted(lost)))

    async def _final_commit(self) -> None:
        """One commit at stop: a stopping member does not wait for a rebalance to end."""
        try:
            await asyncio.wait_for(self._commit_acknowledged(retry_rebalance=False),
                                   STOP_COMMIT_TIMEOUT_S)
        except (CommitFailedError, IllegalStateError, _GroupRebalancing) as exc:
            log.warning("replay client %s: the last acknowledgements could not be committed "
                        "at stop (the group is rebalancing: %s); they are delivered again to "
                        "the partitions' next reader", self.group_id, exc)
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if task is not None and task.cancelling():
                raise  # the caller's own cancellation
            self._stop_commit_failed("cancelled inside the Kafka client")
        except TimeoutError:
            self._stop_commit_failed(f"no answer within {STOP_COMMIT_TIMEOUT_S:.0f} s: is the "
                                     "broker away?")
        except Exception as exc:
            self._stop_commit_failed(f"{type(exc).__name__}: {exc}")

    def _stop_commit_failed(self, why: str) -> None:
        log.warning("replay client %s: the last acknowledgements could not be committed at "
                    "stop (%s); they are delivered again to the partitions' next reader",
                    self.group_id, why)

    async def __aenter__(self) -> Self:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()
