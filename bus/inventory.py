"""What exists on the broker: trajbus's topics (and what each is for), the tasks that have a
replay topic, consumer groups and their live members, and records counted without the
transaction markers that offsets include.

Every function opens its own short-lived client and closes it, also on errors.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from aiokafka import TopicPartition
from aiokafka.admin import AIOKafkaAdminClient

from trajbus.bus.clients import new_admin, new_consumer
from trajbus.bus.closing import close_client
from trajbus.bus.errors import NotFoundError, UserError, existing
from trajbus.bus.settings import Settings
from trajbus.bus.topics import Topics

DEBUG_TASK_PREFIX = "debug-"
"""Replay topics of tasks named ``debug-<task>`` hold operator republishes (debug topics)."""


@dataclass(frozen=True, slots=True)
class TopicInfo:
    """One existing topic under the settings' prefix."""

    name: str
    partitions: int
    offsets: int  # end minus beginning offsets over the partitions (markers included)
    role: str  # catalog | replay | debug | state | other
    purpose: str
    task: str | None = None


@dataclass(frozen=True, slots=True)
class GroupMember:
    client_id: str
    host: str
    member_id: str
    assignment: dict[str, list[int]] = field(default_factory=dict)

    def partitions_text(self) -> str:
        return ", ".join(f"{t}[{','.join(map(str, ps))}]" for t, ps in
                         sorted(self.assignment.items())) or "no partitions"


@dataclass(frozen=True, slots=True)
class GroupInfo:
    group: str
    state: str  # Stable | PreparingRebalance | CompletingRebalance | Empty | Dead
    members: tuple[GroupMember, ...]

    @property
    def alive(self) -> bool:
        return bool(self.members)


def _admin(settings: Settings, what: str) -> AIOKafkaAdminClient:
    return new_admin(settings.kafka, what)


async def topic_names(settings: Settings) -> list[str]:
    admin = _admin(settings, "inventory")
    await admin.start()
    try:
        return sorted(await admin.list_topics())
    finally:
        await admin.close()


def replay_task(settings: Settings, topic: str) -> str | None:
    """The task of a replay topic name (``<prefix>.replay.<task>``), else None."""
    prefix = f"{settings.topics.prefix}.replay."
    return topic[len(prefix):] if topic.startswith(prefix) and len(topic) > len(prefix) else None


def tasks_of(settings: Settings, names: Iterable[str], include_debug: bool = False) -> list[str]:
    """Tasks that have a replay topic among ``names`` (debug republish tasks only on request)."""
    tasks = (replay_task(settings, n) for n in names)
    return sorted(t for t in tasks if t is not None
                  and (include_debug or not t.startswith(DEBUG_TASK_PREFIX)))


async def list_tasks(settings: Settings, include_debug: bool = False) -> list[str]:
    """The tasks that have a replay topic on the broker, sorted."""
    return tasks_of(settings, await topic_names(settings), include_debug)


def describe_role(settings: Settings, name: str) -> tuple[str, str, str | None]:
    """(role, purpose, task) of a topic name under the prefix."""
    topics = Topics(settings)
    for spec in topics.specs:
        if spec.name == name:
            return "catalog", spec.doc, None
    task = replay_task(settings, name)
    if task is not None:
        if task.startswith(DEBUG_TASK_PREFIX):
            return "debug", f"operator republish (debug replay of {task[6:]})", task
        return "replay", f"ordered replay segments of task {task}", task
    if name.endswith(".state"):
        return "state", "processor state (compacted changelog)", None
    if name.endswith(".ticks"):
        return "clock", "a processor's clock (Tick records)", None
    return "other", "", None


async def offset_spans(settings: Settings, topics: Sequence[str]) -> dict[str, tuple[int, int]]:
    """(partitions, end minus beginning offsets) per existing topic among ``topics``."""
    parts = await partitions_of(settings, topics)
    tps = [TopicPartition(t, p) for t in parts for p in parts[t]]
    out = {t: (len(ps), 0) for t, ps in parts.items()}
    if not tps:
        return out
    consumer = new_consumer(settings.kafka, enable_auto_commit=False)
    await consumer.start()
    try:
        begin = await consumer.beginning_offsets(tps)
        end = await consumer.end_offsets(tps)
    finally:
        await close_client(consumer, "offsets consumer")
    for tp in tps:
        n, total = out[tp.topic]
        out[tp.topic] = (n, total + end[tp] - begin[tp])
    return out


async def partitions_of(settings: Settings, topics: Sequence[str] | None = None,
                        pattern: str | None = None) -> dict[str, list[int]]:
    """Partitions of the existing topics among ``topics`` (every topic when None) plus those
    whose name fully matches the regex ``pattern``."""
    admin = _admin(settings, "inventory")
    await admin.start()
    try:
        have = set(await admin.list_topics())
        names = sorted(have) if topics is None else [t for t in topics if t in have]
        if pattern:
            rx = re.compile(pattern)
            names += [t for t in sorted(have) if rx.fullmatch(t) and t not in names]
        if not names:
            return {}
        desc = await admin.describe_topics(names)
    finally:
        await admin.close()
    return {d["topic"]: sorted(p["partition"] for p in d["partitions"])
            for d in desc if d.get("error_code", 0) == 0}


