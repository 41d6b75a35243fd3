"""The local Kafka broker (trajbus.infra.broker) and its CLI, against a real broker."""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer
from aiokafka.admin import AIOKafkaAdminClient, NewTopic

from trajbus.infra import broker as broker_mod
from trajbus.infra.broker import (
    BrokerError,
    LocalBroker,
    free_port,
    kafka_version,
    probe_broker,
)
from trajbus.infra.cli import register
from trajbus.infra.processes import pid_alive


def wait_until(cond: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.05)


async def create_topic(bootstrap: str, name: str, partitions: int = 1) -> None:
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
    await admin.start()
    try:
        await admin.create_topics([NewTopic(name, partitions, 1)])
        # Metadata propagates asynchronously (KRaft): wait for the topic with a deadline.
        deadline = asyncio.get_running_loop().time() + 30
        while name not in await admin.list_topics():
            assert asyncio.get_running_loop().time() < deadline, f"topic {name} never appeared"
            await asyncio.sleep(0.1)
    finally:
        await admin.close()


async def produce(bootstrap: str, topic: str, *values: bytes) -> None:
    producer = AIOKafkaProducer(bootstrap_servers=bootstrap, acks="all")
    await producer.start()
    try:
        for value in values:
            await producer.send_and_wait(topic, value, key=b"k")
    finally:
        await producer.stop()


async def consume(bootstrap: str, topic: str, n: int, timeout: float = 30.0) -> list[bytes]:
    consumer = AIOKafkaConsumer(
        topic, bootstrap_servers=bootstrap, auto_offset_reset="earliest", enable_auto_commit=False
    )
    await consumer.start()
    out: list[bytes] = []
    try:
        async with asyncio.timeout(timeout):
            while len(out) < n:
                msg = await consumer.getone()
                assert msg.value is not None
                out.append(msg.value)
    finally:
        await consumer.stop()
    return out


# ------------------------------------------------------------------------------------------
# no broker needed


def test_version_and_properties(tmp_path: Path) -> None:
    assert kafka_version().startswith("4.")
    b = LocalBroker(tmp_path / "d", port=12000)
    assert b.controller_port == 12001
    assert b.bootstrap == "127.0.0.1:12000"
    props = b.server_properties()
    assert props["process.roles"] == "broker,controller"
    assert props["controller.quorum.bootstrap.servers"] == "127.0.0.1:12001"
    assert props["advertised.listeners"] == "PLAINTEXT://127.0.0.1:12000"
    assert props["auto.create.topics.enable"] == "false"
    assert int(props["message.max.bytes"]) == broker_mod.DEFAULT_MESSAGE_MAX_BYTES
    for key in (
        "offsets.topic.replication.factor",
        "transaction.state.log.replication.factor",
        "transaction.state.log.min.isr",
        "share.coordinator.state.topic.replication.factor",
        "share.coordinator.state.topic.min.isr",
    ):
        assert props[key] == "1"


