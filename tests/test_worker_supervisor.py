"""A worker keeps its processors running through a broker restart, and a worker that must stop
stops (RELIABILITY.md, finding X).

CI at b36d393: while the broker restarted, aiokafka's transactional producer's sender routine
crashed on a connection error ("Unexpected error in sender routine"), the scheduler's
transaction failed with ``KafkaError: Unexpected error during batch delivery``, the scheduler
stopped, and the worker went on half-alive (the reorder still served) instead of exiting: its
supervisor never restarted it, and loops went uncaught for the rest of the run. Now a
processor that lost the broker is rebuilt from its committed state in-process, and any other
failure stops the whole worker within a deadline.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
from typing import Any

import pytest
from aiokafka.errors import KafkaConnectionError
from aiokafka.producer.sender import Sender
from support import EchoCore, consume_until, produce, settings_for

from trajbus.bus.admin import ensure_topics
from trajbus.bus.topics import TopicSpec
from trajbus.consumers.engine import supervisor as supervisor_module
from trajbus.consumers.engine.runner import ProcessorSpec, Runner
from trajbus.consumers.engine.supervisor import Worker

PARTITIONS = 2


@pytest.mark.kafka
@pytest.mark.timeout(150)
async def test_a_processor_whose_producer_dies_with_the_broker_connection_is_rebuilt_and_loses_nothing(  # noqa: E501
        kafka_broker, unique_name, monkeypatch) -> None:
    settings = settings_for(kafka_broker.bootstrap, unique_name, partitions=PARTITIONS)
    in_topic, out_topic = f"{unique_name}.in", f"{unique_name}.out"
    await ensure_topics(settings, [TopicSpec(t, PARTITIONS, "test", "key")
                                   for t in (in_topic, out_topic)])
    # The transactional producer's sender routine meets a connection error it does not
    # handle: aiokafka logs "Unexpected error in sender routine", and every pending batch and
    # the transaction fail with "KafkaError: Unexpected error during batch delivery".
    crash = {"armed": False, "crashed": 0}
    real_send = Sender._send_produce_req

    async def send_produce_req(self: Sender, node_id: int, batches: Any) -> Any:
        if crash["armed"] and getattr(self._txn_manager, "transactional_id", None):
            crash["armed"] = False
            crash["crashed"] += 1
            raise KafkaConnectionError("Connection at 127.0.0.1 closed (injected)")
        return await real_send(self, node_id, batches)

    monkeypatch.setattr(Sender, "_send_produce_req", send_produce_req)
    spec = ProcessorSpec(name="echo", input_topics=[in_topic],
                         factory=lambda: EchoCore(out_topic))
    worker = Worker(settings, [spec], "w0")
    running = asyncio.create_task(worker.run(until_idle=4.0))

    first = [(f"k{i}", f"a{i}".encode()) for i in range(60)]
    await produce(settings, in_topic, first)
    await consume_until(settings, out_topic, lambda vs: len(vs) >= len(first))
    crash["armed"] = True
    second = [(f"k{i}", f"b{i}".encode()) for i in range(60)]
    await produce(settings, in_topic, second)

    processed = await asyncio.wait_for(running, timeout=100)  # raised KafkaError before
    assert crash["crashed"] == 1
    assert worker.restarts == {"echo": 1}
    expected = sorted(v for _, v in first + second)
    out = await consume_until(settings, out_topic, lambda vs: len(vs) >= len(expected))
    assert sorted(out) == expected  # each input once: nothing lost, nothing repeated
    assert processed["echo"] >= len(expected)


class _FailingRunner:
    """A runner that fails at once with an error that is not about the broker."""

    def __init__(self, *_: Any) -> None:
        self.stopping = asyncio.Event()
        self.processed = 0

    async def run(self, until_idle: float | None = None) -> None:
        await asyncio.sleep(0.05)
        raise ValueError("a bug in a core")


class _StubbornRunner:
    """A runner whose shutdown never ends (a client's close that hangs)."""

    def __init__(self, *_: Any) -> None:
        self.stopping = asyncio.Event()
        self.processed = 0

    async def run(self, until_idle: float | None = None) -> None:
        await self.stopping.wait()
        await asyncio.Event().wait()


async def test_a_processor_failing_for_another_reason_stops_the_worker_within_the_deadline(
        monkeypatch) -> None:
    monkeypatch.setattr(supervisor_module, "STOP_DEADLINE_S", 0.5)
    stops: list[str] = []
    specs = [ProcessorSpec(name=n, input_topics=["x"], factory=EchoCore)
             for n in ("failing", "stubborn")]
    factories = {"failing": _FailingRunner, "stubborn": _StubbornRunner}

    def factory(settings: Any, spec: ProcessorSpec, worker_id: str) -> Runner:
        return factories[spec.name](settings, spec, worker_id)  # type: ignore[return-value]

    worker = Worker(settings_for("127.0.0.1:1", "unused"), specs, "w0",
                    runner_factory=factory, on_stop=stops.append)
    started = time.monotonic()
    with pytest.raises(ValueError, match="a bug in a core"):
        await asyncio.wait_for(worker.run(), timeout=10)
    assert time.monotonic() - started < 5
    assert worker.restarts == {"failing": 0, "stubborn": 0}  # not about the broker: no restart
    assert len(stops) == 1 and "failing" in stops[0]
    assert worker.current["stubborn"].stopping.is_set()


def test_a_worker_that_hangs_while_stopping_exits_with_a_message_and_its_threads_stacks(
) -> None:
    code = ("import time\n"
            "from trajbus.consumers.engine.supervisor import arm_hard_exit\n"
            "arm_hard_exit('processor scheduler failed (KafkaError: boom)', after_s=0.5)\n"
            "time.sleep(60)\n")
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=30)
    assert done.returncode == 1
    assert time.monotonic() - started < 20
    assert "trajbus: error: the worker did not stop within 0.5 s" in done.stderr
    assert "processor scheduler failed (KafkaError: boom)" in done.stderr
    assert 'File "<string>", line 4' in done.stderr  # where the main thread was
