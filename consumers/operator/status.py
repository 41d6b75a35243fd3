"""``trajbus status``: the fleet's processors, groups, lag and retained records; the
scheduler's state restored from its changelog."""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

from aiokafka import TopicPartition

from trajbus.bus.clients import new_consumer
from trajbus.bus.closing import close_client
from trajbus.bus.kafka import check_broker
from trajbus.bus.settings import Settings
from trajbus.bus.topics import Topics
from trajbus.consumers.operator.reads import group_lag, read_records, topic_partitions


async def retained_records(settings: Settings, topics: Sequence[str]) -> dict[str, int]:
    """Records currently retained per existing topic, as a ``read_committed`` reader sees them
    (transaction markers and aborted records not counted; a partition of more than 20 000
    offsets is not read: its offset difference is counted instead)."""
    from trajbus.bus.inventory import count_records

    parts = await topic_partitions(settings, topics)
    tps = [TopicPartition(t, p) for t in parts for p in parts[t]]
    out = dict.fromkeys(parts, 0)
    if not tps:
        return out
    consumer = new_consumer(settings.kafka, enable_auto_commit=False,
                            isolation_level="read_committed")
    await consumer.start()
    try:
        begin = await consumer.beginning_offsets(tps)
        end = await consumer.end_offsets(tps)
    finally:
        await close_client(consumer, "consumer")
    counted = await count_records(settings, {tp: (begin[tp], end[tp]) for tp in tps})
    for tp in tps:
        n = counted.get(tp)
        out[tp.topic] += end[tp] - begin[tp] if n is None else n
    return out


async def fleet_status(settings: Settings) -> dict[str, Any]:
    """For ``trajbus status``: the cluster's live brokers and the partitions under-replicated,
    under min.insync.replicas or offline; per processor group, its live members (client id,
    host, assigned partitions; none: no worker runs it) and its lag (records not yet
    processed, transaction markers excluded) per input topic; dead letters retained; the
    replay topics with their sizes."""
    from trajbus.bus.inventory import describe_group
    from trajbus.consumers.engine import processors

    await check_broker(settings.kafka)
    topics = Topics(settings)
    existing_topics = set(await topic_partitions(settings))
    groups: dict[str, Any] = {}
    for name in ("reorder", "watchdog", "scheduler"):
        spec_fn = getattr(processors, f"{name}_spec", None)
        if spec_fn is None:
            groups[name] = {"available": False}
            continue
        spec = spec_fn(settings)
        inputs = [t for t in spec.input_topics if t in existing_topics]
        if spec.input_pattern:
            rx = re.compile(spec.input_pattern)
            inputs += sorted(t for t in existing_topics if rx.match(t) and t not in inputs)
        group = f"{settings.topics.prefix}.{spec.name}"
        lag = await group_lag(settings, group, inputs) if inputs else {}
        info = await describe_group(settings, group)
        groups[name] = {"available": True, "group": group, "lag": lag,
                        "total_lag": sum(lag.values()), "state": info.state,
                        "members": [{"client_id": m.client_id, "host": m.host,
                                     "partitions": m.assignment} for m in info.members]}
    from trajbus.bus.inventory import consumer_groups

    archivers: dict[str, Any] = {}
    raw = [t for t in topics.archive_topics if t in existing_topics]
    for group in await consumer_groups(settings, f"{settings.topics.prefix}.archiver."):
        lag = await group_lag(settings, group, raw) if raw else {}
        info = await describe_group(settings, group)
        archivers[group] = {"group": group, "lag": lag, "total_lag": sum(lag.values()),
                            "state": info.state,
                            "members": [{"client_id": m.client_id, "host": m.host,
                                         "partitions": m.assignment} for m in info.members]}
    replay_prefix = f"{topics.prefix}.replay."
    replay = sorted(t for t in existing_topics if t.startswith(replay_prefix))
    counts = await retained_records(settings, [topics.deadletter, *replay])
    from trajbus.bus.inventory import cluster_health

    return {
        "bootstrap_servers": settings.kafka.bootstrap_servers,
        "cluster": (await cluster_health(settings)).as_dict(),
        "prefix": settings.topics.prefix,
        "processors": groups,
        "archivers": archivers,
        "dead_letters": counts.get(topics.deadletter, 0),
        "deadletter_topic": topics.deadletter,
        "replay_topics": {t: {"task": t[len(replay_prefix):], "records": counts.get(t, 0)}
                          for t in replay},
    }


async def restore_scheduler(settings: Settings) -> Any:
    """A SchedulerCore rebuilt from the committed ``<prefix>.scheduler.state`` changelog (the
    latest record per key; tombstones delete), configured as the worker configures it."""
    from trajbus.consumers.engine.processors import SchedulerProcessor

    await check_broker(settings.kafka)
    parts = await read_records(settings, [f"{settings.topics.prefix}.scheduler.state"])
    latest: dict[str, bytes | None] = {}
    for tp in sorted(parts, key=lambda tp: tp.partition):
        for r in parts[tp]:
            latest[r.key.decode() if r.key else ""] = r.value or None
    core = SchedulerProcessor(settings).core
    core.restore_snapshot({k: v for k, v in latest.items() if v is not None})
    return core
