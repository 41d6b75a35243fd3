"""Shared pytest fixtures, and the test layers.

The tests live in three folders, marked by folder (``pytest_collection_modifyitems``):
``unit`` (no broker, no Java), ``kafka`` (a real broker) and ``faults`` (brokers, workers or
S3 killed, paused or cut off). Helpers the layers share stay in ``tests/`` itself.

- ``kafka_broker`` (session): a real single-node Kafka broker on a free port, data under
  pytest's tmp dir, stopped at the end of the session. Set ``TRAJBUS_TEST_BOOTSTRAP`` to
  ``host:port[,host:port...]`` to run against an existing cluster instead (then
  ``kafka_broker.broker`` is None and crash tests skip). When no broker can run here (no
  Java, Maven or jars) the broker tests skip locally, but FAIL when ``CI`` is set to a true
  value (``CI=true``, ``CI=1``; ``.ci/run`` sets it): CI must not go green without them.
- Brokers the tests start run the lean JVM (``TRAJBUS_KAFKA_JVM_OPTIONS``, unless set).
- ``unique_name`` (function): a fresh topic/group name, ``t-<test name>-<8 hex>``.
- ``s3_server`` (session): moto's S3-compatible server on 127.0.0.1; yields the endpoint URL
  and sets dummy AWS credentials for the session (restored afterwards).
"""

from __future__ import annotations

import os
import re
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from support import broker_unavailable

from trajbus.infra.broker import KafkaSetupError, LocalBroker, free_port
from trajbus.infra.cluster import LocalCluster
from trajbus.infra.kafka_runtime import JVM_OPTIONS_ENV, LEAN_JVM_OPTIONS

# The suite starts dozens of brokers that each live seconds to minutes: the lean JVM (the
# client JIT, the serial collector) halves their CPU on 2 cores; the subprocesses inherit it.
os.environ.setdefault(JVM_OPTIONS_ENV, LEAN_JVM_OPTIONS)

TESTS = Path(__file__).resolve().parent
_BROKER_FIXTURES = {"kafka_broker", "kafka_cluster", "restore_cluster"}


_LAYERS = ("unit", "kafka", "faults")


def _layer(item: pytest.Item) -> str | None:
    if not item.path.is_relative_to(TESTS):
        return None
    parts = item.path.relative_to(TESTS).parts
    return parts[0] if len(parts) > 1 and parts[0] in _LAYERS else None


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Mark each test by its folder: ``tests/unit`` (no broker, no Java: ``make test-unit``),
    ``tests/kafka`` (``kafka``: a real broker) and ``tests/faults`` (``kafka`` and ``faults``:
    brokers, workers or S3 killed, paused or cut off). A unit test that asks for a broker is an
    error that says where it belongs, so the fast loop never starts Java."""
    misplaced = []
    for item in items:
        layer = _layer(item)
        wants_broker = bool(_BROKER_FIXTURES & set(getattr(item, "fixturenames", ())))
        if layer == "unit" and (wants_broker or item.get_closest_marker("kafka")
                                or item.get_closest_marker("java")):
            misplaced.append(item.nodeid)
        if layer in ("kafka", "faults") or wants_broker:
            item.add_marker(pytest.mark.kafka)
        if layer == "faults":
            item.add_marker(pytest.mark.faults)
    if misplaced:
        raise pytest.UsageError(
            "tests in tests/unit need a broker or Java; move them to tests/kafka or "
            "tests/faults: " + ", ".join(misplaced))


@dataclass
class KafkaHandle:
    """What ``kafka_broker`` yields."""

    bootstrap: str  # "127.0.0.1:PORT" (comma-separated for an external cluster)
    broker: LocalBroker | None  # None when TRAJBUS_TEST_BOOTSTRAP points at an external one

    def require_local(self) -> LocalBroker:
        """The LocalBroker, or skip the test (crash tests cannot kill an external cluster)."""
        if self.broker is None:
            pytest.skip("needs the test-managed local broker (TRAJBUS_TEST_BOOTSTRAP is set)")
        return self.broker


@pytest.fixture(scope="session")
def kafka_broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[KafkaHandle]:
    external = os.environ.get("TRAJBUS_TEST_BOOTSTRAP")
    if external:
        yield KafkaHandle(bootstrap=external, broker=None)
        return
    broker = LocalBroker(
        data_dir=tmp_path_factory.mktemp("kafka"),
        port=free_port(),
        controller_port=free_port(),
    )
    problem: KafkaSetupError | None = None
    try:
        broker.start(timeout=90)
    except KafkaSetupError as exc:  # no java/mvn/jars: skip locally, fail in CI
        problem = exc
    if problem is not None:  # outside the except block: no chained traceback in the report
        broker_unavailable(problem)
    try:
        yield KafkaHandle(bootstrap=broker.bootstrap, broker=broker)
    finally:
        broker.stop(timeout=30)


@pytest.fixture
def unique_name(request: pytest.FixtureRequest) -> str:
    """A fresh, Kafka-legal topic/group name derived from the test's name."""
    base = re.sub(r"[^A-Za-z0-9._-]+", "-", request.node.name).strip("-")[:80]
    return f"t-{base}-{uuid.uuid4().hex[:8]}"


@pytest.fixture(scope="session")
def s3_server() -> Iterator[str]:
    """Endpoint URL of a moto S3 server (``http://127.0.0.1:PORT``) with dummy credentials."""
    from moto.server import ThreadedMotoServer

    port = free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    with pytest.MonkeyPatch.context() as mp:
        for var in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN"):
            mp.setenv(var, "testing")
        mp.setenv("AWS_DEFAULT_REGION", "us-east-1")
        mp.delenv("AWS_PROFILE", raising=False)
        try:
            yield f"http://127.0.0.1:{port}"
        finally:
            server.stop()


@pytest.fixture(scope="session")
def kafka_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    """A real 3-node KRaft cluster (replication factor 3, min.insync.replicas 2, no unclean
    election) on free ports, for the tests of production's shape. Started on first use (three
    JVMs: only the tests that ask for it pay), stopped at the end of the session. A test that
    kills, stops or pauses a node brings it back before it ends (``restore_cluster``)."""
    cluster = LocalCluster(tmp_path_factory.mktemp("kafka-cluster"), 3, base_port=0)
    problem: KafkaSetupError | None = None
    try:
        cluster.start(timeout=180)
    except KafkaSetupError as exc:
        problem = exc
    if problem is not None:
        broker_unavailable(problem)
    try:
        yield cluster
    finally:
        # no controlled shutdown: the data is thrown away, and the session's last test pays
        # for this teardown within its own timeout
        cluster.kill()


@pytest.fixture
def restore_cluster(kafka_cluster: LocalCluster) -> Iterator[LocalCluster]:
    """The cluster, with every node running again (and all 3 registered) after the test."""
    try:
        yield kafka_cluster
    finally:
        for n in range(1, kafka_cluster.size + 1):
            node = kafka_cluster.node(n)
            node.resume()
            if not node.is_running():
                node.start(120)
        kafka_cluster.wait_brokers(kafka_cluster.size, 120)
