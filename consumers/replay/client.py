"""The trainer client: subscribe to replay topics and receive each episode in order, once.

Guarantees
----------
* **Order**: segments of an episode arrive in sequence order (the reorder processor publishes
  them keyed by ``sandbox/episode``, so one episode lives in one partition, in order).
* **Once**: the client drops any event whose (sandbox, episode, seq) it has already delivered
  (a re-derived or zombie-duplicated segment), trimming partly overlapping segments.
* **Commit after acknowledgement**: a Kafka offset is committed only when the trainer has
  acknowledged that segment *and every earlier one in the partition* (offsets that hold no
  record for this reader -- the worker's transaction markers, aborted records -- count as
  passed, learnt from the offsets skipped between records read in order). Offsets acknowledged
  beyond that point are stored in the commit's metadata, so nothing acknowledged is lost,
  in either commit style below.
* **Coalesced commits** (the default, ``commit_every_ms=100``): ``ack`` returns at once and
  what is acknowledged is committed at most once per N ms, one commit in flight; a crash
  re-delivers at most the acknowledgements made since the last commit. The ack that finds a
  commit due starts it (and gives it a few turns of the event loop, once per commit), so a
  loop that trains without awaiting still commits every N ms; a committer task commits the
  last acknowledgements. ``await client.commit()`` returns once everything acknowledged so
  far is committed (before saving a checkpoint, say); ``stop()`` commits too, and so does a
  rebalance that takes partitions away.
  What cannot be committed cannot be kept: an acknowledgement ``ack`` returned True for that
  no commit carried before the partition left this member -- the group dropped the member
  (a broker outage, then a loop blocked beyond the session timeout before it could commit)
  or ``stop()``'s last commit failed (the broker away) -- is delivered again to the
  partition's next reader; each is counted (``stats["acks_lost_in_rebalance"]``,
  ``stats["acks_lost_at_stop"]``) and logged (WARNING), never silent.
* **Per-ack commits** (``commit_every_ms=0``): every :meth:`ReplayClient.ack` returns once
  its commit is done; a trainer that crashes and resumes sees neither a gap nor a second copy
  of what it acknowledged. Each ``ack`` costs a commit round trip: catching up on live-sized
  (one-event) segments is many times slower than with coalesced commits (the README's
  trainer section has the figures).
* **Through rebalances** (a broker outage longer than the session timeout makes the consumer
  rejoin; a trainer joins or leaves the group): a commit refused meanwhile is made again once
  the group has settled (for up to :data:`REBALANCE_COMMIT_TIMEOUT_S`, then the call raises;
  the group settles only while the trainer iterates, so a trainer step between two fetches
  must stay under aiokafka's ``max_poll_interval_ms``, 300 s, or the member is taken out of
  the group and an ``ack()`` with per-ack commits waits, then raises ``CommitFailedError``);
  a segment handed out but not acknowledged is never committed as consumed, even when the
  rejoin makes the consumer read it again; a partition that moved to another member is read
  on by that member from the group's commit (what was acknowledged here but not yet committed
  is delivered there again).
* **A group of trainers** (one ``group_id``, members joining and leaving): an acknowledged
  episode is never delivered again to another member. :meth:`ReplayClient.ack` returns
  True when the acknowledgement is the group's (per-ack: committed; coalesced: the
  partition is still this member's, its commits carry it), False when the partition went
  to another member since the item was handed out (that member delivers it again, whole).
  The commit's metadata names every run of offsets acknowledged beyond the commit point
  (compactly: thousands of live segments fit), and a member taking a partition reads it;
  the commit point never passes the first segment of an episode not acknowledged, so a
  partition moved mid-episode never yields a fragment. ``Episode.complete`` is False
  (``fragment_reason``) for an episode read from after its first segment (a start
  position inside it, retention) or missing one.
* **Leaving a loop early** (``break`` after a batch of episodes, an exception in the loop):
  the next iterator of the client reads again what the last one had fetched from Kafka but
  not handed out -- the segments of episodes it had not completed, the rest of its last
  fetch -- so a trainer that takes N episodes per step loses nothing and its commits go on.
  One iterator at a time per client.
* **Start positions** (``start="earliest"``, ``"latest"``, a time): applied to a partition
  the first time this client is assigned it; if the broker cannot answer then, the partition
  waits, paused, until it can (``stats["start_positions_retried"]``) -- never read from the
  group's commit instead.
* **Flow control** (``max_in_flight``, default 256 segments): the iterator does not read
  on while the segments handed out and not acknowledged that the trainer *can acknowledge
  while the iterator waits* reach ``max_in_flight``; so no loop shape waits on itself:

  - segments handed out by an *earlier* iterator of the client (a loop left with ``break``)
    always count: a batch loop acknowledges its batch after its training step, before it
    asks for the next one; a trainer that trains on one batch while the next is collected
    acknowledges it from another task, and the new loop waits for that;
  - the segments the *current* iterator handed out count once one of them has been
    acknowledged while the iterator was fetching or waiting: something beside the loop (a
    task, a thread) acknowledges them, and the loop waits for it. Until then they do not
    count -- a loop that collects a batch of any size before acknowledging it, or never
    acknowledges, could not release them while it waits for the next one. (A loop that
    hands its episodes to tasks thus gets backpressure from their first acknowledgement
    on; before it, it can run up to a fetch past ``max_in_flight``.)
  - the segments ``episodes()`` holds for episodes not complete yet never count (they are
    not the trainer's, and waiting on them could never end).

  At the limit the iterator waits for acknowledgements (``stats["flow_control_waits"]``).
  Without one for 10 s it logs a WARNING naming ``max_in_flight`` and what holds it, then
  every 30 s; after ``flow_control_timeout_s`` (default 300 s: aiokafka's
  ``max_poll_interval_ms``, after which a member that has not fetched is taken out of the
  group anyway; None: never) it raises :class:`FlowControlError` (a ``RuntimeError``). What
  a loop holds beyond the limit is committed only once acknowledged: a loop that never
  acknowledges gets everything, and a restarted trainer reads it all again.
* **Staleness** (``max_staleness`` with ``current_policy_version``): an episode whose oldest
  event's policy version is more than ``max_staleness`` behind the trainer's when it
  completes is dropped whole -- acknowledged, never handed out (``segments()``: each
  segment on its own), counted in ``stats["stale_episodes_dropped"]`` /
  ``["stale_segments_dropped"]`` (``["stale_dropped"]``: their events). ``max_staleness``
  without ``current_policy_version`` is a ``ValueError``.

* **Waits and outages** (``notices.py``, ``ratelimit.py``): a named task still without a
  replay topic after 30 s, a new group, a wait of more than 3 s to join the group are each
  logged (WARNING) with what to do; during a broker outage the Kafka client's own messages
  are held back: one line when it starts failing, a summary every 30 s, one when it works
  again. :meth:`ReplayClient.stop` / :meth:`SyncReplayClient.close` never raise (but the
  caller's own cancellation); the last commit is given up after
  :data:`STOP_COMMIT_TIMEOUT_S`.

Subscription and start position
-------------------------------
* **Which tasks**: names, :data:`ALL_TASKS` (every task, present and future, except the
  operators' ``debug-*`` republish topics) and/or ``task_pattern`` (a regex over task names).
  The client subscribes by topic pattern: a task whose replay topic does not exist yet is
  waited for (a trainer is often started before the fleet) and picked up within 5 s of its
  creation. :func:`list_tasks` says which tasks exist.
* **Where to start** (``start=``): ``"resume"`` (the default) continues from the group's
  committed offsets, from the beginning for partitions it never committed; ``"earliest"``
  re-reads everything retained; ``"latest"`` only what is written after :meth:`start`; a
  time (aware datetime, epoch ms, ISO-8601 or ``"-1h"``) starts each partition at its first
  record written at or after it (Kafka's offsets-for-times). A position other than resume is
  applied the first time this client is assigned each partition, and the next commit makes
  it the group's position: it *resets the group*. Give it to one member (or use a fresh
  group): a second member started with ``"earliest"`` would re-read the partitions it takes
  over. Restart a crashed trainer with ``"resume"``.

Use :class:`ReplayClient` from asyncio, :class:`SyncReplayClient` from plain Python.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
from collections import OrderedDict
from collections.abc import AsyncGenerator, Callable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from aiokafka import AIOKafkaConsumer, TopicPartition
from aiokafka.errors import CommitFailedError, IllegalStateError
from aiokafka.structs import OffsetAndMetadata

from trajbus.bus import inventory
from trajbus.bus.clients import new_consumer
from trajbus.bus.closing import close_client
from trajbus.bus.kafka import admin_client, check_broker
from trajbus.bus.positions import StartPosition, parse_start, resolve_offsets
from trajbus.bus.settings import Settings, get_settings
from trajbus.bus.topics import Topics, validate_name
from trajbus.consumers.replay import notices, ratelimit
from trajbus.consumers.replay.items import Episode, FlowControlError, Segment, fragment_reason
from trajbus.consumers.replay.progress import (
    _PartitionProgress,
    encode_acked_beyond,
    parse_acked_beyond,
)
from trajbus.consumers.replay.rebalance import _GroupRebalancing, _StartAt
from trajbus.schemas.codec import Codec, Decoded, DecodeError, default_codec

if TYPE_CHECKING:
    from trajbus.consumers.replay.sync import SyncReplayClient

log = logging.getLogger(__name__)

_REMEMBERED = 200_000  # episodes whose delivery state the client keeps (bounded memory)
# How long a commit refused because the group rebalanced under it (after a broker outage
# longer than the session timeout, or a member joining or leaving) is tried again, once the
# group has settled, before the trainer's call raises it.
REBALANCE_COMMIT_TIMEOUT_S = 300.0  # aiokafka's default max_poll_interval: a rebalance's bound
_REBALANCE_RETRY_S = 0.2
_COMMITTER_TURN_S = 0.001  # coalesced commits: an ack yields to the committer this often
_COMMIT_TURN_WAIT_S = 0.005  # ... and waits this long, once per commit, for one under way
# A loop held at ``max_in_flight`` logs a WARNING after this long without an acknowledgement,
# then again at most this often (see ReplayClient._wait_for_acks).
_FLOW_WARN_AFTER_S = 10.0
_FLOW_WARN_EVERY_S = 30.0
FLOW_CONTROL_TIMEOUT_S = 300.0
"""The default ``flow_control_timeout_s``: aiokafka's ``max_poll_interval_ms``, the longest a
member may go without fetching before the group takes it out."""
DEFAULT_COMMIT_EVERY_MS = 100.0
"""The default ``commit_every_ms``: coalesced commits (see the module docstring), chosen by
bench/bench_trainer_commit.py."""
COMMITTED_AT_START_TIMEOUT_S = 120.0
"""How long ``start()`` waits for the group's coordinator to answer (loading after a restart)."""
STOP_COMMIT_TIMEOUT_S = 10.0
"""How long ``stop()`` tries its last commit (the broker away: aiokafka retries for ever)."""
ALL_TASKS = "*"
"""``ReplayClient(ALL_TASKS, ...)``: every task's replay topic, present and future (the
operators' ``debug-*`` republish topics excepted)."""


