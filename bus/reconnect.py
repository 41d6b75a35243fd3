"""Reconnect backoff for aiokafka's clients, as Kafka's own clients have (KIP-144).

aiokafka 0.14 has no ``reconnect.backoff.ms``: while a broker is away, every routine of every
client (the metadata synchronizer, the fetcher, the producer's sender, the group coordinator
look-up) opens a new connection on each of its retries, and each failure wakes the metadata
synchronizer for one more. An idle worker of three processors measured ~185 connection
attempts a second during an outage (RELIABILITY finding Z; aio-libs/aiokafka#496 and the
unmerged #1014 describe the same).

With :func:`install`, a connection to a broker address that just failed is not attempted
again before a backoff: ``reconnect_backoff_ms`` after the first failure, doubling with each
consecutive failure up to ``reconnect_backoff_max_ms``, each delay drawn within +-20 % so that
clients do not retry in step; one success resets it. The state is per address and shared by
every aiokafka client of the process (one broker address, one backoff).

Guarantee: only *when* a connection is attempted changes, never what is sent or committed. A
connection asked for during the backoff is answered "node not ready", which every aiokafka
caller already handles as a failed connection (it retries after its ``retry_backoff_ms``), so
the clients' behaviour during an outage is the same, with ~10x fewer connection attempts; a
broker that comes back is reconnected to within ``reconnect_backoff_max_ms`` (+20 %).

The backoff arithmetic is :class:`ReconnectBackoff` (time passed in, no clock inside);
:func:`install` wraps ``AIOKafkaClient._get_conn`` once per process and is idempotent.
"""

from __future__ import annotations

import logging
import random
import time
from dataclasses import dataclass
from typing import Any

log = logging.getLogger("trajbus.kafka")

JITTER = 0.2  # Kafka's clients: each backoff is drawn within +-20 % of its nominal value


@dataclass
class _AddressState:
    failures: int = 0
    retry_at: float = 0.0


class ReconnectBackoff:
    """Per-address exponential backoff of connection attempts. Pure: ``now`` is passed in."""

    def __init__(self, base_s: float = 0.05, max_s: float = 1.0,
                 rng: random.Random | None = None) -> None:
        self.base_s = base_s
        self.max_s = max_s
        self._rng = rng or random.Random()
        self._addresses: dict[tuple[str, int], _AddressState] = {}
        self.refused = 0  # attempts answered "not ready" without a connection
        self.failed_attempts = 0

    def configure(self, base_s: float, max_s: float) -> None:
        self.base_s = base_s
        self.max_s = max(base_s, max_s)

    def nominal_delay(self, failures: int) -> float:
        """The backoff after ``failures`` consecutive failures, before jitter."""
        if failures <= 0 or self.base_s <= 0:
            return 0.0
        return min(self.max_s, self.base_s * 2 ** min(failures - 1, 30))

    def may_connect(self, address: tuple[str, int], now: float) -> bool:
        state = self._addresses.get(address)
        if state is None or now >= state.retry_at:
            return True
        self.refused += 1
        return False

    def failed(self, address: tuple[str, int], now: float) -> float:
        """Record a failed attempt; returns the delay before the next one may be made."""
        state = self._addresses.setdefault(address, _AddressState())
        state.failures += 1
        self.failed_attempts += 1
        delay = self.nominal_delay(state.failures) * (1 + JITTER * (2 * self._rng.random() - 1))
        state.retry_at = now + delay
        return delay

    def succeeded(self, address: tuple[str, int]) -> None:
        self._addresses.pop(address, None)

    def failures(self, address: tuple[str, int]) -> int:
        state = self._addresses.get(address)
        return state.failures if state is not None else 0


BACKOFF = ReconnectBackoff()
_installed = False


def install(base_ms: int, max_ms: int) -> None:
    """Apply the backoff to every aiokafka client of this process (idempotent; the latest
    settings win). ``base_ms`` 0 turns it off."""
    global _installed
    BACKOFF.configure(base_ms / 1000, max_ms / 1000)
    if _installed:
        return
    from aiokafka.client import AIOKafkaClient, ConnectionGroup

    original = getattr(AIOKafkaClient, "_get_conn", None)
    if original is None or not callable(original):
        log.warning("aiokafka %s has no AIOKafkaClient._get_conn: the reconnect backoff is not "
                    "applied", _aiokafka_version())
        _installed = True
        return

    async def _get_conn(self: Any, node_id: Any, **kwargs: Any) -> Any:
        conn = self._conns.get((node_id, kwargs.get("group", ConnectionGroup.DEFAULT)))
        if conn is not None and conn.connected():
            return conn  # the hot path: no clock read, no state
        broker = self.cluster.broker_metadata(node_id)
        if broker is None or BACKOFF.base_s <= 0:
            return await original(self, node_id, **kwargs)
        address = (broker.host, broker.port)
        if not BACKOFF.may_connect(address, time.monotonic()):
            return None
        conn = await original(self, node_id, **kwargs)
        if conn is None:
            BACKOFF.failed(address, time.monotonic())
        else:
            BACKOFF.succeeded(address)
        return conn

    _get_conn.__wrapped__ = original  # type: ignore[attr-defined]
    AIOKafkaClient._get_conn = _get_conn
    _installed = True


def _aiokafka_version() -> str:
    try:
        import aiokafka

        return str(aiokafka.__version__)
    except Exception:  # pragma: no cover - only for the message
        return "?"
