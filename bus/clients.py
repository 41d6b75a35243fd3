"""Every Kafka client trajbus builds is built here, with the same connection options.

- :func:`connection_options`: bootstrap, TLS and SASL for any aiokafka client; building them
  also installs the process-wide client behaviour (paced reconnects, ``bus/reconnect.py``;
  OffsetFetch's request-level errors raised, ``bus/offset_fetch.py``; bootstrap hosts tried
  in the order the start-up check chose, ``bus/kafka.py``).
- :func:`new_consumer`, :func:`new_producer`, :func:`new_admin`: a client, not started.
  Callers own its start and close (``bus/closing.py``). A process shares one producer
  (``bus/producer.py``); a role that needs its own client (a transactional producer, a
  consumer per group) builds it here, once, and keeps it.

Guarantee: a producer built here is idempotent with ``acks=all`` unless the caller overrides
it, so a retried send is written once per partition, in order.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import random
import ssl
import time
from typing import Any

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer
from aiokafka.admin import AIOKafkaAdminClient
from aiokafka.errors import KafkaConnectionError, NodeNotReadyError, RequestTimedOutError
from aiokafka.partitioner import DefaultPartitioner, murmur2

from trajbus.bus.offset_fetch import install as install_offset_fetch_check
from trajbus.bus.reconnect import install as install_reconnect_backoff
from trajbus.bus.settings import KafkaSettings

log = logging.getLogger("trajbus.kafka")

# bootstrap list -> the same hosts, those that answered the start-up check first (see
# order_bootstrap): a node that accepts connections but answers nothing (paused, overloaded)
# holds a client's start for its request timeout before the next host is tried. aiokafka
# shuffles the bootstrap hosts (collect_hosts(randomize=True)); _keep_chosen_order makes it
# keep the order of the lists chosen here.
_BOOTSTRAP_ORDER: dict[str, str] = {}


def _keep_chosen_order() -> None:
    """Once per process: aiokafka's clients bootstrap from a list in ``_BOOTSTRAP_ORDER``'s
    values in that order (other lists are still shuffled, as aiokafka does)."""
    import aiokafka.client as aiokafka_client

    original = aiokafka_client.collect_hosts
    if getattr(original, "_trajbus_ordered", False):
        return

    def collect_hosts(hosts: Any, randomize: bool = True) -> Any:
        chosen = isinstance(hosts, str) and hosts in _BOOTSTRAP_ORDER.values()
        return original(hosts, randomize=randomize and not chosen)

    collect_hosts._trajbus_ordered = True  # type: ignore[attr-defined]
    aiokafka_client.collect_hosts = collect_hosts


def connection_options(k: KafkaSettings) -> dict[str, Any]:
    """Options common to aiokafka producers, consumers and admin clients. Building them also
    applies the reconnect backoff to the process's aiokafka clients (``bus/reconnect.py``)
    and the check of OffsetFetch's request-level errors (``bus/offset_fetch.py``)."""
    install_reconnect_backoff(k.reconnect_backoff_ms, k.reconnect_backoff_max_ms)
    install_offset_fetch_check()
    _keep_chosen_order()
    opts: dict[str, Any] = {
        "bootstrap_servers": _BOOTSTRAP_ORDER.get(k.bootstrap_servers, k.bootstrap_servers),
        "security_protocol": k.security_protocol,
        "request_timeout_ms": k.request_timeout_ms,
    }
    if k.security_protocol in ("SSL", "SASL_SSL"):
        ctx = ssl.create_default_context(cafile=k.ssl_cafile)
        if k.ssl_certfile:
            ctx.load_cert_chain(k.ssl_certfile, k.ssl_keyfile)
        opts["ssl_context"] = ctx
    if k.security_protocol.startswith("SASL"):
        if not (k.sasl_mechanism and k.sasl_username and k.sasl_password):
            raise ValueError(
                "SASL needs TRAJBUS_KAFKA__SASL_MECHANISM, TRAJBUS_KAFKA__SASL_USERNAME and "
                "TRAJBUS_KAFKA__SASL_PASSWORD"
            )
        opts.update(
            sasl_mechanism=k.sasl_mechanism,
            sasl_plain_username=k.sasl_username,
            sasl_plain_password=k.sasl_password.get_secret_value(),
        )
    return opts