async def list_tasks(settings: Settings | None = None, *, include_debug: bool = False
                     ) -> list[str]:
    """The tasks that have a replay topic on the broker, sorted (``debug-*`` republish tasks
    only with ``include_debug``)."""
    settings = settings or get_settings()
    await check_broker(settings.kafka)
    return await inventory.list_tasks(settings, include_debug)


def replay_topic_pattern(settings: Settings, tasks: Iterable[str] | str,
                         task_pattern: str | None = None) -> str:
    """The regex of the replay topics a client reads: the named tasks, every task
    (:data:`ALL_TASKS`), and/or the tasks whose whole name matches ``task_pattern``."""
    names = [tasks] if isinstance(tasks, str) else list(tasks)
    alternatives: list[str] = []
    for task in names:
        if task == ALL_TASKS:
            alternatives.append(r"(?!debug-).+")
        else:
            alternatives.append(re.escape(validate_name("task", task)))
    if task_pattern is not None:
        try:
            re.compile(task_pattern)
        except re.error as exc:
            raise ValueError(f"task_pattern {task_pattern!r} is not a regular expression: "
                             f"{exc}") from None
        alternatives.append(f"(?:{task_pattern})")
    if not alternatives:
        raise ValueError("subscribe to at least one task, ALL_TASKS ('*') or a task_pattern")
    prefix = re.escape(f"{settings.topics.prefix}.replay.")
    return f"^{prefix}(?:{'|'.join(alternatives)})$"


@dataclass
class _Read:
    """What one :meth:`ReplayClient.segments` / :meth:`ReplayClient.episodes` iterator has
    read from Kafka and not handed to the trainer; what it handed out and flow control."""

    serial: int  # which iterator of the client (the owner of what it handed out)
    revocations_at_fetch: int  # the client's count of rebalances at its last fetch
    unhandled: dict[TopicPartition, int] = field(default_factory=dict)  # first offset not
    # looked at yet, per partition of the last batch
    open_episodes: dict[tuple[str, str], Episode] = field(default_factory=dict)
    open_segments: int = 0  # their segments (in flight, but not the trainer's yet)
    released: bool = False
    own: int = 0  # segments this iterator handed out (open ones too), not acknowledged
    at_trainer: bool = False  # suspended at a yield: the trainer's loop body runs
    acked_beside: bool = False  # one of ``own`` was acknowledged while this iterator was
    # fetching or waiting: something beside the loop acknowledges (a task, a thread)


