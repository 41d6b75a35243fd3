"""Reconnect backoff for aiokafka's clients, as Kafka's own clients have (KIP-144).

aiokafka 0.14 has no ``reconnect.backoff.ms``: while a broker is away, every routine of every
client (the metadata synchronizer, the fetcher, the producer's sender, the group coordinator
look-up) opens a new connection on each of its retries, and each failure wakes the metadata
synchronizer for one more: even an idle worker makes hundreds of connection attempts a second
during an outage (aio-libs/aiokafka#496 and the unmerged #1014 describe the same;
docs/decisions/0001-paced-reconnects.md has the measurements).

With :func:`install`, a connection to a broker address that just failed is not attempted
again before a backoff: ``reconnect_backoff_ms`` after the first failure, doubling with each
consecutive failure up to ``reconnect_backoff_max_ms``, each delay drawn within +-20 % so that
clients do not retry in step; one success resets it. While an address is failing, one attempt
to it is in flight at a time. The state is per address and shared by every aiokafka client of
the process (one broker address, one backoff); the settings of the latest client built win.

Guarantee: only *when* a connection is attempted changes, never what is sent or committed. A
connection asked for during the backoff is answered "node not ready", as a failed attempt
would be: aiokafka's long-running routines (fetcher, sender, group coordinator, metadata)
retry it after their ``retry_backoff_ms``; a one-shot admin request fails as it would have
failed on a refused connection. A broker that comes back is reconnected to within
``reconnect_backoff_max_ms`` (+20 %). An idle worker then makes about one attempt a second
per address while the broker is away.

The backoff arithmetic is :class:`ReconnectBackoff` (time passed in, no clock inside).
:func:`install` wraps aiokafka's ``create_conn`` (every attempt, bootstrap included, records
its outcome) and ``AIOKafkaClient._get_conn`` (where an attempt may be refused), once per
process; it also paces failed metadata updates (:func:`_pace_failed_metadata_updates`).
"""

from __future__ import annotations

import asyncio
import logging
import random
import threading
import time
from dataclasses import dataclass
from typing import Any

log = logging.getLogger("trajbus.kafka")

JITTER = 0.2  # Kafka's clients: each backoff is drawn within +-20 % of its nominal value
Address = tuple[str, int]


@dataclass
class _AddressState:
    failures: int = 0
    retry_at: float = 0.0
    in_flight: int = 0
    failed_at: float = 0.0


class ReconnectBackoff:
    """Per-address exponential backoff of connection attempts. Pure: ``now`` is passed in.

    An address with no failure on record is never held back (clients connect at once and
    side by side, as without the backoff)."""

    def __init__(self, base_s: float = 0.05, max_s: float = 1.0,
                 rng: random.Random | None = None) -> None:
        self.base_s = base_s
        self.max_s = max_s
        self._rng = rng or random.Random()
        self._addresses: dict[Address, _AddressState] = {}
        self.refused = 0  # attempts answered "not ready" without a connection

    def configure(self, base_s: float, max_s: float) -> None:
        self.base_s = base_s
        self.max_s = max(base_s, max_s)

    def nominal_delay(self, failures: int) -> float:
        """The backoff after ``failures`` consecutive failures, before jitter."""
        if failures <= 0 or self.base_s <= 0:
            return 0.0
        return min(self.max_s, self.base_s * 2 ** min(failures - 1, 30))

    def may_connect(self, address: Address, now: float) -> bool:
        """Whether an attempt may start now: no failure on record, or the backoff has passed
        and no other attempt to the failing address is in flight."""
        state = self._addresses.get(address)
        if state is None or (state.in_flight == 0 and now >= state.retry_at):
            return True
        self.refused += 1
        return False

    def begin(self, address: Address) -> None:
        state = self._addresses.get(address)
        if state is not None:
            state.in_flight += 1

    def end(self, address: Address) -> None:
        state = self._addresses.get(address)
        if state is not None and state.in_flight > 0:
            state.in_flight -= 1

    def failed(self, address: Address, now: float) -> float:
        """Record a failed attempt; returns the delay before the next one may be made."""
        state = self._addresses.setdefault(address, _AddressState())
        state.failures += 1
        state.failed_at = now
        delay = self.nominal_delay(state.failures) * (1 + JITTER * (2 * self._rng.random() - 1))
        state.retry_at = now + delay
        return delay

    def succeeded(self, address: Address) -> None:
        self._addresses.pop(address, None)

    def failing_addresses(self, now: float) -> int:
        """How many addresses are failing now: their last connection attempt failed, and
        recently (within three backoffs, at least 10 s). An address nobody retries any more
        (a client of another cluster, long closed) does not count."""
        recent_s = max(10.0, 3 * self.max_s)
        return sum(1 for state in self._addresses.values()
                   if state.failures and now - state.failed_at <= recent_s)

    def failures(self, address: Address) -> int:
        state = self._addresses.get(address)
        return state.failures if state is not None else 0


