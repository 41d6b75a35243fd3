"""The process's one Kafka producer: built lazily, shared, idempotent.

Field lesson (MISSION.md): a client that owns a connection pool must be built once per process;
one per attempt leaked thousands of file descriptors. :func:`get_producer` returns the same
started :class:`aiokafka.AIOKafkaProducer` for every caller on the running event loop.

Guarantee: ``enable_idempotence=True`` (so ``acks=all``): a retried send is written once per
partition, in order. A send is durable when its future resolves.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from typing import Any

from aiokafka import AIOKafkaProducer
from aiokafka.partitioner import DefaultPartitioner, murmur2

from trajbus.bus.closing import close_client
from trajbus.bus.kafka import (
    BrokerUnavailableError,
    connection_options,
    prefer_answering_hosts,
)
from trajbus.bus.settings import KafkaSettings, get_settings

log = logging.getLogger(__name__)

_producer: AIOKafkaProducer | None = None
_loop: asyncio.AbstractEventLoop | None = None
_lock: asyncio.Lock | None = None
builds = 0  # how many producers this process has built (tests assert it stays at 1)


class CachedPartitioner(DefaultPartitioner):
    """aiokafka's default partitioner (Java-compatible murmur2 of the key, modulo the number of
    partitions; a None key goes to a random available partition) with the key's murmur2
    memoised: it is pure Python (~5 us a record) and every record of a sandbox has the same
    key. Same partition for every key as the default."""

    MAX_KEYS = 4096

    def __init__(self) -> None:
        self._hash: dict[bytes, int] = {}

    def __call__(self, key: bytes | None, all_partitions: list[int],
                 available: list[int]) -> int:
        if key is None:
            return super().__call__(key, all_partitions, available)
        h = self._hash.get(key)
        if h is None:
            if len(self._hash) >= self.MAX_KEYS:
                self._hash.clear()
            h = self._hash[key] = murmur2(key) & 0x7FFFFFFF
        return all_partitions[h % len(all_partitions)]


def set_lz4_level(level: int) -> bool:
    """Make aiokafka's producers compress lz4 at ``level`` (process-wide).

    aiokafka offers no compression level: its record batch builders (the C one and the
    pure-Python fallback) call the module-level ``lz4_encode(data)``, whose default is level 9,
    lz4's slow high-compression mode. They are pointed at ``lz4_encode(data, level=level)``.
    Returns False (and logs) if this aiokafka has no such hook: the default level then stays,
    nothing else changes."""
    from aiokafka import codec
    from aiokafka.record import default_records as py_records

    try:
        from aiokafka.record._crecords import default_records as c_records
    except ImportError:  # no C extension: the Python builder is the one in use
        c_records = None
    encode = functools.partial(codec.lz4_encode, level=level)
    done = False
    for module in (c_records, py_records):
        if module is not None and hasattr(module, "lz4_encode"):
            module.lz4_encode = encode
            done = True
    if not done:
        log.warning("this aiokafka has no lz4_encode hook: lz4 stays at its default level 9")
    return done


def producer_options(k: KafkaSettings, **overrides: Any) -> dict[str, Any]:
    if (overrides.get("compression_type", k.compression_type)) == "lz4":
        set_lz4_level(k.lz4_level)
    opts = connection_options(k)
    opts.update(
        client_id=f"{k.client_id}-producer",
        enable_idempotence=True,
        acks="all",
        compression_type=k.compression_type,
        linger_ms=k.linger_ms,
        max_batch_size=k.max_batch_size,
        max_request_size=k.max_request_size,
        partitioner=CachedPartitioner(),
    )
    opts.update(overrides)
    return opts


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
            producer = AIOKafkaProducer(**producer_options(k))
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
