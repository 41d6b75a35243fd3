"""A local N-node Apache Kafka cluster (KRaft, no Docker) for drills, fault tests and the demo.

Production runs Kafka replicated: replication factor 3, ``min.insync.replicas`` 2, no unclean
leader election, where one node down is the normal degraded state (partition leaders, group and
transaction coordinators move; the rest keeps serving). This runs that shape on one machine,
from the same Maven jars as :class:`~trajbus.infra.broker.LocalBroker`::

    from trajbus.infra.cluster import LocalCluster

    cluster = LocalCluster(data_dir="/tmp/kc", nodes=3)
    cluster.start()                  # formats each node on first start; waits for all N
    print(cluster.bootstrap)         # "127.0.0.1:P1,127.0.0.1:P2,127.0.0.1:P3"
    cluster.kill_node(2)             # SIGKILL node 2 (crash); start_node(2) brings it back
    cluster.pause_node(3)            # SIGSTOP (a frozen node); resume_node(3)
    cluster.rolling_restart()        # graceful, one node at a time, each back in the ISR first
    cluster.stop()

Each node is a combined broker+controller (``process.roles=broker,controller``) with a static
quorum of all N controllers: on 2 cores three JVMs instead of six (separate controllers) keep
start-up and failover within a few seconds, and the controller quorum still loses a member
when a node dies, as a combined production deployment does. Replication factor = N (at most 3)
for data and internal topics, ``min.insync.replicas`` = RF-1.

Layout of the data directory::

    cluster.json     node count, ports and cluster id (reused on restart)
    node-1/ ...      each node's LocalBroker data directory (server.properties, logs/, ...)
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from trajbus.infra.broker import BrokerError, BrokerStatus, LocalBroker
from trajbus.infra.broker_config import new_cluster_id
from trajbus.infra.kafka_probe import probe_broker
from trajbus.infra.ports import DEFAULT_HOST, free_port, port_free

__all__ = ["DEFAULT_CLUSTER_DATA_DIR", "ClusterStatus", "LocalCluster"]

DEFAULT_CLUSTER_DATA_DIR = Path(".trajbus") / "kafka-cluster"
#: The first node's client port by default; node i listens on BASE+2(i-1), its controller on
#: the port after (19092/19093, 19094/19095, 19096/19097).
DEFAULT_CLUSTER_BASE_PORT = 19092


@dataclass(frozen=True)
class ClusterStatus:
    nodes: list[BrokerStatus]
    bootstrap: str
    data_dir: Path

    @property
    def running(self) -> int:
        return sum(1 for n in self.nodes if n.running)

    def as_dict(self) -> dict[str, Any]:
        return {
            "bootstrap": self.bootstrap,
            "data_dir": str(self.data_dir),
            "nodes_running": self.running,
            "nodes": [{"node": i + 1, **n.as_dict()} for i, n in enumerate(self.nodes)],
        }


class LocalCluster:
    """N local KRaft nodes in one data directory. Ports are taken from ``cluster.json`` once
    it exists; otherwise ``base_port`` (default ``TRAJBUS_KAFKA_PORT`` or 19092) and the ports
    after it, or free ports with ``base_port=0`` (tests)."""

    def __init__(self, data_dir: str | os.PathLike[str] | None = None, nodes: int | None = None,
                 *, base_port: int | None = None, host: str = DEFAULT_HOST,
                 heap: str = "384m", extra_properties: dict[str, str] | None = None) -> None:
        if data_dir is None:
            data_dir = DEFAULT_CLUSTER_DATA_DIR
        self.data_dir = Path(data_dir).expanduser().resolve()
        self.host = host
        meta = self._read_meta()
        recorded = int(meta.get("nodes", 0))
        if nodes is None:
            nodes = recorded or 3
        if recorded and nodes != recorded:
            raise BrokerError(
                f"{self.data_dir} holds a {recorded}-node cluster; start it with --nodes "
                f"{recorded}, or delete that directory for a {nodes}-node one")
        if nodes < 1:
            raise ValueError("a cluster needs at least one node")
        self.size = nodes
        if "ports" in meta:
            ports = [(int(p), int(c)) for p, c in meta["ports"]]
        elif base_port == 0:
            ports = [(free_port(host), free_port(host)) for _ in range(nodes)]
        else:
            base = base_port or int(os.environ.get("TRAJBUS_KAFKA_PORT") or
                                    DEFAULT_CLUSTER_BASE_PORT)
            ports = [(base + 2 * i, base + 2 * i + 1) for i in range(nodes)]
        self.cluster_id = str(meta.get("cluster_id") or new_cluster_id())
        voters = ",".join(f"{i + 1}@{host}:{c}" for i, (_, c) in enumerate(ports))
        self.replication = min(nodes, 3)
        self._ports = ports
        self.brokers = [
            LocalBroker(self.data_dir / f"node-{i + 1}", port=p, controller_port=c, host=host,
                        heap=heap, node_id=i + 1, quorum_voters=voters,
                        cluster_id=self.cluster_id, replication=self.replication,
                        extra_properties=extra_properties)
            for i, (p, c) in enumerate(ports)
        ]

    # ----------------------------------------------------------------------------------------
    @property
    def meta_file(self) -> Path:
        return self.data_dir / "cluster.json"

    @property
    def bootstrap(self) -> str:
        return ",".join(b.bootstrap for b in self.brokers)

    def _read_meta(self) -> dict[str, Any]:
        try:
            data = json.loads((self.data_dir / "cluster.json").read_text())
        except (OSError, ValueError):
            return {}
        return data if isinstance(data, dict) else {}

    def node(self, n: int) -> LocalBroker:
        """Node ``n`` (1-based, as its ``node.id``)."""
        if not 1 <= n <= self.size:
            raise ValueError(f"no node {n}: this cluster has nodes 1..{self.size}")
        return self.brokers[n - 1]

    def live_brokers(self) -> int:
        """How many brokers the cluster reports registered and unfenced (0: none answers)."""
        for b in self.brokers:
            if b.is_running():
                count = probe_broker(b.host, b.port, timeout=2.0)
                if count:
                    return count
        return 0

    def status(self) -> ClusterStatus:
        return ClusterStatus([b.status() for b in self.brokers], self.bootstrap, self.data_dir)

    # ----------------------------------------------------------------------------------------
    def start(self, timeout: float = 90.0) -> None:
        """Start every node that is not running (all at once: no node answers before a
        majority of the controllers runs) and wait until each answers and the cluster reports
        all N brokers. Idempotent."""
        for b in self.brokers:
            if b.is_running():
                continue
            for port in (b.port, b.controller_port):
                if not port_free(self.host, port):
                    raise BrokerError(
                        f"port {self.host}:{port} (node {b.node_id}) is already in use by "
                        "another process; pick other ports with --port / TRAJBUS_KAFKA_PORT, "
                        f"or stop whatever listens there (`ss -ltnp 'sport = :{port}'`).")
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self.meta_file.write_text(json.dumps(
            {"nodes": self.size, "cluster_id": self.cluster_id,
             "ports": [list(p) for p in self._ports]}, indent=2))
        launched = []
        try:
            for b in self.brokers:
                if not b.is_running():
                    launched.append(b)
                b.launch()
            deadline = time.monotonic() + timeout
            for b in self.brokers:
                b.wait_ready(max(1.0, deadline - time.monotonic()))
            self.wait_brokers(self.size, max(1.0, deadline - time.monotonic()))
        except BaseException:
            for b in launched:
                b.kill()
            raise

    def wait_brokers(self, count: int, timeout: float = 60.0) -> None:
        """Wait until the cluster reports ``count`` live (registered, unfenced) brokers."""
        deadline = time.monotonic() + timeout
        while (live := self.live_brokers()) < count:
            if time.monotonic() >= deadline:
                raise BrokerError(f"the cluster at {self.bootstrap} reports {live} live brokers "
                                  f"of {count} after {timeout:.0f} s (node logs under "
                                  f"{self.data_dir}/node-*/logs/server.log)")
            time.sleep(0.2)

    def wait_brokers_at_most(self, count: int, timeout: float = 60.0) -> None:
        """Wait until the cluster reports at most ``count`` live brokers (a killed node
        fenced: after the brokers' session timeout)."""
        deadline = time.monotonic() + timeout
        while (live := self.live_brokers()) > count:
            if time.monotonic() >= deadline:
                raise BrokerError(f"the cluster at {self.bootstrap} still reports {live} live "
                                  f"brokers after {timeout:.0f} s (expected {count} or fewer)")
            time.sleep(0.2)

    def stop(self, timeout: float = 30.0) -> None:
        """Controlled shutdown of every node (SIGTERM to all; SIGKILL after ``timeout``)."""
        import signal

        pids = [(b, b.pid()) for b in self.brokers]
        for _b, pid in pids:
            if pid is not None:
                try:
                    os.kill(pid, signal.SIGCONT)  # a paused node cannot shut down
                    os.kill(pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass
        for b, pid in pids:
            if pid is not None:
                b._terminate(pid, timeout)
            b.pid_file.unlink(missing_ok=True)

    def kill(self) -> None:
        """SIGKILL every node (a test's teardown: fast, no controlled shutdown)."""
        for b in self.brokers:
            b.resume()
            b.kill()
            b.pid_file.unlink(missing_ok=True)

    # drills ----------------------------------------------------------------------------------
    def kill_node(self, n: int) -> None:
        """SIGKILL node ``n`` (a crash); its data stays for :meth:`start_node`."""
        self.node(n).kill()

    def stop_node(self, n: int, timeout: float = 30.0) -> None:
        """Controlled shutdown of node ``n`` (leaders move away first)."""
        self.node(n).stop(timeout)

    def start_node(self, n: int, timeout: float = 60.0) -> None:
        """Start node ``n`` again and wait until it answers and is registered."""
        self.node(n).start(timeout)
        self.wait_brokers(self.live_brokers_expected(), timeout)

    def live_brokers_expected(self) -> int:
        return sum(1 for b in self.brokers if b.is_running())

    def pause_node(self, n: int) -> None:
        """SIGSTOP node ``n``: it answers nothing (a GC pause, a frozen VM) until resumed."""
        self.node(n).pause()

    def resume_node(self, n: int) -> None:
        self.node(n).resume()

    def rolling_restart(self, timeout: float = 60.0, *, settle: Any = None) -> None:
        """Restart each node in turn, gracefully, waiting before the next until the cluster
        reports every broker again. ``settle(n)``, if given, is called after node ``n`` is
        back (e.g. to wait for no under-replicated partitions)."""
        for b in self.brokers:
            b.stop()
            b.start(timeout)
            self.wait_brokers(self.size, timeout)
            if settle is not None:
                settle(b.node_id)

    def __enter__(self) -> LocalCluster:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def __repr__(self) -> str:
        return f"LocalCluster(data_dir={str(self.data_dir)!r}, nodes={self.size})"
