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
import logging
import subprocess
import sys
import time
from typing import Any, ClassVar

import pytest
from aiokafka.errors import KafkaConnectionError, KafkaError
from aiokafka.producer.sender import Sender
from support import EchoCore, consume_until, produce, settings_for

from trajbus.bus.admin import ensure_topics
from trajbus.bus.kafka import BrokerUnavailableError
from trajbus.bus.topics import TopicSpec
from trajbus.consumers.engine import supervisor as supervisor_module
from trajbus.consumers.engine.runner import ProcessorSpec, Runner
from trajbus.consumers.engine.supervisor import Worker

PARTITIONS = 2


@pytest.mark.kafka
@pytest.mark.timeout(150)
async def test_a_processor_whose_producer_dies_with_the_broker_connection_is_rebuilt_and_loses_nothing(  # noqa: E501
        kafka_broker, unique_name, monkeypatch, caplog) -> None:
    caplog.set_level(logging.INFO, logger="trajbus.ops")  # what a worker without -v logs
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
    # an operator sees the reconnection and the takeover without -v
    ops = [r.getMessage() for r in caplog.records if r.name == "trajbus.ops"]
    reconnected = [m for m in ops if m.startswith("echo: reconnected to Kafka at")]
    assert len(reconnected) == 1 and f"rejoining group {unique_name}.echo" in reconnected[0], ops
    assert sum("assigned 2 input partitions" in m for m in ops) >= 2, ops


class _FakeRunner:
    runs: ClassVar[list[tuple[str, bool]]] = []  # (class, recovering) of every run, in order

    def __init__(self, *_: Any) -> None:
        self.stopping = asyncio.Event()
        self.processed = 0
        self.started = False

    async def run(self, until_idle: float | None = None, recovering: bool = False) -> None:
        _FakeRunner.runs.append((type(self).__name__, recovering))
        await self.go()

    async def go(self) -> None:
        raise NotImplementedError


class _FailingRunner(_FakeRunner):
    """Fails once running, with an error that is not about the broker."""

    async def go(self) -> None:
        self.started = True
        await asyncio.sleep(0.05)
        raise ValueError("a bug in a core")


class _StubbornRunner(_FakeRunner):
    """A runner whose shutdown never ends (a client's close that hangs)."""

    async def go(self) -> None:
        self.started = True
        await self.stopping.wait()
        await asyncio.Event().wait()


class _NoBrokerAtStartRunner(_FakeRunner):
    """The broker does not answer its start-up check."""

    async def go(self) -> None:
        raise BrokerUnavailableError("Kafka at 127.0.0.1:1 did not answer within 10s")


class _LosesBrokerOnceRunner(_FakeRunner):
    """Starts, processes, loses the broker the first time; runs until idle the second."""

    async def go(self) -> None:
        self.started = True
        self.processed = 7
        if sum(1 for name, _ in _FakeRunner.runs if name == "_LosesBrokerOnceRunner") == 1:
            raise _lost_connection()


def _lost_connection() -> KafkaError:
    cause = KafkaConnectionError("Connection at 127.0.0.1:9092 closed")
    try:
        raise KafkaError("Unexpected error during batch delivery") from cause
    except KafkaError as exc:
        return exc


def _worker_of(*runner_classes: type[_FakeRunner], **kw: Any) -> Worker:
    _FakeRunner.runs = []
    by_name = {cls.__name__: cls for cls in runner_classes}
    specs = [ProcessorSpec(name=n, input_topics=["x"], factory=EchoCore) for n in by_name]

    def factory(settings: Any, spec: ProcessorSpec, worker_id: str) -> Runner:
        return by_name[spec.name](settings, spec, worker_id)  # type: ignore[return-value]

    return Worker(settings_for("127.0.0.1:1", "unused"), specs, "w0", runner_factory=factory,
                  **kw)


async def test_a_processor_that_lost_the_broker_while_running_restarts_waiting_for_it() -> None:
    worker = _worker_of(_LosesBrokerOnceRunner)
    processed = await asyncio.wait_for(worker.run(), timeout=10)
    assert _FakeRunner.runs == [("_LosesBrokerOnceRunner", False),
                                ("_LosesBrokerOnceRunner", True)]  # the restart waits
    assert worker.restarts == {"_LosesBrokerOnceRunner": 1}
    assert processed == {"_LosesBrokerOnceRunner": 14}  # both incarnations counted


