"""What passes between the runner and a processor: the input and output records, the
:class:`Processor` protocol every core's adapter implements, and :class:`ProcessorSpec`, how
to run one processor kind."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import NamedTuple, Protocol

from trajbus.bus.topics import TopicSpec

TICK_KEY = b"_tick"


class InRecord(NamedTuple):
    """One input record (a tuple: built once per record, at a third of a frozen dataclass's
    cost)."""

    topic: str
    partition: int
    offset: int
    key: bytes | None
    value: bytes
    timestamp_ms: int


@dataclass(frozen=True, slots=True)
class OutRecord:
    topic: str
    key: bytes | None
    value: bytes
    partition: int | None = None


class Processor(Protocol):
    """A pure core plus its encoding. One instance serves one input partition (or all of them
    for a global processor such as the scheduler).

    Optional: ``handle_batch(records) -> list[OutRecord]``, the records of one transaction
    in log order; the runner calls it instead of :meth:`handle` when present, so an adapter
    can coalesce outputs (the reorder adapter writes one segment per episode per batch)."""

    def handle(self, record: InRecord) -> list[OutRecord]: ...

    def tick(self, now_ms: int) -> list[OutRecord]: ...

    def take_dirty(self) -> dict[str, bytes | None]: ...

    def restore(self, key: str, blob: bytes | None) -> None: ...


@dataclass
class ProcessorSpec:
    """How to run one processor kind."""

    name: str  # "reorder", "watchdog", "scheduler"
    input_topics: list[str]
    factory: Callable[[], Processor]
    output_topics: Callable[[], Iterable[TopicSpec]] = lambda: ()
    global_state: bool = False  # True: one core for every partition (requires one worker)
    input_pattern: str | None = None  # also consume topics matching this regex
    tick_topics: list[str] | None = None  # where the ticker writes (default: input_topics)
    # True: records of all input partitions are processed in one deterministic order, merged
    # by record timestamp (the order `trajbus replay explain` re-creates from the log).
    ordered: bool = False
    extra_topics: list[TopicSpec] = field(default_factory=list)
