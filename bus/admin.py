"""Idempotent topic creation and schema registration.

``ensure_topics`` creates what is missing and leaves existing topics alone, so running it twice
is harmless. ``register_schemas`` publishes every bundled writer schema to the compacted
``trajbus.schemas`` topic (key: fingerprint hex), where decoders of other versions find them.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable

from aiokafka.admin import AIOKafkaAdminClient, NewTopic
from aiokafka.errors import TopicAlreadyExistsError

from trajbus.bus.kafka import connection_options
from trajbus.bus.producer import get_producer
from trajbus.bus.settings import Settings
from trajbus.bus.topics import Topics, TopicSpec
from trajbus.schemas.registry import SchemaRegistry, default_registry


async def ensure_topics(
    settings: Settings, specs: Iterable[TopicSpec]
) -> tuple[list[str], list[str]]:
    """Create the missing topics. Returns (created, already_present)."""
    specs = list(specs)
    admin = AIOKafkaAdminClient(
        **connection_options(settings.kafka), client_id=f"{settings.kafka.client_id}-admin"
    )
    await admin.start()
    try:
        existing = set(await admin.list_topics())
        missing = [s for s in specs if s.name not in existing]
        created: list[str] = []
        for spec in missing:
            topic = NewTopic(
                spec.name,
                num_partitions=spec.partitions,
                replication_factor=settings.topics.replication_factor,
                topic_configs=spec.kafka_configs(),
            )
            try:
                resp = await admin.create_topics([topic])
                for name, code, *rest in getattr(resp, "topic_errors", []) or []:
                    if code not in (0, TopicAlreadyExistsError.errno):
                        raise RuntimeError(f"creating topic {name}: error {code} {rest}")
            except TopicAlreadyExistsError:
                pass  # raced with another creator: fine
            created.append(spec.name)
        await _wait_visible(admin, [s.name for s in missing])
        present = sorted(s.name for s in specs if s.name in existing)
        return created, present
    finally:
        await admin.close()


async def _wait_visible(admin: AIOKafkaAdminClient, names: list[str], timeout: float = 30) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while names:
        have = set(await admin.list_topics())
        names = [n for n in names if n not in have]
        if not names:
            return
        if asyncio.get_running_loop().time() > deadline:
            raise TimeoutError(f"topics not visible after {timeout}s: {names}")
        await asyncio.sleep(0.1)


async def ensure_base_topics(
    settings: Settings, tasks: Iterable[str] = ()
) -> tuple[list[str], list[str]]:
    topics = Topics(settings)
    specs = topics.specs + [
        topics.replay_spec(t, settings.topics.partitions, topics.derived_max_bytes)
        for t in tasks
    ]
    return await ensure_topics(settings, specs)


async def register_schemas(settings: Settings, registry: SchemaRegistry | None = None) -> int:
    """Publish every bundled schema to the schema topic. Idempotent (compacted by key)."""
    registry = registry or default_registry()
    producer = await get_producer(settings.kafka)
    topic = Topics(settings).schemas
    futures = []
    for name in registry.names:
        info = registry.reader(name)
        futures.append(
            await producer.send(topic, info.canonical.encode(), key=info.fingerprint.hex().encode())
        )
    await asyncio.gather(*futures)
    return len(futures)