class ReplayClient:
    """Async trainer client over ``trajbus.replay.<task>`` topics."""

    def __init__(
        self,
        tasks: Iterable[str] | str,
        group_id: str,
        settings: Settings | None = None,
        *,
        task_pattern: str | None = None,
        start: StartPosition = "resume",
        max_in_flight: int = 256,
        drop_truncated: bool = False,
        drop_gappy: bool = False,
        max_staleness: int | None = None,
        current_policy_version: Callable[[], int] | None = None,
        codec: Codec | None = None,
        commit_every_ms: float = DEFAULT_COMMIT_EVERY_MS,
        flow_control_timeout_s: float | None = FLOW_CONTROL_TIMEOUT_S,
        group_instance_id: str | None = None,
    ) -> None:
        """``tasks``: task names (one name as a plain string is fine), or :data:`ALL_TASKS`
        (``"*"``) for every task; ``task_pattern``: also every task whose whole name matches
        this regex. The subscription is a topic pattern, so replay topics created after the
        client started are picked up (within ``metadata_max_age_ms``, 5 s) and a task whose
        topic does not exist yet is simply waited for.

        ``start``: ``"resume"`` (default), ``"earliest"``, ``"latest"`` or a time; see
        "Subscription and start position" in the module docstring.

        ``commit_every_ms`` (default :data:`DEFAULT_COMMIT_EVERY_MS`, 100) commits what is
        acknowledged at most once per that interval (``ack`` does not wait), at the price of
        re-delivering up to that interval's acknowledged segments after a crash;
        :meth:`commit` waits for everything acknowledged. ``0`` commits at every
        acknowledgement (``ack`` returns once it is committed): after a crash the trainer
        resumes exactly after its last acknowledgement.

        ``group_instance_id``: static group membership (Kafka's ``group.instance.id``): a
        trainer restarted with the same id takes its previous run's place in the group at
        once, instead of waiting for that run's session to time out (10 s). Unique per
        trainer process of the group. A member with one sends no LeaveGroup when it stops: its
        partitions wait for it for the session timeout.

        ``max_in_flight`` / ``flow_control_timeout_s``: see "Flow control" in the module
        docstring. A loop held at the limit logs a WARNING naming it while it waits, and
        raises :class:`FlowControlError` after ``flow_control_timeout_s`` without an
        acknowledgement (None: it waits, warning, for ever).

        ``max_staleness`` (with ``current_policy_version``, a callable returning the
        trainer's policy version now): an episode (``segments()``: a segment) whose oldest
        event's ``policy_version`` is more than ``max_staleness`` behind is dropped whole:
        acknowledged, never handed out, counted in ``stats`` (``stale_episodes_dropped``,
        ``stale_segments_dropped``; ``stale_dropped`` counts their events). Events without a
        policy version are never stale."""
        if max_in_flight < 1:
            raise ValueError(f"max_in_flight must be at least 1, not {max_in_flight!r}")
        if flow_control_timeout_s is not None and flow_control_timeout_s <= 0:
            raise ValueError("flow_control_timeout_s must be positive (None: wait for ever), "
                             f"not {flow_control_timeout_s!r}")
        if max_staleness is not None:
            if max_staleness < 0:
                raise ValueError(f"max_staleness must be 0 or more, not {max_staleness!r}")
            if current_policy_version is None:
                raise ValueError(
                    f"max_staleness={max_staleness} needs the trainer's policy version: pass "
                    "current_policy_version=<a callable returning the version being trained "
                    "now>, e.g. current_policy_version=lambda: trainer.policy_version")
        self.settings = settings or get_settings()
        topics = Topics(self.settings)
        self.pattern = replay_topic_pattern(self.settings, tasks, task_pattern)
        named = [tasks] if isinstance(tasks, str) else list(tasks)
        self.tasks = [t for t in named if t != ALL_TASKS]
        self.topics = [topics.replay(t) for t in self.tasks]
        self.group_id = group_id
        self.start_position = parse_start(start)
        self.max_in_flight = max_in_flight
        self.flow_control_timeout_s = flow_control_timeout_s
        self.drop_truncated = drop_truncated
        self.drop_gappy = drop_gappy
        self.max_staleness = max_staleness
        self.current_policy_version = current_policy_version
        self.codec = codec or default_codec()
        self.stats = {"segments": 0, "events": 0, "duplicates_dropped": 0, "stale_dropped": 0,
                      "stale_episodes_dropped": 0, "stale_segments_dropped": 0,
                      "flow_control_waits": 0,
                      "skipped_already_acked": 0, "undecodable": 0,
                      "commits_retried_after_rebalance": 0, "acks_after_partition_moved": 0,
                      "acks_lost_in_rebalance": 0, "acks_lost_at_stop": 0,
                      "acks_beyond_metadata_cut": 0,
                      "records_read_again_after_early_exit": 0, "start_positions_retried": 0}
        self._consumer: AIOKafkaConsumer | None = None
        self._progress: dict[TopicPartition, _PartitionProgress] = {}
        # per episode, the highest seq delivered and the partition it came from (a partition
        # lost forgets its episodes: what it held is this member's no more)
        self._delivered_hwm: OrderedDict[tuple[str, str], tuple[int, TopicPartition]] = (
            OrderedDict())
        self._finished: OrderedDict[tuple[str, str], TopicPartition] = OrderedDict()
        self._tenures = 0  # partitions taken (each _PartitionProgress gets the next number)
        self._in_flight = 0
        self._committed_at_start: dict[TopicPartition, OffsetAndMetadata] = {}
        self.strict_commits = commit_every_ms <= 0
        self.commit_every_s = max(0.0, commit_every_ms) / 1000
        self._dirty = False
        self._last_commit = 0.0
        self._commit_lock = asyncio.Lock()
        self._commit_wanted = asyncio.Event()
        self._committer: asyncio.Task[None] | None = None
        self._commit_error: BaseException | None = None
        self._acked_event = asyncio.Event()
        self._rebalancing = False  # between a revocation and the next assignment
        self._settled = asyncio.Event()  # set while not rebalancing
        self._settled.set()
        # offsets handed to the trainer and not acknowledged yet, per partition: read again
        # after a rejoin (the consumer restarts at the group's commit), such a record is not
        # "consumed" -- the commit must not pass it -- until its first delivery is acknowledged
        # (offset -> the serial of the iterator that handed it out)
        self._handed_out: dict[TopicPartition, dict[int, int]] = {}
        self._positioned: set[TopicPartition] = set()
        self._unpositioned: set[TopicPartition] = set()  # paused until their start is known
        self._next_position_try = 0.0
        self._revocations = 0  # rebalances begun: each resets the kept partitions' positions
        self._reading: _Read | None = None  # the iterator reading now
        self._reads = 0  # iterators made
        self._told_own_beyond_limit = False
        self._latest_at_start: dict[TopicPartition, int] = {}
        self.group_instance_id = group_instance_id
        self._watchers: list[asyncio.Task[None]] = []  # notices.py: waits that are not errors
        self._last_turn = 0.0  # when an ack last gave the background committer a turn
        self._commit_task: asyncio.Future[None] | None = None  # one an ack started
        self._waited_on: asyncio.Future[None] | None = None  # the last one an ack waited for

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
            admin = admin_client(self.settings.kafka, "admin")
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
            admin = admin_client(self.settings.kafka, "admin")
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

    async def commit(self) -> None:
        """Commit every acknowledgement made so far; returns once the broker has it (a
        background commit under way is waited for). Raises what a background commit raised.

        A commit the group refuses because it rebalanced meanwhile (a broker outage longer
        than the session timeout makes the consumer rejoin; a member joined or left) is made
        again once this member has its partitions back -- for those it still holds -- for up
        to :data:`REBALANCE_COMMIT_TIMEOUT_S`. Only then does it raise."""
        await self._commit_acknowledged(retry_rebalance=True)

    async def _commit_acknowledged(self, retry_rebalance: bool) -> None:
        self._raise_commit_error()  # a background commit's failure is final: not retried
        loop = asyncio.get_running_loop()
        started = loop.time()
        retried = False
        while True:
            try:
                await self._commit_once()
            except (CommitFailedError, IllegalStateError, _GroupRebalancing) as exc:
                if not retry_rebalance:
                    raise
                if loop.time() - started >= REBALANCE_COMMIT_TIMEOUT_S:
                    log.error("replay client %s: giving up a commit after %.0f s of rebalancing",
                              self.group_id, REBALANCE_COMMIT_TIMEOUT_S)
                    raise CommitFailedError(
                        f"group {self.group_id!r} kept rebalancing for "
                        f"{REBALANCE_COMMIT_TIMEOUT_S:.0f} s: the acknowledgements since the "
                        f"last commit are not committed ({exc}); a restarted trainer receives "
                        f"them again") from exc
                if not retried:
                    self.stats["commits_retried_after_rebalance"] += 1
                    log.warning("replay client %s: the group rebalanced under a commit (%s); "
                                "committing again once this member has its partitions back",
                                self.group_id, type(exc).__name__)
                    retried = True
                await asyncio.sleep(_REBALANCE_RETRY_S)  # not holding the commit lock: the
                # revocation's own commit (coalesced commits) must not wait for this one
                continue
            if retried:
                log.info("replay client %s: committed after %.1f s of rebalancing",
                         self.group_id, loop.time() - started)
            return

    async def _commit_once(self) -> None:
        for p in self._progress.values():
            if p.advance():
                self._dirty = True
        async with self._commit_lock:
            if self._dirty:
                self._dirty = False
                try:
                    await self._commit()
                except BaseException:
                    self._dirty = True
                    raise
                self._last_commit = asyncio.get_running_loop().time()

    async def __aenter__(self) -> ReplayClient:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    # -- iteration ----------------------------------------------------------------------
    async def segments(self, idle_timeout: float | None = None
                       ) -> AsyncGenerator[Segment, None]:
        """Yield segments as they arrive. Stops after ``idle_timeout`` seconds without data
        (None: run forever). Acknowledge each with :meth:`ack`.

        Leaving the loop early (``break``, an exception) loses nothing: the records read
        from Kafka but not yet handed out are read again by the next iterator of this client
        (the consumer is moved back to them)."""
        read = self._new_read()
        segments = self._read_segments(read, idle_timeout, drop_stale=True)
        try:
            async for seg in segments:
                _count_delivered(self.stats, [seg])
                read.at_trainer = True
                yield seg
                read.at_trainer = False
        finally:
            await segments.aclose()
            self._release(read)

    async def _read_segments(self, read: _Read, idle_timeout: float | None,
                             drop_stale: bool = False) -> AsyncGenerator[Segment, None]:
        assert self._consumer is not None, "call start() first"
        loop = asyncio.get_running_loop()
        idle_since = loop.time()
        unhandled = read.unhandled
        while True:
            # backpressure on what the trainer can acknowledge while this loop waits (see
            # _held); the segments of episodes still open wait for the rest of their
            # episodes, which must be read to complete them
            await self._wait_for_acks(read)
            if self._unpositioned and not self._rebalancing:
                await self._position_pending()
            batch = await self._consumer.getmany(
                timeout_ms=200, max_records=max(1, self.max_in_flight - self._held(read)[0]))
            if batch and self._rebalancing:
                # fetched from the new assignment while its callback still runs (aiokafka
                # wakes getmany first): its open episodes may yet be dropped -- read these
                # again once it is done
                assigned = self._consumer.assignment()
                for tp, msgs in batch.items():
                    if msgs and tp in assigned:
                        self._consumer.seek(tp, msgs[0].offset)
                # (bounded: should the group never settle, the fetch is simply tried again)
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(self._settled.wait(), _REBALANCE_RETRY_S * 5)
                continue
            # counted only for a fetch that is handled: one put back above must not make a
            # later release take positions the assignment is still resetting for its own
            read.revocations_at_fetch = self._revocations
            if not batch:
                if idle_timeout is not None and loop.time() - idle_since > idle_timeout:
                    return
                continue
            idle_since = loop.time()
            unhandled.clear()  # the last batch was handled, or left for a re-read
            unhandled.update({tp: msgs[0].offset for tp, msgs in batch.items() if msgs})
            for tp, msgs in batch.items():
                if tp not in self._consumer.assignment():
                    unhandled.pop(tp, None)
                    continue  # taken by another member since this batch came: it reads them
                progress = await self._progress_for(tp)
                if read.revocations_at_fetch != self._revocations:
                    unhandled.clear()  # a rebalance during that await: see below
                    break
                if tp not in self._consumer.assignment():
                    self._lose([tp])
                    unhandled.pop(tp, None)
                    continue
                handed = self._handed_out.setdefault(tp, {})
                for msg in msgs:
                    unhandled[tp] = msg.offset
                    progress.note_read(msg.offset)
                    if progress.skip_on_restart(msg.offset):
                        self.stats["skipped_already_acked"] += 1
                        continue
                    if msg.offset in handed:
                        continue  # read again after a rejoin: its first delivery is unacked
                    seg = self._to_segment(tp, msg.offset, msg.value, msg.timestamp,
                                           progress.epoch)
                    if seg is None:
                        if progress.ack(msg.offset):  # nothing new in it: consumed
                            self._dirty = True
                        continue
                    if drop_stale and self._too_stale(seg.events):
                        self.stats["stale_segments_dropped"] += 1
                        self.stats["stale_dropped"] += len(seg.events)
                        if progress.ack(msg.offset):  # consumed: committed with the next
                            self._dirty = True
                        continue
                    handed[msg.offset] = read.serial
                    self._in_flight += 1
                    read.own += 1
                    unhandled[tp] = msg.offset + 1  # handed out, even if the loop ends here
                    yield seg
                    if read.released:  # a newer iterator has taken over: it reads the rest
                        return
                    if read.revocations_at_fetch != self._revocations:
                        break  # a rebalance while the trainer had it: see below
                else:
                    unhandled.pop(tp, None)
                    continue
                # A rebalance since this batch was fetched put every partition this member
                # kept back to the group's commit, which none of the batch's unhandled
                # records is past: they are read again, so the rest of the batch is left (a
                # partition that moved away and came back must not have its records taken
                # for duplicates of the episodes dropped with it).
                unhandled.clear()
                break
            await self._maybe_commit()

    async def episodes(self, idle_timeout: float | None = None
                       ) -> AsyncGenerator[Episode, None]:
        """Yield whole episodes once their last segment arrived. Acknowledge with :meth:`ack`.

        Leaving the loop early (``break``, an exception) loses nothing: the segments of
        episodes not yet complete, and the records read but not yet looked at, are read again
        by the next iterator of this client.

        Memory: the segments of an episode are held until its last one arrives. The engine
        ends every episode -- at its end, its drain, its sandbox's recycling, or truncated
        after ``idle_timeout_ms`` of silence (30 min) -- so this is bounded by the episodes
        open on the engine; a replay topic written by something else that never ends its
        episodes would grow it without bound."""
        read = self._new_read()
        open_eps = read.open_episodes
        segments = self._read_segments(read, idle_timeout)  # staleness: of whole episodes
        try:
            async for seg in segments:
                key = (seg.sandbox, seg.episode)
                ep = open_eps.setdefault(key, Episode(seg.task, seg.sandbox, seg.episode))
                ep.segments.append(seg)
                ep.events.extend(seg.events)
                read.open_segments += 1
                if seg.gap:
                    ep.gaps.append(seg.gap)
                if seg.is_last:
                    ep.is_terminal = seg.is_terminal
                    del open_eps[key]
                    read.open_segments -= len(ep.segments)
                    stale = self._too_stale(ep.events)
                    if stale:
                        self.stats["stale_episodes_dropped"] += 1
                        self.stats["stale_dropped"] += len(ep.events)
                    if (stale or (self.drop_truncated and ep.truncated)
                            or (self.drop_gappy and ep.gaps)):
                        self._acknowledge(ep, by_trainer=False)
                        await self._maybe_commit()
                        continue
                    _count_delivered(self.stats, ep.segments)
                    read.at_trainer = True
                    yield ep
                    read.at_trainer = False
        finally:
            await segments.aclose()
            self._release(read)

    def _new_read(self) -> _Read:
        """The state of a new iterator. An earlier one that was left without being closed
        (``async for`` ... ``break`` closes it only when the event loop finalizes it, maybe
        after this one has started) is released first, so the two never share records."""
        if self._reading is not None:
            self._release(self._reading)
        self._reads += 1
        read = self._reading = _Read(self._reads, self._revocations)
        return read

    def _held(self, read: _Read) -> tuple[int, int]:
        """What counts against ``max_in_flight`` for ``read``, and of that what earlier
        iterators handed out: the segments the trainer can acknowledge while ``read`` waits.
        Those an earlier loop handed out always count (the trainer had them before it asked
        again). Those this loop handed out count only once one of them was acknowledged
        while it waited (something beside the loop acknowledges): a loop that collects a
        batch before acknowledging could never release them while it waits for the next
        one. The segments of episodes it holds open never count (they are not the
        trainer's)."""
        earlier = self._in_flight - read.own
        if read.acked_beside:
            return earlier + read.own - read.open_segments, earlier
        return earlier, earlier

    async def _wait_for_acks(self, read: _Read) -> None:
        """Wait while ``read`` is held at ``max_in_flight`` (see :meth:`_held`). A wait
        without an acknowledgement is logged (WARNING) after ``_FLOW_WARN_AFTER_S``, then at
        most every ``_FLOW_WARN_EVERY_S``, and raised (:class:`FlowControlError`) after
        ``flow_control_timeout_s``."""
        if not read.acked_beside and read.own - read.open_segments >= self.max_in_flight:
            # beyond the limit on its own segments: first let a task (or thread) that is
            # ready to acknowledge one do so, which tells what counts (fetches of records
            # already buffered would not give it a turn)
            await asyncio.sleep(0)
            if not read.acked_beside and not self._told_own_beyond_limit:
                self._told_own_beyond_limit = True
                log.info("replay client %s: this loop holds %d segments it handed out and "
                         "that are not acknowledged, more than max_in_flight=%d; it is not "
                         "held back by them (it could not acknowledge them while it waits for "
                         "the next one); they are committed once acknowledged",
                         self.group_id, read.own - read.open_segments, self.max_in_flight)
        counted, earlier = self._held(read)
        if counted < self.max_in_flight:
            return
        self.stats["flow_control_waits"] += 1
        loop = asyncio.get_running_loop()
        last_ack = loop.time()
        warn_at = last_ack + _FLOW_WARN_AFTER_S
        timeout = self.flow_control_timeout_s
        while True:
            self._acked_event.clear()
            wake = warn_at if timeout is None else min(warn_at, last_ack + timeout)
            try:
                await asyncio.wait_for(self._acked_event.wait(), max(0.0, wake - loop.time()))
                last_ack = loop.time()
            except TimeoutError:
                pass
            counted, earlier = self._held(read)
            if counted < self.max_in_flight:
                return
            now = loop.time()
            held = (f"{counted} segments handed out and not acknowledged hold "
                    f"max_in_flight={self.max_in_flight} ({earlier} by earlier loops of this "
                    f"client, {counted - earlier} by this one); none was acknowledged for "
                    f"{now - last_ack:.0f} s")
            advice = ("ack() them (a loop left after a batch acknowledges the batch before "
                      "asking for the next) or raise max_in_flight")
            if timeout is not None and now - last_ack >= timeout:
                raise FlowControlError(f"replay client {self.group_id}: {held}; {advice}")
            if now >= warn_at:
                log.warning("replay client %s: waiting: %s; %s", self.group_id, held, advice)
                warn_at = now + _FLOW_WARN_EVERY_S

    def _lose(self, partitions: Iterable[TopicPartition]) -> None:
        """This member's tenure of ``partitions`` ended (they went to another member, or the
        group's commit moved past ours): what it handed out from them is not the trainer's
        to acknowledge any more -- their next reader delivers it again, and an ``ack()`` of
        it returns False -- and what it knew of their episodes (delivered, finished) is
        forgotten, so that should a partition come back, its records are delivered again
        unless the group's commit says they were acknowledged."""
        lost = {tp for tp in partitions}
        if not lost:
            return
        for tp in lost:
            progress = self._progress.pop(tp, None)
            if progress is not None and progress.durable < progress.promised:
                # acknowledged (coalesced commits: ack() returned True), but no commit
                # carried them before the partition went -- the revocation's commit failed:
                # its next reader delivers them again. (Those whose ack() has not returned
                # yet return False.)
                lost_acks = progress.promised - progress.durable
                self.stats["acks_lost_in_rebalance"] += lost_acks
                log.warning("replay client %s: %d acknowledged offset(s) of %s were not "
                            "committed before the partition went to another member (the "
                            "commit at revocation failed); it delivers them again",
                            self.group_id, lost_acks, tp)
        self._drop_open_episodes(lost)
        read = self._reading
        for tp in lost:
            for serial in self._handed_out.pop(tp, {}).values():
                self._in_flight -= 1
                if read is not None and serial == read.serial:
                    read.own -= 1
        for key in [k for k, tp in self._finished.items() if tp in lost]:
            del self._finished[key]
        for key in [k for k, (_, tp) in self._delivered_hwm.items() if tp in lost]:
            del self._delivered_hwm[key]
        self._acked_event.set()

    def _drop_open_episodes(self, partitions: set[TopicPartition]) -> None:
        """Forget the current iterator's open episodes on ``partitions`` (their progress was
        dropped in a rebalance): not in flight, not "delivered" -- read again, they are
        delivered whole."""
        read = self._reading
        if read is None or not partitions:
            return
        for key, ep in list(read.open_episodes.items()):
            if any(TopicPartition(seg.topic, seg.partition) in partitions for seg in ep.segments):
                del read.open_episodes[key]
                self._forget_open(read, ep)
                read.open_segments -= len(ep.segments)
        self._acked_event.set()

    def _forget_open(self, read: _Read, ep: Episode) -> None:
        """An episode an iterator held open is not the trainer's: not in flight, not held
        back from a re-read, not "delivered" (the re-read would drop its events as
        duplicates)."""
        self._delivered_hwm.pop((ep.sandbox, ep.episode), None)
        for seg in ep.segments:
            handed = self._handed_out.get(TopicPartition(seg.topic, seg.partition), {})
            if handed.pop(seg.offset, None) is not None:
                self._in_flight -= 1
                read.own -= 1

    def _release(self, read: _Read) -> None:
        """An iterator ended: what it read from Kafka and did not hand out -- the segments of
        episodes it had not completed, the records of its last batch it had not looked at --
        is read again by the next one. Only those: everything before them was handed out
        (skipped while unacknowledged), acknowledged, or had nothing new."""
        if read.released:
            return
        read.released = True
        if self._reading is read:
            self._reading = None
        rewind = dict(read.unhandled)
        for ep in read.open_episodes.values():
            self._forget_open(read, ep)
            for seg in ep.segments:
                tp = TopicPartition(seg.topic, seg.partition)
                rewind[tp] = min(seg.offset, rewind.get(tp, seg.offset))
        read.open_episodes.clear()
        read.open_segments = 0
        read.unhandled.clear()
        self._acked_event.set()
        if self._consumer is None or not rewind:
            return
        if read.revocations_at_fetch != self._revocations or self._rebalancing:
            # a rebalance since the last fetch (or under way) puts every partition kept back
            # to the group's commit, which none of these offsets is past (none is
            # acknowledged): they are read again without a seek, which would race it
            return
        assigned = self._consumer.assignment()
        for tp, offset in rewind.items():
            if tp in assigned:
                self._consumer.seek(tp, offset)
                self.stats["records_read_again_after_early_exit"] += 1

    async def ack(self, item: Segment | Episode) -> bool:
        """The trainer has consumed this segment (or every segment of this episode).

        Returns True when the acknowledgement is this member's for the group: with per-ack
        commits (``commit_every_ms=0``) once it is committed; with coalesced commits (the
        default, ``commit_every_ms=100``) at once (it is committed in the background, and at
        the latest when a rebalance takes the partition away or the client stops). An
        acknowledgement that returned True and that no commit could carry is delivered again
        to the partition's next reader, and counted: ``stats["acks_lost_in_rebalance"]`` (the
        revocation's commit failed, e.g. the group dropped this member after a broker outage
        before it could commit what it acknowledged during it), ``stats["acks_lost_at_stop"]``
        (the last commit of ``stop()`` failed, e.g. the broker away); a crash loses the
        acknowledgements since the last commit, uncounted. Returns
        False when the item's partition went to another member of the
        group since it was handed out (a member joined or left): that member delivers it
        again, whole, and its acknowledgement is the one that counts; a trainer that wants
        each episode's work to count once discards what it drew from this one. Acknowledging
        again what is acknowledged already changes nothing."""
        tickets = self._acknowledge(item, by_trainer=True)
        await self._maybe_commit()
        if tickets is None:
            return False
        if self.strict_commits:
            return all(progress.durable >= n for _, progress, n in tickets)
        if not self._settled.is_set():
            # a rebalance under way (from the start of the revocation, whose commit may
            # already be made without this ack) decides whether the partition stays
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._settled.wait(), REBALANCE_COMMIT_TIMEOUT_S)
        # the group's if a commit carried it (the revocation's may have, before the
        # partition went), or if the partition is still this member's (its commits will)
        if not all(progress.durable >= n or self._progress.get(tp) is progress
                   for tp, progress, n in tickets):
            return False
        for _, progress, n in tickets:
            progress.promised = max(progress.promised, n)
        return True

    def _acknowledge(self, item: Segment | Episode, by_trainer: bool
                     ) -> list[tuple[TopicPartition, _PartitionProgress, int]] | None:
        """Record the acknowledgement of ``item``'s segments in the progress of their
        partitions; the (partition, progress, acks recorded) of each, or None when a segment
        was handed out under an earlier tenure of its partition (void: see :meth:`_lose`)."""
        segs = item.segments if isinstance(item, Episode) else [item]
        read = self._reading
        tickets: list[tuple[TopicPartition, _PartitionProgress, int]] = []
        void = False
        for seg in segs:
            tp = TopicPartition(seg.topic, seg.partition)
            progress = self._progress.get(tp)
            if progress is None or (seg._tenure and progress.epoch != seg._tenure):
                # its partition went to another member meanwhile, which reads it again
                self.stats["acks_after_partition_moved"] += 1
                void = True
                continue
            owner = self._handed_out.get(tp, {}).pop(seg.offset, None)
            if log.isEnabledFor(logging.DEBUG):
                log.debug("replay client %s: ack %s[%d]@%d tenure %d (commit point %d)",
                          self.group_id, tp.topic, tp.partition, seg.offset, progress.epoch,
                          progress.committed)
            if progress.ack(seg.offset):
                # committed now even when it is beyond the commit point (in the metadata): a
                # restart, or the partition's next owner, must not deliver it again
                self._dirty = True
                tickets.append((tp, progress, progress.acks))
            else:  # acknowledged before: by this very tenure (an earlier ack of it)
                tickets.append((tp, progress, 0))
            if owner is None:
                continue  # acknowledged already (or never handed out): not in flight
            self._in_flight -= 1
            if read is not None and owner == read.serial:
                read.own -= 1
                if by_trainer and not read.at_trainer:
                    read.acked_beside = True  # while the loop was fetching or waiting
        self._acked_event.set()
        return None if void else tickets

    # -- internals ----------------------------------------------------------------------
    async def _end_offsets_now(self) -> dict[TopicPartition, int]:
        """End offsets of the subscribed partitions that exist now (for ``start="latest"``)."""
        parts = await inventory.partitions_of(self.settings, [], pattern=self.pattern)
        tps = [TopicPartition(t, p) for t, ps in parts.items() for p in ps]
        if not tps:
            return {}
        consumer = new_consumer(self.settings.kafka,
                                enable_auto_commit=False, isolation_level="read_committed")
        await consumer.start()
        try:
            return dict(await consumer.end_offsets(tps))
        finally:
            await close_client(consumer, "offsets consumer")

    async def _apply_start(self, assigned: Iterable[TopicPartition]) -> None:
        """Seek partitions assigned to this client for the first time to the start position
        (nothing to do for ``resume``: the group's committed offsets apply).

        Runs in the assignment callback, where aiokafka only logs an exception and then
        reads the partitions from the group's commit -- for a new group, from the beginning
        the trainer asked to skip. So partitions whose start cannot be resolved now (the
        broker slow or away) are paused, and the fetch loop resolves them again
        (:meth:`_position_pending`); none is read before it is positioned."""
        self._unpositioned.clear()  # a new assignment: its own pauses (aiokafka resets them)
        new = [tp for tp in assigned if tp not in self._positioned]
        if self.start_position == "resume" or not new:
            self._positioned.update(new)
            return
        if self.start_position == "latest":
            # the end as of start(); a topic created since then is read from its beginning
            self._seek_start({tp: self._latest_at_start[tp]
                              for tp in new if tp in self._latest_at_start})
            new = [tp for tp in new if tp not in self._latest_at_start]
        if not new:
            return
        try:
            self._seek_start(await self._resolve_start(new))
        except Exception as exc:
            assert self._consumer is not None
            self._consumer.pause(*new)
            self._unpositioned.update(new)
            self.stats["start_positions_retried"] += 1
            log.warning("replay client %s: the start position (%s) of %d new partition(s) "
                        "could not be resolved (%s: %s); they wait, paused, and it is tried "
                        "again", self.group_id, self.start_position, len(new),
                        type(exc).__name__, exc)

    async def _resolve_start(self, tps: list[TopicPartition]) -> dict[TopicPartition, int]:
        assert self._consumer is not None
        start = self.start_position
        if start == "resume":  # nothing to seek: the group's committed offsets apply
            return {}
        # ``latest`` reaches here only for topics created since start(): from their beginning
        position = "earliest" if start == "latest" else start
        return dict(await resolve_offsets(self._consumer, tps, position))

    def _seek_start(self, targets: dict[TopicPartition, int]) -> None:
        # positioned only once sought
        assert self._consumer is not None
        for tp, offset in targets.items():
            self._consumer.seek(tp, offset)
            self._tenures += 1
            progress = _PartitionProgress(offset, epoch=self._tenures)
            seen = self._committed_at_start.get(tp)
            if seen is not None:  # what a later rebalance compares the group's commit with
                progress.last_committed = (seen.offset, seen.metadata or "")
            self._progress[tp] = progress
            self._positioned.add(tp)

    async def _position_pending(self) -> None:
        """Resolve again the start of partitions paused by :meth:`_apply_start` (at most every
        ``_REBALANCE_RETRY_S`` * 5); resume those positioned. A rebalance meanwhile makes the
        answer moot: its own assignment callback has dealt with them."""
        loop = asyncio.get_running_loop()
        if loop.time() < self._next_position_try:
            return
        self._next_position_try = loop.time() + _REBALANCE_RETRY_S * 5
        assert self._consumer is not None
        revocations = self._revocations
        pending = sorted(self._unpositioned, key=lambda tp: (tp.topic, tp.partition))
        try:
            targets = await self._resolve_start(pending)
        except Exception as exc:
            log.debug("replay client %s: start position still unresolved (%s: %s)",
                      self.group_id, type(exc).__name__, exc)
            return
        if revocations != self._revocations or self._rebalancing:
            return
        assigned = self._consumer.assignment()
        targets = {tp: off for tp, off in targets.items()
                   if tp in self._unpositioned and tp in assigned}
        self._seek_start(targets)
        self._unpositioned.difference_update(targets)
        self._consumer.resume(*targets)

    async def _progress_for(self, tp: TopicPartition) -> _PartitionProgress:
        """This tenure's progress of ``tp``; a partition just taken starts from the group's
        commit *and its metadata*: the runs beyond the commit point that the member before
        acknowledged are skipped, so a member taking a partition over delivers nothing the
        other acknowledged."""
        progress = self._progress.get(tp)
        if progress is None:
            om = await self._fetch_committed(tp)
            self._tenures += 1
            if om is None:
                progress = _PartitionProgress(0, epoch=self._tenures)
            else:
                progress = _PartitionProgress.from_commit(om.offset, om.metadata or "",
                                                          self._tenures)
            self._progress[tp] = progress
            if log.isEnabledFor(logging.DEBUG):
                log.debug("replay client %s: took %s[%d] at %s, carried %s, tenure %d",
                          self.group_id, tp.topic, tp.partition,
                          None if om is None else om.offset, progress.carried[:20],
                          progress.epoch)
        return progress

    async def _fetch_committed(self, tp: TopicPartition) -> OffsetAndMetadata | None:
        """The group's commit of ``tp`` with its metadata (None: none). aiokafka's
        ``committed()`` drops the metadata; its coordinator's fetch (what ``committed()``
        calls) keeps it. Without that, the metadata read at ``start()`` serves if the offset
        still matches."""
        assert self._consumer is not None
        coordinator = getattr(self._consumer, "_coordinator", None)
        fetch = getattr(coordinator, "fetch_committed_offsets", None)
        if fetch is not None:
            offsets = await fetch([tp])
            om = offsets.get(tp)
            if om is None or om.offset < 0:
                return None
            return OffsetAndMetadata(om.offset, om.metadata or "")
        committed = await self._consumer.committed(tp)
        if committed is None:
            return None
        start = self._committed_at_start.get(tp)
        if start is not None and start.offset == committed:
            return OffsetAndMetadata(committed, start.metadata or "")
        return OffsetAndMetadata(committed, "")

    async def _load_committed(self) -> None:
        """The group's committed offsets with their metadata (acknowledged-beyond offsets)."""
        from aiokafka.errors import KafkaError

        admin = admin_client(self.settings.kafka, "admin")
        await admin.start()
        try:
            # the coordinator is briefly unavailable on a new cluster, and loading the
            # group's offsets after a restart (retriable errors): retried up to a deadline
            deadline = asyncio.get_running_loop().time() + COMMITTED_AT_START_TIMEOUT_S
            while True:
                try:
                    self._committed_at_start = await admin.list_consumer_group_offsets(
                        self.group_id)
                    return
                except KafkaError as exc:
                    if (not getattr(exc, "retriable", False)
                            or asyncio.get_running_loop().time() >= deadline):
                        raise
                    await asyncio.sleep(0.5)
        finally:
            await admin.close()

    def _to_segment(self, tp: TopicPartition, offset: int, value: bytes,
                    timestamp_ms: int = 0, tenure: int = 0) -> Segment | None:
        try:
            decoded = self.codec.decode(value)
        except DecodeError:
            self.stats["undecodable"] += 1
            return None
        rec = decoded.record
        h = rec["header"]
        key = (h["sandbox"], h["episode"] or "")
        if key in self._finished:  # a re-derived copy of an episode already delivered whole
            self.stats["duplicates_dropped"] += len(rec["events"])
            return None
        hwm = self._delivered_hwm.get(key, (-1, tp))[0]
        events: list[Decoded] = []
        for raw in rec["events"]:
            try:
                ev = self.codec.decode(raw)
            except DecodeError:
                self.stats["undecodable"] += 1
                continue
            seq = ev.record["header"]["seq"]
            if seq <= hwm:
                self.stats["duplicates_dropped"] += 1
                continue
            events.append(ev)
            hwm = seq
        if not events and not rec["is_last"] and rec["gap"] is None:
            return None
        self._delivered_hwm[key] = (max(hwm, rec["last_seq"]), tp)
        self._delivered_hwm.move_to_end(key)
        while len(self._delivered_hwm) > _REMEMBERED:  # bounded memory: forget the oldest
            self._delivered_hwm.popitem(last=False)
        if rec["is_last"]:
            self._delivered_hwm.pop(key, None)
            self._finished[key] = tp
            while len(self._finished) > _REMEMBERED:
                self._finished.popitem(last=False)
        gap = rec["gap"]
        return Segment(
            task=h["task"], sandbox=h["sandbox"], episode=h["episode"] or "", index=h["seq"],
            first_seq=events[0].record["header"]["seq"] if events else rec["first_seq"],
            last_seq=rec["last_seq"], events=events,
            gap=(gap["from_seq"], gap["to_seq"]) if gap else None,
            is_first=rec["is_first"], is_last=rec["is_last"], is_terminal=rec["is_terminal"],
            topic=tp.topic, partition=tp.partition, offset=offset, timestamp_ms=timestamp_ms,
            _tenure=tenure,
        )

    def _too_stale(self, events: list[Decoded]) -> bool:
        """The oldest policy version among ``events`` is more than ``max_staleness`` behind
        the trainer's (events without one are never stale)."""
        if self.max_staleness is None or self.current_policy_version is None:
            return False
        versions = [v for ev in events
                    if (v := ev.record["header"].get("policy_version")) is not None]
        if not versions:
            return False
        return bool(self.current_policy_version() - min(versions) > self.max_staleness)

    async def _maybe_commit(self) -> None:
        self._raise_commit_error()
        if any([p.advance() for p in self._progress.values()]):
            self._dirty = True
        if not self._dirty:
            return
        if self.strict_commits:
            await self.commit()
            return
        self._commit_wanted.set()
        if self._committer is None:
            self._committer = asyncio.create_task(self._commit_in_background())
        await self._commit_in_turn()

    async def _commit_in_turn(self) -> None:
        """Coalesced commits, from the trainer's ack: the ack that finds a commit due starts
        it, and drives it for up to ``_COMMIT_TURN_WAIT_S`` (the few turns of the event loop
        its I/O takes -- not a round trip per ack: once per commit); while it is under way,
        an ack gives it a turn at most every ``_COMMITTER_TURN_S``: a loop that hands out
        records already fetched and trains without awaiting still commits every N ms. The
        background committer commits what is acknowledged last."""
        loop = asyncio.get_running_loop()
        now = loop.time()
        task = self._commit_task
        if ((task is None or task.done()) and not self._commit_lock.locked()
                and now >= self._last_commit + self.commit_every_s):
            task = self._commit_task = asyncio.ensure_future(self._commit_for_ack())
        if task is None or task.done():
            return
        if task is not self._waited_on:
            self._waited_on = task
            self._last_turn = now
            await asyncio.wait({task}, timeout=_COMMIT_TURN_WAIT_S)
        elif now - self._last_turn >= _COMMITTER_TURN_S:
            self._last_turn = now
            await asyncio.sleep(0)

    async def _commit_for_ack(self) -> None:
        try:
            await self.commit()
        except Exception as exc:  # handed to the trainer's next call, as the committer's
            self._commit_error = exc

    async def _commit_in_background(self) -> None:
        """Commit what is acknowledged whenever there is something new, one commit at a time
        and at most one per ``commit_every_ms``; a failure is raised by the next ``ack``."""
        loop = asyncio.get_running_loop()
        try:
            while True:
                await self._commit_wanted.wait()
                self._commit_wanted.clear()
                wait = self._last_commit + self.commit_every_s - loop.time()
                if wait > 0:
                    await asyncio.sleep(wait)
                started = self._commit_task
                if started is not None and not started.done():  # an ack's (_commit_in_turn)
                    await asyncio.wait({started})
                    self._commit_wanted.set()  # then what was acknowledged meanwhile
                    continue
                await self.commit()
        except Exception as exc:  # handed to the trainer's next call
            self._commit_error = exc

    def _raise_commit_error(self) -> None:
        if self._commit_error is not None:
            raise self._commit_error

    async def _commit(self) -> None:
        """Commit the progress of the partitions read that this member holds. During a
        rebalance (revoked, not yet assigned; or no partition assigned while some were read:
        a subscription change is starting one) nothing can be committed: raises
        :class:`_GroupRebalancing`. Outside one, a partition read but not assigned went to
        another member: its progress is dropped (that member reads on from the group's
        commit)."""
        if self._consumer is None or not self._progress:
            return
        if self._rebalancing:
            raise _GroupRebalancing("partitions revoked, not yet assigned again")
        assigned = self._consumer.assignment()
        if not assigned:
            raise _GroupRebalancing("no partition assigned now")
        self._lose([tp for tp in self._progress if tp not in assigned])
        held = list(self._progress.items())
        offsets = {tp: OffsetAndMetadata(p.committed, p.metadata()) for tp, p in held}
        acks = [p.acks for _, p in held]  # what this commit carries
        for _, p in held:
            if p.metadata_cut:
                self.stats["acks_beyond_metadata_cut"] += p.metadata_cut
                log.warning("replay client %s: %d run(s) of acknowledged offsets beyond the "
                            "commit point do not fit the commit's metadata; a restart or the "
                            "partition's next owner delivers them again", self.group_id,
                            p.metadata_cut)
        if offsets:
            if log.isEnabledFor(logging.DEBUG):
                log.debug("replay client %s: committing %s", self.group_id,
                          {f"{tp.topic}[{tp.partition}]": (p.committed, p.beyond()[:20])
                           for tp, p in held})
            await self._consumer.commit(offsets)
            for (tp, p), n in zip(held, acks, strict=True):
                p.durable = max(p.durable, n)
                p.last_committed = (offsets[tp].offset, offsets[tp].metadata)


def _count_delivered(stats: dict[str, int], segments: list[Segment]) -> None:
    """``stats["segments"]`` / ``["events"]``: what the trainer received, each once -- counted
    when handed to it, not when read (``episodes()`` reads the segments of an episode it had
    not completed again after a loop left early, and drops filtered episodes)."""
    stats["segments"] += len(segments)
    stats["events"] += sum(len(seg.events) for seg in segments)


def __getattr__(name: str) -> Any:
    # SyncReplayClient lives in sync.py, which imports this module: loaded on first use
    if name == "SyncReplayClient":
        from trajbus.consumers.replay.sync import SyncReplayClient

        return SyncReplayClient
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

__all__ = [
    "ALL_TASKS", "DEFAULT_COMMIT_EVERY_MS", "FLOW_CONTROL_TIMEOUT_S", "REBALANCE_COMMIT_TIMEOUT_S",
    "STOP_COMMIT_TIMEOUT_S", "Episode", "FlowControlError", "ReplayClient", "Segment",
    "SyncReplayClient", "encode_acked_beyond", "fragment_reason", "list_tasks",
    "parse_acked_beyond", "replay_topic_pattern",
]
