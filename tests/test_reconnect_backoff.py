"""The reconnect backoff's arithmetic (trajbus.bus.reconnect.ReconnectBackoff): after a failed
connection to an address, the next attempt waits 50 ms, doubling per consecutive failure up to
the max, each delay within +-20 %; a success resets it; addresses are independent. Time is
passed in, so these are exact. Its effect on real aiokafka clients during a broker outage is
tested in test_faults_broker_clients.py."""

from __future__ import annotations

import random

import pytest

from trajbus.bus.reconnect import JITTER, ReconnectBackoff
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


def test_a_zero_base_turns_the_backoff_off() -> None:
    b = ReconnectBackoff(base_s=0.0, max_s=1.0)
    b.failed(BROKER, now=1.0)
    assert b.may_connect(BROKER, now=1.0)


def test_the_settings_default_to_kafkas_own_clients() -> None:
    k = KafkaSettings()
    assert (k.reconnect_backoff_ms, k.reconnect_backoff_max_ms) == (50, 1000)
    with pytest.raises(ValueError):
        KafkaSettings(reconnect_backoff_ms=-1)
