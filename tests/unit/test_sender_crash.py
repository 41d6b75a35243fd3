"""`bus.kafka.sender_crash`: when an aiokafka producer's sender routine has died, it returns the
routine's error and marks as retrieved the errors aiokafka set on the producer's own futures
(its transaction waiter, each batch's future and drain waiter), which nobody awaits once the
producer is given up. Left unretrieved, each logged "Future exception was never retrieved"
with a traceback when garbage-collected; on Python 3.11.7 that logging, run from a collection
inside an ``ast.parse``, failed the parse with "SystemError: AST constructor recursion depth
mismatch" (cpython#106905), and a pytest run whose tests had all passed exited 1. Real aiokafka
objects, no broker: the producer is never started."""

from __future__ import annotations

import asyncio
from typing import Any

from aiokafka import AIOKafkaProducer, TopicPartition
from aiokafka.errors import KafkaError

from trajbus.bus.kafka import sender_crash


def _unretrieved(futures: list[Any]) -> list[Any]:
    return [f for f in futures if f.done() and not f.cancelled() and f._log_traceback]


async def test_a_dead_sender_routines_error_is_returned_and_its_failed_futures_retrieved() -> None:
    producer = AIOKafkaProducer(bootstrap_servers="127.0.0.1:1", transactional_id="t-crash")
    acc, txn = producer._message_accumulator, producer._txn_manager
    txn.set_pid_and_epoch(1, 0)
    txn.begin_transaction()
    tp = TopicPartition("t", 0)
    delivery = await acc.add_message(tp, b"k", b"v", timeout=1)

    async def routine() -> None:
        raise KafkaError("Unexpected error during batch delivery")

    task = asyncio.ensure_future(routine())
    await asyncio.wait([task])
    producer._sender._sender_task = task
    producer._sender._fail_all(task)  # what aiokafka runs when its sender routine dies
    batches = [b for q in acc._batches.values() for b in q]
    internal = [txn._transaction_waiter]
    internal += [f for b in batches for f in (b.future, b._drain_waiter)]
    assert batches and len(_unretrieved(internal)) >= 2, "the case this test is about"

    crash = sender_crash(producer)

    assert isinstance(crash, KafkaError)
    assert _unretrieved(internal) == []
    # the caller's own delivery future is the caller's to await: it still carries the error
    assert delivery.done() and isinstance(delivery.exception(), KafkaError)


async def test_a_live_sender_routine_is_no_crash() -> None:
    producer = AIOKafkaProducer(bootstrap_servers="127.0.0.1:1")
    assert sender_crash(producer) is None  # never started: no routine
    task = asyncio.ensure_future(asyncio.sleep(10))
    producer._sender._sender_task = task
    try:
        assert sender_crash(producer) is None
    finally:
        task.cancel()
