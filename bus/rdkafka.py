"""trajbus settings -> librdkafka (confluent-kafka) configuration.

The hot paths (the worker's runner) use confluent-kafka: batching, compression and
transactions run in C, outside the GIL. aiokafka stays where asyncio fits and the volume is a
trainer's (ReplayClient, operator tools). Both clients take the same :class:`KafkaSettings`;
this module is the librdkafka half of the mapping (:func:`trajbus.bus.kafka.connection_options`
is the aiokafka half):

- bootstrap_servers -> bootstrap.servers; client_id -> client.id;
  security_protocol -> security.protocol; request_timeout_ms -> socket.timeout.ms;
- ssl_cafile, ssl_certfile, ssl_keyfile (aiokafka: one SSL context) -> ssl.ca.location,
  ssl.certificate.location, ssl.key.location, and the broker's name verified against its
  certificate, as Python's default context does;
- sasl_mechanism, sasl_username, sasl_password (aiokafka: sasl_plain_username/password) ->
  sasl.mechanisms, sasl.username, sasl.password;
- compression_type, linger_ms, max_request_size -> compression.type, linger.ms,
  message.max.bytes.

``tests/test_client_auth.py`` and ``tests/test_security.py`` run both clients against TLS and
SASL listeners.
"""

from __future__ import annotations

import os
from typing import Any

from trajbus.bus.settings import KafkaSettings


def common_config(k: KafkaSettings, client_id: str | None = None) -> dict[str, Any]:
    """Connection settings for any librdkafka client (producer, consumer, admin)."""
    cfg: dict[str, Any] = {
        "bootstrap.servers": k.bootstrap_servers,
        "client.id": client_id or k.client_id,
        "security.protocol": k.security_protocol.lower(),
        "socket.timeout.ms": k.request_timeout_ms,
        # librdkafka logs through Python's logging when a logger is given; errors surface
        # as exceptions on the calls that need the broker.
        "log.connection.close": False,
    }
    debug = os.environ.get("TRAJBUS_RDKAFKA_DEBUG")  # e.g. "cgrp,eos": librdkafka's debug log
    if debug:
        cfg["debug"] = debug
    if k.security_protocol in ("SSL", "SASL_SSL"):
        if k.ssl_cafile:
            cfg["ssl.ca.location"] = k.ssl_cafile
        if k.ssl_certfile:
            cfg["ssl.certificate.location"] = k.ssl_certfile
        if k.ssl_keyfile:
            cfg["ssl.key.location"] = k.ssl_keyfile
        # like Python's default SSL context: verify the broker's name against its certificate
        cfg["ssl.endpoint.identification.algorithm"] = "https"
    if k.security_protocol.startswith("SASL"):
        if not (k.sasl_mechanism and k.sasl_username and k.sasl_password):
            raise ValueError(
                "SASL needs TRAJBUS_KAFKA__SASL_MECHANISM, TRAJBUS_KAFKA__SASL_USERNAME and "
                "TRAJBUS_KAFKA__SASL_PASSWORD"
            )
        cfg.update({
            "sasl.mechanisms": k.sasl_mechanism,
            "sasl.username": k.sasl_username,
            "sasl.password": k.sasl_password.get_secret_value(),
        })
    return cfg


def producer_config(k: KafkaSettings, client_id: str | None = None, *,
                    transactional_id: str | None = None,
                    max_request_size: int | None = None,
                    linger_ms: int | None = None) -> dict[str, Any]:
    """An idempotent producer (acks=all), transactional when ``transactional_id`` is given."""
    cfg = common_config(k, client_id)
    cfg.update({
        "enable.idempotence": True,
        "acks": "all",
        "compression.type": k.compression_type or "none",
        "linger.ms": k.linger_ms if linger_ms is None else linger_ms,
        "message.max.bytes": max_request_size or k.max_request_size,
        "batch.size": max(k.max_batch_size, 16384),
        # retried sends stay in order and exactly once (idempotence); keep retrying quickly
        # through short broker hiccups (a transaction's own timeout bounds the whole)
        "retry.backoff.ms": 20,
        "retry.backoff.max.ms": 1000,
    })
    if transactional_id is not None:
        cfg["transactional.id"] = transactional_id
        cfg["transaction.timeout.ms"] = 60_000
    return cfg


def consumer_config(k: KafkaSettings, group_id: str, client_id: str | None = None, *,
                    instance_id: str | None = None,
                    max_fetch_bytes: int | None = None) -> dict[str, Any]:
    """A read_committed consumer that never commits by itself (offsets go into transactions),
    with incremental (cooperative) rebalancing; static membership when ``instance_id`` is
    given (a restarted member with the same id takes its partitions back at once)."""
    fetch = max_fetch_bytes or k.max_request_size
    cfg = common_config(k, client_id)
    cfg.update({
        "group.id": group_id,
        "isolation.level": "read_committed",
        "enable.auto.commit": False,
        "enable.auto.offset.store": False,
        "auto.offset.reset": "earliest",
        "partition.assignment.strategy": "cooperative-sticky",
        "session.timeout.ms": 10_000,
        "heartbeat.interval.ms": 3_000,
        "max.poll.interval.ms": 300_000,
        "topic.metadata.refresh.interval.ms": 5_000,  # new replay topics are seen quickly
        "max.partition.fetch.bytes": fetch,
        "fetch.max.bytes": 4 * fetch,
        "fetch.wait.max.ms": 100,
    })
    if instance_id is not None:
        cfg["group.instance.id"] = instance_id
    return cfg
