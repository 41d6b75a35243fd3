"""The state a runner's rooms share: its identity in the group, its cores, its Kafka clients,
the offsets it committed, the batch in flight. :class:`RunnerState` builds it; each room of
the runner (:mod:`.restore`, :mod:`.transactions`, :mod:`.idle_commit`, :mod:`.ordering`,
:mod:`.ticker`) is a mixin over it, and :class:`~trajbus.consumers.engine.runner.Runner`
composes them."""

from __future__ import annotations

import asyncio
import threading
import time
from collections import deque
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition

from trajbus.bus.settings import Settings
from trajbus.bus.topics import Topics
from trajbus.consumers.engine import metrics
from trajbus.consumers.engine.records import OutRecord, Processor, ProcessorSpec

_STATS_S = 10.0
_STATS = ("batches", "records", "outputs", "changelog", "poll_s", "handle_s", "txn_s",
          "txn_max_ms", "age_ms", "age_max_ms", "between_polls_max_ms")


class RunnerState:
    """The fields of one runner (one processor kind in its consumer group), and the steps one
    room calls in another (declared for the type checker; each is defined by its room)."""

    _restoring: asyncio.Task[None] | None
    _abort_restore: threading.Event
    _inflight: asyncio.Task[None] | None
    _stats: dict[str, float]
    _stats_since: float

    def __init__(self, settings: Settings, spec: ProcessorSpec, worker_id: str = "w0") -> None:
        self.settings = settings
        self.spec = spec
        self.worker_id = worker_id
        self.topics = Topics(settings)
        prefix = settings.topics.prefix
        self.group_id = f"{prefix}.{spec.name}"
        self.changelog = f"{prefix}.{spec.name}.state"
        self.cores: dict[int, Processor] = {}
        # Across a rebalance (aiokafka's is eager: every partition is revoked, then the new
        # assignment given), the cores of revoked partitions wait here with the committed
        # offsets of their inputs; those assigned back unchanged are kept, not restored.
        self._parked: dict[int, tuple[Processor, dict[TopicPartition, int | None]]] = {}
        # The group's committed offset of each assigned input partition, as this worker left
        # it: read at assignment, then advanced by each of its transactions.
        self._committed: dict[TopicPartition, int | None] = {}
        # Partitions newly assigned beside kept ones are restored by this task while the kept
        # ones keep flowing (they are paused until their cores are built).
        self._restoring = None
        # Set to call off the restores running in their threads (cancelling the task awaiting
        # a thread does not stop the thread, and a process waits for its threads at exit);
        # each restore takes the event current at its start (cancel_restore replaces it).
        self._abort_restore = threading.Event()
        self.stopping = asyncio.Event()
        self.idle_batches = 0
        self.processed = 0
        self.started = False  # its clients started: it got past start-up (see run)
        # Input partitions of the last assignment, once restored (None: none yet): /readyz
        self.assigned: list[TopicPartition] | None = None
        for outcome in ("committed", "aborted", "failed"):  # shown as 0 from the start
            metrics.TRANSACTIONS.labels(spec.name, outcome)
        metrics.RESTORED_RECORDS.labels(spec.name)
        metrics.PROCESSOR_RESTARTS.labels(spec.name)
        self._consumer: AIOKafkaConsumer | None = None
        self._producer: AIOKafkaProducer | None = None
        self._known_topics: set[str] = set()
        self._lock = asyncio.Lock()
        # The transaction of the previous batch, still committing while the next batch is
        # fetched and processed (see _process).
        self._inflight = None
        self._pending: dict[TopicPartition, deque[Any]] = {}
        self._empty_since: dict[TopicPartition, float] = {}
        self._warned_silent: set[TopicPartition] = set()  # said once per silence (_release)
        # Where a busy worker's time goes, logged (INFO) every _STATS_S while records flow.
        self._stats = dict.fromkeys(_STATS, 0.0)
        self._stats_since = time.monotonic()

    # -- state --------------------------------------------------------------------------
    def _slot(self, partition: int) -> int:
        return 0 if self.spec.global_state else partition

    @property
    def instance_id(self) -> str:
        """This worker's static member id in its group (one per processor and --worker-id)."""
        return f"{self.group_id}.{self.worker_id}"

    if TYPE_CHECKING:  # the steps the rooms call in one another
        async def _wait_inflight(self) -> None: ...

        async def _restore(self, assigned: Iterable[TopicPartition]) -> None: ...

        async def _ensure_output_topic(self, topic: str) -> None: ...

        async def _commit(self, outs: list[OutRecord],
                          state: list[tuple[int, str, bytes | None]],
                          offsets: dict[TopicPartition, int], counts_in: dict[str, int],
                          n_records: int, started: float) -> None: ...

        async def _close(self, client: AIOKafkaConsumer | AIOKafkaProducer, what: str,
                         timeout: float = ...) -> None: ...