#: How long an admin request waits for a connection to one node before it tries another.
NODE_READY_TIMEOUT_S = 3.0
#: How long a request that any node may answer (metadata, describe) waits for one node's
#: answer before it asks another: a frozen node accepts the connection and never answers.
NODE_ANSWER_TIMEOUT_S = 5.0
#: Nodes that did not answer in time are asked last for this long (monotonic seconds).
_SILENT_FOR_S = 60.0
_silent_nodes: dict[tuple[str, int], float] = {}


def ask_last(address: str) -> None:
    """Requests that any node may answer go to the node at ``host:port`` last for a while:
    it did not answer a request in time (the start-up check's bootstrap, or a request of
    :class:`ClusterAdminClient`)."""
    host, _, port = address.strip().rpartition(":")
    if host and port.isdigit():
        _ask_last_for_a_while((host, int(port)))


def _ask_last_for_a_while(node: tuple[str, int]) -> None:
    _silent_nodes[node] = time.monotonic() + _SILENT_FOR_S


class ClusterAdminClient(AIOKafkaAdminClient):
    """aiokafka's admin client, for a cluster with a node down: a request that may go to any
    node goes to one that is connected or answers, not to a random one of the metadata (a
    dead node is in the metadata until the controller fences it, and then the request fails
    with ``NodeNotReadyError`` one time in three on a 3-node cluster)."""

    async def _send_request(self, request: Any, node_id: int | None = None) -> Any:
        if node_id is not None:
            return await super()._send_request(request, node_id)
        cluster = self._client.cluster
        nodes = [b.nodeId for b in cluster.brokers()]
        random.shuffle(nodes)
        conns = self._client._conns
        now = time.monotonic()

        def address(n: int) -> tuple[str, int]:
            b = cluster.broker_metadata(n)
            return (b.host, b.port) if b is not None else ("", n)

        # nodes that recently did not answer go last, nodes already connected first: a new
        # connection to a node that is frozen (SIGSTOP, a long GC pause) is accepted by its
        # kernel and then answers nothing
        nodes.sort(key=lambda n: (_silent_nodes.get(address(n), 0.0) > now,
                                  not any(key[0] == n and conn.connected()
                                          for key, conn in conns.items())))
        last: Exception | None = None
        for node in nodes or [self._client.get_random_node()]:
            try:
                if not await asyncio.wait_for(self._client.ready(node), NODE_READY_TIMEOUT_S):
                    continue
                answer = await asyncio.wait_for(self._client.send(node, request),
                                                NODE_ANSWER_TIMEOUT_S)
                _silent_nodes.pop(address(node), None)
                return answer
            except TimeoutError as exc:
                _ask_last_for_a_while(address(node))
                last = exc  # that node is frozen or overloaded: the next one
            except (KafkaConnectionError, NodeNotReadyError, RequestTimedOutError) as exc:
                last = exc  # that node went away: the next one
        if last is not None:
            raise last
        raise NodeNotReadyError("no node of the cluster is ready")


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
    """aiokafka producer options: idempotent, ``acks=all``, the configured compression (lz4 at
    the configured level), batching and request size; ``overrides`` win."""
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


def new_consumer(k: KafkaSettings, *topics: str, **options: Any) -> AIOKafkaConsumer:
    """A consumer (not started) of ``topics`` with trajbus's connection options; ``options``
    (group, offsets, fetch sizes) are aiokafka's and override the connection options."""
    return AIOKafkaConsumer(*topics, **{**connection_options(k), **options})


def new_producer(k: KafkaSettings, **overrides: Any) -> AIOKafkaProducer:
    """A producer (not started) with :func:`producer_options` (idempotent, ``acks=all``,
    the configured compression and batching); ``overrides`` are aiokafka's options."""
    return AIOKafkaProducer(**producer_options(k, **overrides))


def new_admin(k: KafkaSettings, what: str, **overrides: Any) -> ClusterAdminClient:
    """An admin client (not started); ``what`` names it in the broker's logs."""
    return ClusterAdminClient(**{**connection_options(k), **overrides},
                              client_id=f"{k.client_id}-{what}")


admin_client = new_admin
"""The name :func:`new_admin` had before every client was built here; kept for callers."""
