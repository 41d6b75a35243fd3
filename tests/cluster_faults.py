"""Node faults on a local 3-node cluster, aimed at what a run depends on (issue 36, item 4).

Each fault is an ``async (cluster, settings) -> str`` that injects itself, waits until the
cluster has every node back (or for the planned outage), and returns what it did, for the
run's fault log. The target node is looked up when the fault fires, from the cluster itself:

- ``leader``: SIGKILL the leader of the busiest input partition (most records);
- ``group-coordinator``: SIGKILL the node coordinating the worker's reorder group;
- ``txn-coordinator``: SIGKILL the node coordinating the reorder worker's transactions;
- ``controller``: SIGKILL the active KRaft controller (the quorum's leader);
- ``random``: SIGKILL a node chosen at random;
- ``rolling``: a graceful rolling restart of all three nodes, one at a time;
- ``two-down``: SIGKILL two nodes at once (writes stop: min.insync.replicas 2 cannot be
  met), hold them down ``TWO_DOWN_S``, then start them again;
- ``pause``: SIGSTOP a node for longer than the clients' request timeout (delayed requests,
  the Jepsen case of transactions), then SIGCONT.

A killed node is started again ``DOWN_S`` later (the issue's "restarted 10 s later").
"""

from __future__ import annotations

import asyncio
import random
import re
import subprocess
from collections.abc import Awaitable, Callable

from aiokafka import AIOKafkaConsumer, TopicPartition
from aiokafka.admin import AIOKafkaAdminClient

from trajbus.bus.closing import close_client
from trajbus.bus.kafka import connection_options
from trajbus.bus.settings import Settings
from trajbus.bus.topics import Topics
from trajbus.infra.cluster import LocalCluster
from trajbus.infra.kafka_runtime import ensure_jars, require_java

DOWN_S = 10.0
TWO_DOWN_S = 15.0
PAUSE_S = 40.0  # past the clients' request timeout (30 s) and the brokers' session (4 s)

Fault = Callable[[LocalCluster, Settings, random.Random], Awaitable[str]]


async def _admin(settings: Settings) -> AIOKafkaAdminClient:
    admin = AIOKafkaAdminClient(**connection_options(settings.kafka))
    await admin.start()
    return admin


async def busiest_input_leader(settings: Settings) -> int:
    topics = Topics(settings).input_topics
    consumer = AIOKafkaConsumer(**connection_options(settings.kafka), enable_auto_commit=False)
    await consumer.start()
    admin = await _admin(settings)
    try:
        leaders: dict[TopicPartition, int] = {}
        for desc in await admin.describe_topics(list(topics)):
            for p in desc["partitions"]:
                leaders[TopicPartition(desc["topic"], p["partition"])] = p["leader"]
        ends = await consumer.end_offsets(list(leaders))
        busiest = max(leaders, key=lambda tp: ends[tp])
        return leaders[busiest]
    finally:
        await close_client(admin)
        await close_client(consumer)


async def coordinator(settings: Settings, key: str, coordinator_type: int) -> int:
    admin = await _admin(settings)
    try:
        return int(await admin.find_coordinator(key, coordinator_type))
    finally:
        await close_client(admin)


def active_controller(cluster: LocalCluster) -> int:
    """The KRaft quorum's leader, from Kafka's own MetadataQuorumCommand."""
    out = subprocess.run(
        [require_java(), "-cp", f"{ensure_jars()}/*",
         "org.apache.kafka.tools.MetadataQuorumCommand", "--bootstrap-server",
         cluster.bootstrap, "describe", "--status"],
        capture_output=True, text=True, timeout=60, check=False)
    match = re.search(r"LeaderId:\s*(\d+)", out.stdout)
    if match is None:
        raise RuntimeError(f"no quorum leader in: {out.stdout[-500:]} {out.stderr[-500:]}")
    return int(match.group(1))


async def _kill_and_restart(cluster: LocalCluster, node: int, why: str) -> str:
    await asyncio.to_thread(cluster.kill_node, node)
    await asyncio.sleep(DOWN_S)
    await asyncio.to_thread(cluster.start_node, node, 120)
    return f"node {node} ({why}) SIGKILLed, started again {DOWN_S:.0f} s later"


async def leader(cluster: LocalCluster, settings: Settings, rng: random.Random) -> str:
    return await _kill_and_restart(cluster, await busiest_input_leader(settings),
                                   "leader of the busiest input partition")


async def group_coordinator(cluster: LocalCluster, settings: Settings,
                            rng: random.Random) -> str:
    group = f"{settings.topics.prefix}.reorder"
    return await _kill_and_restart(cluster, await coordinator(settings, group, 0),
                                   f"coordinator of group {group}")


async def txn_coordinator(cluster: LocalCluster, settings: Settings, rng: random.Random) -> str:
    txn = f"{settings.topics.prefix}.reorder.demo"  # the demo's worker id is "demo"
    return await _kill_and_restart(cluster, await coordinator(settings, txn, 1),
                                   f"transaction coordinator of {txn}")


async def controller(cluster: LocalCluster, settings: Settings, rng: random.Random) -> str:
    node = await asyncio.to_thread(active_controller, cluster)
    return await _kill_and_restart(cluster, node, "active controller")


async def random_node(cluster: LocalCluster, settings: Settings, rng: random.Random) -> str:
    return await _kill_and_restart(cluster, rng.randint(1, cluster.size), "random")


async def rolling(cluster: LocalCluster, settings: Settings, rng: random.Random) -> str:
    await asyncio.to_thread(cluster.rolling_restart, 120)
    return "graceful rolling restart of all nodes"


async def two_down(cluster: LocalCluster, settings: Settings, rng: random.Random) -> str:
    nodes = rng.sample(range(1, cluster.size + 1), 2)
    for n in nodes:
        await asyncio.to_thread(cluster.kill_node, n)
    await asyncio.sleep(TWO_DOWN_S)
    for n in nodes:
        await asyncio.to_thread(cluster.node(n).start, 120)
    await asyncio.to_thread(cluster.wait_brokers, cluster.size, 120)
    return f"nodes {nodes} SIGKILLed together, started again {TWO_DOWN_S:.0f} s later"


async def pause(cluster: LocalCluster, settings: Settings, rng: random.Random) -> str:
    node = await busiest_input_leader(settings)
    await asyncio.to_thread(cluster.pause_node, node)
    try:
        await asyncio.sleep(PAUSE_S)
    finally:
        await asyncio.to_thread(cluster.resume_node, node)
    await asyncio.to_thread(cluster.wait_brokers, cluster.size, 120)
    return f"node {node} (leader of the busiest input partition) SIGSTOPped {PAUSE_S:.0f} s"


FAULTS: dict[str, Fault] = {
    "leader": leader,
    "group-coordinator": group_coordinator,
    "txn-coordinator": txn_coordinator,
    "controller": controller,
    "random": random_node,
    "rolling": rolling,
    "two-down": two_down,
    "pause": pause,
}
