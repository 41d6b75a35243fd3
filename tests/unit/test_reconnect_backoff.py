"""The reconnect backoff (trajbus.bus.reconnect). Its arithmetic, with time passed in: after a
failed connection to an address the next attempt waits 50 ms, doubling per consecutive failure
up to the max, each delay within +-20 %; a success resets it; addresses are independent. Its
wrapper around a real aiokafka client, against a closed port on loopback (a broker that is
away): requests in a tight loop do not each open a connection, one attempt at a time is in
flight, and a base of 0 turns it off. Real clients through a real broker outage:
test_faults_broker_clients.py."""

from __future__ import annotations

import asyncio
import random
import socket
import time
from collections.abc import AsyncIterator, Iterator
from typing import Any

import aiokafka.client as aiokafka_client
import pytest
from aiokafka.client import AIOKafkaClient
from aiokafka.protocol.metadata import MetadataResponse_v0

from trajbus.bus.reconnect import BACKOFF, JITTER, ReconnectBackoff, install
from trajbus.bus.settings import KafkaSettings

BROKER = ("127.0.0.1", 9092)
OTHER = ("127.0.0.1", 9093)


def test_delays_double_per_consecutive_failure_up_to_the_max() -> None:
    b = ReconnectBackoff(base_s=0.05, max_s=1.0)
    assert [b.nominal_delay(n) for n in range(0, 8)] == [
        0.0, 0.05, 0.1, 0.2, 0.4, 0.8, 1.0, 1.0]
    assert b.nominal_delay(10_000) == 1.0  # no overflow after a long outage


def test_each_delay_is_drawn_within_twenty_percent_of_its_nominal_value() -> None:
    b = ReconnectBackoff(base_s=0.05, max_s=1.0, rng=random.Random(7))
    delays = []
    for n in range(1, 200):
        delays.append((b.failed(BROKER, now=float(n * 10)), b.nominal_delay(n)))
    assert all(nom * (1 - JITTER) <= d <= nom * (1 + JITTER) for d, nom in delays)
    at_max = [d for d, nom in delays if nom == 1.0]
    assert max(at_max) - min(at_max) > 0.2, "no jitter: clients would retry in step"


def test_an_address_is_not_tried_again_before_its_backoff_has_passed() -> None:
    b = ReconnectBackoff(base_s=0.05, max_s=1.0, rng=random.Random(1))
    assert b.may_connect(BROKER, now=100.0)
    delay = b.failed(BROKER, now=100.0)
    assert not b.may_connect(BROKER, now=100.0 + delay * 0.99)
    assert b.refused == 1
    assert b.may_connect(BROKER, now=100.0 + delay)
    assert b.may_connect(OTHER, now=100.0), "one address's failures do not hold back another"


def test_a_successful_connection_resets_the_backoff() -> None:
    b = ReconnectBackoff(base_s=0.05, max_s=1.0, rng=random.Random(3))
    for i in range(6):
        b.failed(BROKER, now=float(i))
    assert b.failures(BROKER) == 6
    b.succeeded(BROKER)
    assert b.failures(BROKER) == 0 and b.may_connect(BROKER, now=5.0)
    first = b.failed(BROKER, now=10.0)
    assert first <= 0.05 * (1 + JITTER), "after a success the next failure starts again at base"


def test_only_addresses_retried_recently_count_as_failing() -> None:
    """A trainer's "working again" line waits for no failing address; an address nobody
    retries any more (a closed client's dead broker, in CI another test's) must not hold it
    back forever (found in CI, 2026-12-05: the line never came)."""
    b = ReconnectBackoff(base_s=0.05, max_s=1.0, rng=random.Random(3))
    b.failed(BROKER, now=100.0)
    b.failed(("127.0.0.1", 1), now=50.0)
    assert b.failing_addresses(now=100.5) == 1
    assert b.failing_addresses(now=115.0) == 0
    b.succeeded(BROKER)
    assert b.failing_addresses(now=100.5) == 0


def test_a_zero_base_turns_the_backoff_off() -> None:
    b = ReconnectBackoff(base_s=0.0, max_s=1.0)
    b.failed(BROKER, now=1.0)
    assert b.may_connect(BROKER, now=1.0)