BACKOFF = ReconnectBackoff()
_install_lock = threading.Lock()
_installed = False


def install(base_ms: int, max_ms: int) -> None:
    """Apply the backoff to every aiokafka client of this process (idempotent and
    thread-safe; the latest settings win). ``base_ms`` 0 turns it off."""
    global _installed
    BACKOFF.configure(base_ms / 1000, max_ms / 1000)
    if _installed:
        return
    with _install_lock:
        if not _installed:
            _wrap_aiokafka()
            _installed = True


def _wrap_aiokafka() -> None:
    import aiokafka.client as client_module
    from aiokafka.client import AIOKafkaClient, ConnectionGroup

    original_create = getattr(client_module, "create_conn", None)
    original_get = getattr(AIOKafkaClient, "_get_conn", None)
    if not (callable(original_create) and callable(original_get)):
        log.warning("aiokafka %s has no create_conn or AIOKafkaClient._get_conn: the reconnect "
                    "backoff is not applied", _aiokafka_version())
        return

    async def create_conn(host: str, port: int, *args: Any, **kwargs: Any) -> Any:
        """Every attempt (bootstrap included) records its outcome for its address."""
        try:
            conn = await original_create(host, port, *args, **kwargs)
        except asyncio.CancelledError:
            raise
        except Exception:
            BACKOFF.failed((host, port), time.monotonic())
            raise
        BACKOFF.succeeded((host, port))
        return conn

    async def _get_conn(self: Any, node_id: Any, *, group: Any = ConnectionGroup.DEFAULT,
                        no_hint: bool = False) -> Any:
        conn = self._conns.get((node_id, group))
        if conn is not None and conn.connected():
            return conn  # the hot path (every request): no clock read, no state
        broker = self.cluster.broker_metadata(node_id)
        if broker is None or BACKOFF.base_s <= 0:
            return await original_get(self, node_id, group=group, no_hint=no_hint)
        address = (broker.host, broker.port)
        if not BACKOFF.may_connect(address, time.monotonic()):
            return None  # "node not ready", as a failed attempt answers
        BACKOFF.begin(address)
        try:
            return await original_get(self, node_id, group=group, no_hint=no_hint)
        finally:
            BACKOFF.end(address)

    create_conn.__wrapped__ = original_create  # type: ignore[attr-defined]
    _get_conn.__wrapped__ = original_get  # type: ignore[attr-defined]
    client_module.create_conn = create_conn
    AIOKafkaClient._get_conn = _get_conn
    _pace_failed_metadata_updates(AIOKafkaClient)


def _pace_failed_metadata_updates(client_class: Any) -> None:
    """A failed metadata update returns after the client's ``retry_backoff_ms``.

    aiokafka's fetcher, while a partition has no known leader, asks for an update and waits
    only for that update (aio-libs/aiokafka#1155 is the same loop for fetch errors); with
    every broker away -- or held back by the backoff above, which answers at once -- each
    update fails at once and the fetcher loops without a pause, logging "Unable to update
    metadata" each time. Paced, a failing client makes at most one update per
    ``retry_backoff_ms``; a successful update is never delayed."""
    original_update = getattr(client_class, "_metadata_update", None)
    if not callable(original_update):
        log.warning("aiokafka %s has no AIOKafkaClient._metadata_update: failed metadata "
                    "updates are not paced", _aiokafka_version())
        return

    async def _metadata_update(self: Any, cluster_metadata: Any, topics: Any) -> Any:
        updated = await original_update(self, cluster_metadata, topics)
        if not updated:
            await asyncio.sleep(getattr(self, "_retry_backoff", 0.1))
        return updated

    _metadata_update.__wrapped__ = original_update  # type: ignore[attr-defined]
    client_class._metadata_update = _metadata_update


def _aiokafka_version() -> str:
    try:
        import aiokafka

        return str(aiokafka.__version__)
    except Exception:  # pragma: no cover - only for the message
        return "?"
