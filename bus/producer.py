"""The process's one Kafka producer: built lazily, shared, idempotent.

Field lesson (MISSION.md): a client that owns a connection pool must be built once per process;
one per attempt leaked thousands of file descriptors. :func:`get_producer` returns the same
started :class:`aiokafka.AIOKafkaProducer` for every caller on the running event loop.

Guarantee: ``enable_idempotence=True`` (so ``acks=all``): a retried send is written once per
partition, in order. A send is durable when its future resolves.
"""

from __future__ import annotations

import asyncio
import logging

from aiokafka import AIOKafkaProducer

from trajbus.bus.clients import CachedPartitioner, new_producer, producer_options, set_lz4_level
from trajbus.bus.closing import close_client
from trajbus.bus.kafka import BrokerUnavailableError, prefer_answering_hosts
from trajbus.bus.settings import KafkaSettings, get_settings

log = logging.getLogger(__name__)

_producer: AIOKafkaProducer | None = None
_loop: asyncio.AbstractEventLoop | None = None
_lock: asyncio.Lock | None = None
__all__ = ["CachedPartitioner", "close_producer", "get_producer", "producer_options",
           "replace_producer", "set_lz4_level"]
builds = 0  # how many producers this process has built (tests assert it stays at 1)


async def get_producer(settings: KafkaSettings | None = None) -> AIOKafkaProducer:
    """The shared producer, started on first use (lock-guarded). Fails fast, with what to set,
    when the broker is unreachable."""
    global _producer, _loop, _lock, builds
    loop = asyncio.get_running_loop()
    if _producer is not None and _loop is loop:
        return _producer
    if _lock is None or _loop is not loop:
        # A new event loop (e.g. a new asyncio.run) cannot reuse the old loop's client.
        if _producer is not None:
            await _discard()
        _lock = asyncio.Lock()
        _loop = loop
    async with _lock:
        if _producer is None:
            k = settings or get_settings().kafka
            await prefer_answering_hosts(k)
            producer = new_producer(k)
            builds += 1
            try:
                await asyncio.wait_for(producer.start(), timeout=k.connect_timeout_s)
            except Exception as exc:
                await close_client(producer, "producer")
                raise BrokerUnavailableError(
                    f"cannot start a Kafka producer for {k.bootstrap_servers} "
                    f"({type(exc).__name__}: {exc}). Start the local broker with "
                    "`trajbus kafka up`, or set TRAJBUS_KAFKA__BOOTSTRAP_SERVERS."
                ) from exc
            _producer = producer
    return _producer


async def replace_producer(broken: AIOKafkaProducer,
                           settings: KafkaSettings | None = None) -> AIOKafkaProducer:
    """The shared producer, built anew if it is still ``broken`` (its deliveries fail with an
    error no retry of it cures: :func:`~trajbus.bus.kafka.lasting_delivery_error`). The broken
    one is closed within ``connect_timeout_s``; what it still held fails, and its senders
    send it again through the new one (downstream dedupes by (sandbox, episode, seq))."""
    global _producer
    current = _producer
    if current is not None and current is broken:
        _producer = None
        k = settings or get_settings().kafka
        await close_client(current, "broken producer", timeout=k.connect_timeout_s)
    return await get_producer(settings)


async def _discard() -> None:
    global _producer
    p, _producer = _producer, None
    if p is not None:
        try:
            await close_client(p, "producer of an old event loop")
        except Exception:  # the old loop may be gone; the client is dropped either way
            pass


async def close_producer() -> None:
    """Flush and close the shared producer (call once at process exit)."""
    global _producer
    p, _producer = _producer, None
    if p is not None:
        await p.flush()
        await close_client(p, "producer")