def test_the_settings_default_to_kafkas_own_clients() -> None:
    k = KafkaSettings()
    assert (k.reconnect_backoff_ms, k.reconnect_backoff_max_ms) == (50, 1000)
    with pytest.raises(ValueError):
        KafkaSettings(reconnect_backoff_ms=-1)


# -- the wrapper, on a real aiokafka client of a closed port ---------------------------------


@pytest.fixture
def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])  # closed on return: connections are refused


@pytest.fixture
def attempts() -> Iterator[list[float]]:
    """Installs the backoff (defaults) and counts the connection attempts aiokafka really
    makes (the count sits below the backoff's wrapper: refused requests are not attempts)."""
    base, cap = BACKOFF.base_s, BACKOFF.max_s
    install(50, 1000)
    made: list[float] = []
    wrapped = aiokafka_client.create_conn

    async def counting(*args: Any, **kwargs: Any) -> Any:
        made.append(time.monotonic())
        return await wrapped(*args, **kwargs)

    aiokafka_client.create_conn = counting
    try:
        yield made
    finally:
        aiokafka_client.create_conn = wrapped
        BACKOFF.configure(base, cap)


@pytest.fixture
async def client(closed_port: int) -> AsyncIterator[AIOKafkaClient]:
    """A client whose metadata names node 1 at the closed port (as after the broker died)."""
    c = AIOKafkaClient(bootstrap_servers=f"127.0.0.1:{closed_port}")
    c.cluster.update_metadata(MetadataResponse_v0(
        [(1, "127.0.0.1", closed_port)], [(0, "t", [(0, 0, 1, [1], [1])])]))
    yield c
    await c.close()


async def test_requests_to_an_absent_broker_in_a_tight_loop_do_not_each_open_a_connection(
        client: AIOKafkaClient, attempts: list[float], closed_port: int) -> None:
    calls = 0
    started = time.monotonic()
    while time.monotonic() - started < 0.3:
        assert not await client.ready(1)
        calls += 1
        await asyncio.sleep(0.002)
    # 0 ms, then >= 40, 80 and 160 ms later: at most 4 attempts in 0.3 s, whatever the rate
    assert calls >= 20 and 1 <= len(attempts) <= 4, (calls, len(attempts))
    assert BACKOFF.failures(("127.0.0.1", closed_port)) == len(attempts)


async def test_a_failing_address_has_one_attempt_in_flight_at_a_time(
        client: AIOKafkaClient, attempts: list[float], closed_port: int) -> None:
    address = ("127.0.0.1", closed_port)
    assert not await client.ready(1)
    assert len(attempts) == 1
    await asyncio.sleep(BACKOFF.nominal_delay(1) * (1 + JITTER))
    # ten routines ask at once once the backoff has passed: one of them tries
    assert await asyncio.gather(*(client.ready(1) for _ in range(10))) == [False] * 10
    assert len(attempts) == 2 and BACKOFF.failures(address) == 2


async def test_a_base_of_zero_turns_the_backoff_off(
        client: AIOKafkaClient, attempts: list[float]) -> None:
    install(0, 1000)
    for _ in range(10):
        assert not await client.ready(1)
    assert len(attempts) == 10


def test_a_max_below_the_base_is_refused_with_what_to_set() -> None:
    with pytest.raises(ValueError, match="RECONNECT_BACKOFF_MS=0"):
        KafkaSettings(reconnect_backoff_ms=500, reconnect_backoff_max_ms=100)
    assert KafkaSettings(reconnect_backoff_ms=0, reconnect_backoff_max_ms=0)


async def test_a_client_asking_for_metadata_in_a_loop_is_paced_while_the_broker_is_away(
        client: AIOKafkaClient, attempts: list[float]) -> None:
    # the fetcher's shape while a partition has no leader: ask for an update, wait for it, ask
    # again; every update fails at once (refused, then held back by the backoff)
    client._sync_task = asyncio.get_running_loop().create_task(client._md_synchronizer())
    updates = 0
    started = time.monotonic()
    while time.monotonic() - started < 0.5:
        assert await client.force_metadata_update() is False
        updates += 1
    # one update per retry_backoff_ms (100): 5-6 in 0.5 s, never thousands
    assert 2 <= updates <= 7, updates