async def test_a_broker_that_does_not_answer_at_start_up_still_fails_fast() -> None:
    worker = _worker_of(_NoBrokerAtStartRunner)
    with pytest.raises(BrokerUnavailableError, match="did not answer"):
        await asyncio.wait_for(worker.run(), timeout=10)
    assert _FakeRunner.runs == [("_NoBrokerAtStartRunner", False)]  # not restarted


async def test_a_processor_failing_for_another_reason_stops_the_worker_within_the_deadline(
        monkeypatch) -> None:
    monkeypatch.setattr(supervisor_module, "STOP_DEADLINE_S", 0.5)
    stops: list[str] = []
    worker = _worker_of(_FailingRunner, _StubbornRunner, on_stop=stops.append)
    started = time.monotonic()
    with pytest.raises(ValueError, match="a bug in a core"):
        await asyncio.wait_for(worker.run(), timeout=10)
    assert time.monotonic() - started < 5
    assert _FakeRunner.runs == [("_FailingRunner", False), ("_StubbornRunner", False)]
    assert len(stops) == 1 and "_FailingRunner" in stops[0]
    assert worker.current["_StubbornRunner"].stopping.is_set()


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


async def test_a_stop_while_a_restart_waits_for_the_broker_ends_it_at_once() -> None:
    """A restarted processor waits up to a minute for the broker; a SIGTERM meanwhile must not
    wait that long (it would run into the hard exit, code 1, instead of a clean stop)."""
    settings = settings_for("127.0.0.1:1", "no-broker")  # nothing listens there
    runner = Runner(settings, ProcessorSpec(name="echo", input_topics=["x"],
                                            factory=lambda: EchoCore("y")), "w0")
    running = asyncio.create_task(runner.run(recovering=True))
    await asyncio.sleep(1.0)
    assert not running.done()  # still waiting for the broker
    stopped_at = time.monotonic()
    runner.stopping.set()
    await asyncio.wait_for(running, timeout=5)
    assert time.monotonic() - stopped_at < 2
    assert not runner.started and runner._consumer is None


class _NoBrokerAtStartRunnerToo(_FakeRunner):
    """A second processor whose start-up check fails the same way, a moment later."""

    async def go(self) -> None:
        await asyncio.sleep(0.2)
        raise BrokerUnavailableError("Kafka at 127.0.0.1:1 did not answer within 10s")


def test_processors_failing_together_leave_no_unretrieved_task_exception() -> None:
    """The cluster soak's worker started while Kafka did not answer: every processor failed
    its start-up check, the worker raised the first failure, and asyncio printed "Task
    exception was never retrieved" (with a traceback) for the others at exit."""
    import gc

    seen: list[dict[str, Any]] = []

    async def main() -> None:
        asyncio.get_running_loop().set_exception_handler(lambda _loop, ctx: seen.append(ctx))
        worker = _worker_of(_NoBrokerAtStartRunner, _NoBrokerAtStartRunnerToo)
        with pytest.raises(BrokerUnavailableError):
            await asyncio.wait_for(worker.run(), timeout=10)
        await asyncio.sleep(0.5)  # the second failure lands
        del worker
        gc.collect()  # a task's unretrieved exception is reported when it is collected

    asyncio.run(main())
    gc.collect()
    assert [c.get("message") for c in seen] == []


async def test_a_send_without_topic_metadata_during_an_outage_counts_as_the_broker_away(
        ) -> None:
    """The operators' drill (2026-12-05, run 4): during a 20 s broker outage the scheduler's
    transaction raised aiokafka's UnknownTopicOrPartitionError (no metadata for an output
    topic within the request timeout), which the supervisor took for a bug: the worker
    exited. It is the broker away: the processor restarts from its committed state."""
    import contextlib

    from aiokafka.errors import UnknownTopicOrPartitionError

    from trajbus.bus.kafka import broker_went_away

    class NoMetadataProducer:
        @contextlib.asynccontextmanager
        async def transaction(self) -> Any:
            yield

        async def send(self, *_: Any, **__: Any) -> Any:
            raise UnknownTopicOrPartitionError()

    spec = ProcessorSpec(name="echo", input_topics=["x"], factory=EchoCore)
    runner = Runner(settings_for("127.0.0.1:1", "unused"), spec, "w0")
    runner._producer = NoMetadataProducer()  # type: ignore[assignment]
    with pytest.raises(KafkaError) as info:
        await runner._transact([], [(0, "k", b"v")], {})
    assert broker_went_away(info.value)
