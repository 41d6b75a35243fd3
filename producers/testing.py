"""Helpers for tests and benchmarks of the producer side: settings for a throw-away topic
prefix, topic creation, reading topics back and checking sequence streams."""

from __future__ import annotations

import asyncio
import os
from collections import defaultdict
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from aiokafka.structs import ConsumerRecord

from trajbus.bus.admin import ensure_topics
from trajbus.bus.clients import new_consumer
from trajbus.bus.closing import close_client
from trajbus.bus.settings import (
    KafkaSettings,
    ProducerSideSettings,
    Settings,
    TopicSettings,
)
from trajbus.bus.topics import Topics
from trajbus.schemas.codec import default_codec


def make_settings(bootstrap: str, prefix: str, state_dir: str | os.PathLike[str] | None = None,
                  *, partitions: int = 2, **producer: Any) -> Settings:
    """Settings for one test: its own topic prefix and state directory."""
    kwargs: dict[str, Any] = {
        "kafka": KafkaSettings(bootstrap_servers=bootstrap),
        "topics": TopicSettings(prefix=prefix, partitions=partitions),
        "producer": ProducerSideSettings(**producer),
    }
    if state_dir is not None:
        kwargs["state_dir"] = Path(state_dir)
    return Settings(**kwargs)


async def create_topics(settings: Settings, which: Iterable[str] | None = None) -> None:
    """Create this prefix's topics (all of them, or those whose names are in ``which``)."""
    topics = Topics(settings)
    names = set(which) if which is not None else None
    specs = [s for s in topics.specs if names is None or s.name in names]
    await ensure_topics(settings, specs)


@dataclass
class Seen:
    topic: str
    partition: int
    offset: int
    value: bytes
    kind: str
    record: dict[str, Any]

    @property
    def header(self) -> dict[str, Any]:
        h: dict[str, Any] = self.record["header"]
        return h


async def read_topics(
    settings: Settings,
    topics: list[str],
    until: Callable[[list[Seen]], bool],
    timeout: float = 30.0,
) -> list[Seen]:
    """Read ``topics`` from the beginning until ``until(seen)`` holds; raises TimeoutError with
    what was seen if it does not within ``timeout``."""
    consumer = new_consumer(
        settings.kafka, *topics,
        group_id=None,
        auto_offset_reset="earliest",
        enable_auto_commit=False,
        max_partition_fetch_bytes=16 * 1024 * 1024,
        fetch_max_bytes=64 * 1024 * 1024,
    )
    await consumer.start()
    seen: list[Seen] = []
    codec = default_codec()
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    try:
        while not until(seen):
            remaining = deadline - loop.time()
            if remaining <= 0:
                raise TimeoutError(f"condition not met after {timeout}s; saw {len(seen)} records")
            batch = await consumer.getmany(timeout_ms=int(min(remaining, 0.5) * 1000))
            for _tp, recs in batch.items():
                for r in recs:
                    seen.append(_seen(r, codec))
    finally:
        await close_client(consumer, "test consumer")
    return seen


def _seen(r: ConsumerRecord[Any, Any], codec: Any) -> Seen:
    value = bytes(r.value or b"")
    d = codec.decode(value)
    return Seen(r.topic, r.partition, r.offset, value, d.kind, d.record)


@dataclass
class StreamCheck:
    """Per (sandbox, episode) stream: seq -> event ids seen."""

    streams: dict[tuple[str, str | None], dict[int, set[str]]]

    def problems(self) -> list[str]:
        out = []
        for key, seqs in self.streams.items():
            top = max(seqs)
            missing = sorted(set(range(top + 1)) - set(seqs))
            if missing:
                out.append(f"{key}: gap, missing seqs {missing[:20]}")
            reused = {s: ids for s, ids in seqs.items() if len(ids) > 1}
            if reused:
                some = dict(list(reused.items())[:5])
                out.append(f"{key}: seq reused by different events {some}")
        return out


def check_streams(seen: Iterable[Seen]) -> StreamCheck:
    streams: dict[tuple[str, str | None], dict[int, set[str]]] = defaultdict(
        lambda: defaultdict(set))
    for s in seen:
        h = s.header
        streams[(h["sandbox"], h["episode"])][h["seq"]].add(h["event_id"])
    return StreamCheck({k: dict(v) for k, v in streams.items()})


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))