async def trajbus_topics(settings: Settings) -> list[TopicInfo]:
    """Every existing topic under the settings' prefix, with its role and size."""
    prefix = settings.topics.prefix + "."
    names = [n for n in await topic_names(settings) if n.startswith(prefix)]
    spans = await offset_spans(settings, names)
    out = []
    for name in names:
        role, purpose, task = describe_role(settings, name)
        n, offsets = spans.get(name, (0, 0))
        out.append(TopicInfo(name, n, offsets, role, purpose, task))
    return out


async def delete_debug_topics(settings: Settings, names: Sequence[str]) -> list[str]:
    """Delete debug replay topics (``<prefix>.replay.debug-*``; a bare task name ``debug-x``
    or ``x`` is accepted too). Refuses any other topic: the catalog, replay and state topics
    carry the pipeline's data. Raises :class:`NotFoundError` for one that does not exist."""
    topics = Topics(settings)
    have = await topic_names(settings)
    debug = [n for n in have if describe_role(settings, n)[0] == "debug"]
    wanted: list[str] = []
    for name in names:
        full = name
        if name not in have and not name.startswith(settings.topics.prefix + "."):
            task = name if name.startswith(DEBUG_TASK_PREFIX) else DEBUG_TASK_PREFIX + name
            full = topics.replay(task)
        role = describe_role(settings, full)[0]
        if role != "debug":
            raise UserError(f"refusing to delete {name!r}: only debug replay topics "
                            f"({topics.prefix}.replay.{DEBUG_TASK_PREFIX}*, made by `trajbus "
                            "replay republish`) can be deleted with this command",
                            hint=existing("debug topics", debug))
        if full not in have:
            raise NotFoundError(f"no topic {full!r}", hint=existing("debug topics", debug))
        wanted.append(full)
    if not wanted:
        return []
    admin = _admin(settings, "delete")
    await admin.start()
    try:
        await admin.delete_topics(wanted)
        for _ in range(100):  # until the deletion is visible: a re-republish then recreates
            if not set(wanted) & set(await admin.list_topics()):
                break
            await asyncio.sleep(0.1)
    finally:
        await admin.close()
    return wanted


#: How long an operator tool waits for a group's coordinator that is moving to another node.
COORDINATOR_PATIENCE_S = 30.0


async def describe_group(settings: Settings, group: str) -> GroupInfo:
    """The consumer group's state and live members with their assigned partitions."""
    from aiokafka.coordinator.protocol import ConsumerProtocolMemberAssignment
    from aiokafka.errors import (
        CoordinatorLoadInProgressError,
        CoordinatorNotAvailableError,
        NotCoordinatorError,
    )

    admin = _admin(settings, "inventory")
    await admin.start()
    loop = asyncio.get_running_loop()
    deadline = loop.time() + COORDINATOR_PATIENCE_S
    try:
        while True:
            try:
                # one group per request: aiokafka misreads a multi-group DescribeGroups response
                (resp,) = await admin.describe_consumer_groups([group])
                break
            except (CoordinatorNotAvailableError, NotCoordinatorError,
                    CoordinatorLoadInProgressError):
                # the group's coordinator is moving (its node died, a restart): it settles
                # within the cluster's failover time
                if loop.time() > deadline:
                    raise
                await asyncio.sleep(0.5)
    finally:
        await close_client(admin)
    (g,) = resp.to_object()["groups"]
    members = []
    for m in g["members"]:
        assignment: dict[str, list[int]] = {}
        if m["member_assignment"]:
            try:
                decoded = ConsumerProtocolMemberAssignment.decode(m["member_assignment"])
                assignment = {t: sorted(ps) for t, ps in decoded.assignment}
            except Exception:  # another protocol's assignment bytes: show no partitions
                assignment = {}
        members.append(GroupMember(m["client_id"], str(m["client_host"]).lstrip("/"),
                                   m["member_id"], assignment))
    return GroupInfo(group, g["state"], tuple(sorted(members, key=lambda x: x.client_id)))


async def consumer_groups(settings: Settings, starting: str) -> list[str]:
    """The consumer groups on the cluster whose id starts with ``starting``, sorted."""
    admin = _admin(settings, "inventory")
    await admin.start()
    try:
        listed = await admin.list_consumer_groups()
    finally:
        await close_client(admin)
    return sorted(g[0] for g in listed if str(g[0]).startswith(starting))


TICK_KEY = b"_tick"
"""The key of the Tick records a worker writes into its input partitions (its clock)."""


