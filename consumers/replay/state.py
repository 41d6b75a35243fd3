"""The replay client's state: the fields the rooms of :class:`~.client.ReplayClient` share,
and what one of its iterators has read and handed out.

:class:`ClientState` declares the trainer's options (``ReplayClient.__init__`` sets them) and
builds the bookkeeping every room works on: what was delivered, handed out and acknowledged,
each partition's progress and tenure, the iterator reading now, the commit machinery's lock
and events, the rebalance under way. The rooms (``lifecycle``, ``iteration``, ``fetching``,
``decoding``, ``acks``, ``commits``, ``positions``) are mixins over it; the steps one room
calls in another are declared here for the type checker.

Guarantees: a new client holds nothing read, handed out, in flight or acknowledged, has no
consumer yet, and is settled (no rebalance under way).
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from collections.abc import AsyncGenerator, Callable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

from aiokafka import AIOKafkaConsumer, TopicPartition
from aiokafka.structs import OffsetAndMetadata

from trajbus.bus.settings import Settings
from trajbus.consumers.replay.items import Episode, Segment
from trajbus.consumers.replay.progress import _PartitionProgress
from trajbus.schemas.codec import Codec, Decoded

# How long a commit refused because the group rebalanced under it (after a broker outage
# longer than the session timeout, or a member joining or leaving) is tried again, once the
# group has settled, before the trainer's call raises it.
REBALANCE_COMMIT_TIMEOUT_S = 300.0  # aiokafka's default max_poll_interval: a rebalance's bound
_REBALANCE_RETRY_S = 0.2


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


class ClientState:
    """The fields of one replay client (see the module docstring), and the steps one room
    calls in another (declared for the type checker; each is defined by its room)."""

    # the trainer's options, set by ReplayClient.__init__
    settings: Settings
    pattern: str  # the regex of the replay topics read (config.replay_topic_pattern)
    tasks: list[str]  # the tasks named (ALL_TASKS aside)
    topics: list[str]  # their replay topics
    group_id: str
    start_position: Literal["earliest", "latest", "resume"] | int
    max_in_flight: int
    flow_control_timeout_s: float | None
    drop_truncated: bool
    drop_gappy: bool
    max_staleness: int | None
    current_policy_version: Callable[[], int] | None
    codec: Codec
    stats: dict[str, int]
    strict_commits: bool  # commit_every_ms=0: every ack() returns once it is committed
    commit_every_s: float
    group_instance_id: str | None

    def __init__(self) -> None:
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
        self._watchers: list[asyncio.Task[None]] = []  # notices.py: waits that are not errors
        self._last_turn = 0.0  # when an ack last gave the background committer a turn
        self._commit_task: asyncio.Future[None] | None = None  # one an ack started
        self._waited_on: asyncio.Future[None] | None = None  # the last one an ack waited for

    if TYPE_CHECKING:  # the steps the rooms call in one another
        async def _load_committed(self) -> None: ...

        async def _end_offsets_now(self) -> dict[TopicPartition, int]: ...

        async def _apply_start(self, assigned: Iterable[TopicPartition]) -> None: ...

        async def _position_pending(self) -> None: ...

        async def _progress_for(self, tp: TopicPartition) -> _PartitionProgress: ...

        async def _fetch_committed(self, tp: TopicPartition) -> OffsetAndMetadata | None: ...

        def _read_segments(self, read: _Read, idle_timeout: float | None,
                           drop_stale: bool = False) -> AsyncGenerator[Segment, None]: ...

        def _to_segment(self, tp: TopicPartition, offset: int, value: bytes,
                        timestamp_ms: int = 0, tenure: int = 0) -> Segment | None: ...

        def _too_stale(self, events: list[Decoded]) -> bool: ...

        def _acknowledge(self, item: Segment | Episode, by_trainer: bool
                         ) -> list[tuple[TopicPartition, _PartitionProgress, int]] | None: ...

        def _lose(self, partitions: Iterable[TopicPartition]) -> None: ...

        def _forget_open(self, read: _Read, ep: Episode) -> None: ...

        async def _commit_acknowledged(self, retry_rebalance: bool) -> None: ...

        async def _maybe_commit(self) -> None: ...
