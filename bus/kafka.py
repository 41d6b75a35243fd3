"""Kafka connection options and the fail-fast broker check.

Every Kafka client trajbus builds takes its connection options from here, so TLS and SASL
settings reach all of them.
"""

from __future__ import annotations

import asyncio
import ssl
from typing import Any

from aiokafka.admin import AIOKafkaAdminClient

from trajbus.bus.settings import KafkaSettings


class BrokerUnavailableError(RuntimeError):
    """The configured Kafka bootstrap servers did not answer."""


def connection_options(k: KafkaSettings) -> dict[str, Any]:
    """Options common to aiokafka producers, consumers and admin clients."""
    opts: dict[str, Any] = {
        "bootstrap_servers": k.bootstrap_servers,
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
            sasl_plain_password=k.sasl_password,
        )
    return opts


async def check_broker(k: KafkaSettings) -> list[str]:
    """Fail fast: connect once and list topics, or raise an error that says what to set."""
    admin = AIOKafkaAdminClient(**connection_options(k), client_id=f"{k.client_id}-check")
    try:
        await asyncio.wait_for(admin.start(), timeout=k.connect_timeout_s)
        topics = await asyncio.wait_for(admin.list_topics(), timeout=k.connect_timeout_s)
    except Exception as exc:
        raise BrokerUnavailableError(
            f"Kafka at {k.bootstrap_servers} did not answer within {k.connect_timeout_s:.0f}s "
            f"({type(exc).__name__}: {exc}). Start the local broker with `trajbus kafka up`, "
            "or point TRAJBUS_KAFKA__BOOTSTRAP_SERVERS at a running cluster."
        ) from exc
    finally:
        await admin.close()
    return sorted(topics)