async def count_records(settings: Settings, ranges: dict[TopicPartition, tuple[int, int]],
                        cap: int = 20_000, timeout_s: float = 30.0, *,
                        skip_key: bytes | None = TICK_KEY) -> dict[TopicPartition, int | None]:
    """Records (not offsets) in ``[start, end)`` of each partition as a ``read_committed``
    consumer sees them: transaction markers and aborted records are not counted, nor records
    keyed ``skip_key`` (default: the processors' Ticks, their clock, not work). A partition
    with more than ``cap`` offsets in its range is not read (None: use the offsets)."""
    out: dict[TopicPartition, int | None] = {}
    todo = {tp: r for tp, r in ranges.items() if r[1] > r[0]}
    for tp, (a, b) in ranges.items():
        out[tp] = 0 if b <= a else None
    small = {tp: r for tp, r in todo.items() if r[1] - r[0] <= cap}
    if not small:
        return out
    k = settings.kafka
    consumer = new_consumer(k, enable_auto_commit=False,
                            isolation_level="read_committed", auto_offset_reset="earliest",
                            max_partition_fetch_bytes=k.max_request_size)
    await consumer.start()
    try:
        consumer.assign(list(small))
        for tp, (a, _) in small.items():
            consumer.seek(tp, a)
            out[tp] = 0
        pending = set(small)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while pending and loop.time() < deadline:
            batch = await consumer.getmany(*pending, timeout_ms=300)
            for tp, msgs in batch.items():
                out[tp] = (out[tp] or 0) + sum(1 for m in msgs if m.offset < small[tp][1]
                                               and (skip_key is None or m.key != skip_key))
            for tp in list(pending):
                if await consumer.position(tp) >= small[tp][1]:
                    pending.discard(tp)
        for tp in pending:  # did not finish in time: fall back to the offsets
            out[tp] = None
    finally:
        await close_client(consumer, "offsets consumer")
    return out


INTERNAL_TOPICS = ("__consumer_offsets", "__transaction_state")


@dataclass(frozen=True, slots=True)
class ClusterHealth:
    """The cluster's brokers and the replication state of trajbus's topics (and Kafka's
    internal ones, which hold the groups' offsets and the transactions)."""

    brokers: tuple[int, ...]  # live (registered, unfenced) broker ids
    partitions: int
    under_replicated: tuple[str, ...]  # "topic:partition": fewer replicas in sync than placed
    under_min_isr: tuple[str, ...]  # fewer in sync than min.insync.replicas: writes refused
    offline: tuple[str, ...]  # no leader: neither read nor written

    def as_dict(self) -> dict[str, object]:
        return {"brokers": list(self.brokers), "partitions": self.partitions,
                "under_replicated": list(self.under_replicated),
                "under_min_isr": list(self.under_min_isr), "offline": list(self.offline)}


async def cluster_health(settings: Settings) -> ClusterHealth:
    """Live brokers, and the partitions of trajbus's topics (under the settings' prefix) and of
    Kafka's internal topics that are under-replicated, under their min.insync.replicas, or
    offline. On a healthy cluster the three lists are empty; while a node is down its
    replicas are out of sync (under-replicated) until it is back and has caught up."""
    from aiokafka.admin.config_resource import ConfigResource, ConfigResourceType

    admin = _admin(settings, "admin")
    await admin.start()
    try:
        cluster = await admin.describe_cluster()
        prefix = f"{settings.topics.prefix}."
        names = sorted((t for t in await admin.list_topics()
                        if t.startswith(prefix) or t in INTERNAL_TOPICS),
                       key=lambda t: (t in INTERNAL_TOPICS, t))  # trajbus's own first
        descs = await admin.describe_topics(names) if names else []
        min_isr: dict[str, int] = {}
        if names:
            for resp in await admin.describe_configs(
                    [ConfigResource(ConfigResourceType.TOPIC, t) for t in names]):
                for _code, _msg, _type, topic, entries in resp.resources:
                    for name, value, *_ in entries:
                        if name == "min.insync.replicas":
                            min_isr[topic] = int(value)
    finally:
        await close_client(admin)
    total = 0
    under, below, offline = [], [], []
    for desc in descs:
        topic = desc["topic"]
        for p in desc["partitions"]:
            total += 1
            where = f"{topic}:{p['partition']}"
            isr, replicas = p.get("isr") or [], p.get("replicas") or []
            if p.get("leader", -1) < 0:
                offline.append(where)
            if len(isr) < len(replicas):
                under.append(where)
            if len(isr) < min_isr.get(topic, 1):
                below.append(where)
    return ClusterHealth(tuple(sorted(b["node_id"] for b in cluster.get("brokers", []))),
                         total, tuple(under), tuple(below), tuple(offline))


async def partition_leaders(settings: Settings, topic: str) -> dict[int, int]:
    """``topic``'s partitions and the node id leading each (-1: none)."""
    admin = _admin(settings, "inventory")
    await admin.start()
    try:
        [desc] = await admin.describe_topics([topic])
        return {p["partition"]: p["leader"] for p in desc["partitions"]}
    finally:
        await close_client(admin)