def test_env_overrides_defaults(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRAJBUS_KAFKA_PORT", "23456")
    monkeypatch.setenv("TRAJBUS_KAFKA_DATA_DIR", str(tmp_path / "envdir"))
    b = LocalBroker()
    assert (b.port, b.controller_port) == (23456, 23457)
    assert b.data_dir == (tmp_path / "envdir").resolve()


def test_port_in_use_is_reported(tmp_path: Path) -> None:
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", 0))
        squatter.listen()
        port = squatter.getsockname()[1]
        b = LocalBroker(tmp_path / "d", port=port, controller_port=free_port())
        with pytest.raises(BrokerError, match="already in use"):
            b.start(timeout=5)
        assert not b.is_running()
        # Something that is not Kafka does not pass the protocol probe.
        assert probe_broker("127.0.0.1", free_port(), timeout=0.5) is None


def test_stale_pid_file_is_ignored(tmp_path: Path) -> None:
    b = LocalBroker(tmp_path / "d", port=free_port())
    b.data_dir.mkdir(parents=True)
    b.pid_file.write_text("999999999\n")
    assert not b.is_running()
    assert b.status().pid is None


def _cli(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="trajbus")
    register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return int(args.func(args))


def test_cli_help_and_status(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    for argv in (["kafka", "--help"], ["kafka", "up", "--help"], ["kafka", "down", "--help"]):
        with pytest.raises(SystemExit) as exc:
            _cli(argv)
        assert exc.value.code == 0
    assert "--data-dir" in capsys.readouterr().out
    assert _cli(["kafka", "status", "--json", "--data-dir", str(tmp_path / "none")]) == 3
    status = json.loads(capsys.readouterr().out)
    assert status["running"] is False


# ------------------------------------------------------------------------------------------
# against the session broker


@pytest.mark.kafka
@pytest.mark.timeout(180)
def test_broker_answers(kafka_broker) -> None:
    host, port = kafka_broker.bootstrap.split(",")[0].rsplit(":", 1)
    assert (probe_broker(host, int(port)) or 0) >= 1
    if kafka_broker.broker is not None:
        st = kafka_broker.broker.status()
        assert st.running and st.pid and st.bootstrap == kafka_broker.bootstrap
        # start() on a running broker is a no-op that returns at once.
        started = time.monotonic()
        kafka_broker.broker.start()
        assert time.monotonic() - started < 5
        assert kafka_broker.broker.pid() == st.pid


@pytest.mark.kafka
@pytest.mark.timeout(180)
async def test_produce_consume_roundtrip(kafka_broker, unique_name: str) -> None:
    await create_topic(kafka_broker.bootstrap, unique_name)
    await produce(kafka_broker.bootstrap, unique_name, b"hello", b"world")
    assert await consume(kafka_broker.bootstrap, unique_name, 2) == [b"hello", b"world"]


@pytest.mark.kafka
@pytest.mark.timeout(180)
async def test_kill_and_restart_keeps_data(kafka_broker, unique_name: str) -> None:
    local = kafka_broker.require_local()
    await create_topic(kafka_broker.bootstrap, unique_name)
    await produce(kafka_broker.bootstrap, unique_name, b"before-crash")
    pid = local.pid()
    assert pid is not None

    await asyncio.to_thread(local.kill)
    assert not local.is_running()
    assert not pid_alive(pid)

    await asyncio.to_thread(local.start, 90.0)
    assert local.is_running() and local.pid() != pid
    await produce(kafka_broker.bootstrap, unique_name, b"after-restart")
    got = await consume(kafka_broker.bootstrap, unique_name, 2)
    assert got == [b"before-crash", b"after-restart"]


@pytest.mark.kafka
@pytest.mark.timeout(180)
def test_stop_is_clean(tmp_path: Path) -> None:
    """A dedicated broker: fresh format, start, clean stop (process gone, pid file removed)."""
    b = LocalBroker(tmp_path / "own", port=free_port(), controller_port=free_port())
    b.start(timeout=90)
    try:
        pid = b.pid()
        assert pid is not None and b.pid_file.exists()
        assert (probe_broker("127.0.0.1", b.port) or 0) >= 1
        assert b.log_file.exists() and "Kafka Server started" in b.log_file.read_text()
    finally:
        b.stop(timeout=30)
    assert not b.pid_file.exists()
    assert not b.is_running()
    wait_until(lambda: not pid_alive(pid), 10, "the broker process to exit")
    wait_until(lambda: probe_broker("127.0.0.1", b.port, 0.5) is None, 10, "the port to close")
    b.stop()  # stopping a stopped broker is a no-op


def test_free_ports_are_distinct_and_outside_the_ephemeral_range() -> None:
    # a node stopped and started again needs its port free meanwhile: in the ephemeral range
    # any outgoing connection may take it as its local port
    from trajbus.infra.ports import ephemeral_ports

    lo, hi = ephemeral_ports()
    ports = [free_port() for _ in range(50)]
    assert len(set(ports)) == len(ports)
    assert not [p for p in ports if lo <= p <= hi], (lo, hi, ports)
