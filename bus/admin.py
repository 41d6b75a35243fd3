"""Idempotent topic creation and schema registration.

``ensure_topics`` creates what is missing and leaves existing topics alone, so running it twice
is harmless. ``register_schemas`` publishes every bundled writer schema to the compacted
``trajbus.schemas`` topic (key: fingerprint hex), where decoders of other versions find them.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable

from aiokafka.admin import AIOKafkaAdminClient, NewTopic
from aiokafka.errors import (
    KafkaConnectionError,
    KafkaTimeoutError,
    NodeNotReadyError,
    RequestTimedOutError,
    TopicAlreadyExistsError,
)
from aiokafka.protocol.api import Request, RequestStruct, Response
from aiokafka.protocol.types import Array, Int16, Int32, Schema, String

from trajbus.bus.clients import new_admin
from trajbus.bus.kafka import BrokerUnavailableError, retry_while_broker_restarts
from trajbus.bus.producer import get_producer
from trajbus.bus.settings import Settings
from trajbus.bus.topics import Topics, TopicSpec
from trajbus.schemas.registry import SchemaRegistry, default_registry

log = logging.getLogger(__name__)

# Topic-creation answers of a broker that is stopping, starting or between controllers: KRaft
# fences a broker in controlled shutdown, and creation then fails with "All brokers are
# currently fenced" (INVALID_REPLICATION_FACTOR, 38) although nothing is misconfigured. They
# pass: ensure_topics retries them, as it retries a connection lost on the way.
_TRANSIENT_CREATE_ERRORS = {7, 8, 41}  # REQUEST_TIMED_OUT, BROKER_NOT_AVAILABLE, NOT_CONTROLLER
_INVALID_REPLICATION_FACTOR = 38
_FENCED = "fenced"
# How long ensure_topics rides out such a broker (a restart takes ~5-30 s) before it gives up
# with BrokerUnavailableError, which a supervisor answers by restarting the process.
TOPIC_SETUP_PATIENCE_S = 60.0


class _TransientCreateError(RuntimeError):
    pass


class _ShortOfBrokers(_TransientCreateError):
    """Fewer live brokers than the replication factor (retried; see ensure_topics)."""


_TRANSIENT = (TimeoutError, _TransientCreateError, KafkaConnectionError, KafkaTimeoutError,
              NodeNotReadyError, RequestTimedOutError)


async def ensure_topics(
    settings: Settings, specs: Iterable[TopicSpec], *,
    patience_s: float = TOPIC_SETUP_PATIENCE_S, known_broker: bool = False,
) -> tuple[list[str], list[str]]:
    """Create the missing topics. Returns (created, already_present).

    A broker that stops answering or is restarting meanwhile is waited for, up to
    ``patience_s``; then :class:`BrokerUnavailableError` says so. A broker that never answered
    this call fails as fast as the start-up check (``connect_timeout_s``), unless the caller
    has seen it answer before (``known_broker``: a running worker creating an output topic
    during a broker restart). A refusal that is not transient raises at once. A replication
    factor above the cluster's live brokers is waited for as well (a node of the cluster may
    be down or restarting: Kafka cannot place the replicas until it is back), each try logged
    with what to set; after ``patience_s`` :class:`ReplicationFactorError` says so."""
    specs = list(specs)
    loop = asyncio.get_running_loop()
    started = loop.time()
    answered: list[bool] = []  # a broker that never answered fails as fast as check_broker
    try:
        return await retry_while_broker_restarts(
            lambda: _ensure_topics_once(settings, specs, answered, known_broker),
            transient=_TRANSIENT,
            patience_s=lambda: (patience_s if answered or known_broker
                                else settings.kafka.connect_timeout_s),
            what="topic set-up")
    except _ShortOfBrokers as exc:
        raise ReplicationFactorError(str(exc)) from exc
    except _TRANSIENT as exc:
        raise BrokerUnavailableError(
            f"Kafka at {settings.kafka.bootstrap_servers} did not answer topic set-up for "
            f"{loop.time() - started:.0f}s ({type(exc).__name__}: {exc}). Start the broker "
            "(`trajbus kafka up`) or point TRAJBUS_KAFKA__BOOTSTRAP_SERVERS at a running "
            "cluster; if it was restarting, running the command again (or a supervisor "
            "restarting this process) retries.") from exc


async def _ensure_topics_once(settings: Settings, specs: list[TopicSpec], answered: list[bool],
                              known_broker: bool = False
                              ) -> tuple[list[str], list[str]]:
    admin = new_admin(settings.kafka, "admin")
    try:
        await admin.start()
        answered.append(True)
        existing = set(await admin.list_topics())
        missing = [s for s in specs if s.name not in existing]
        created: list[str] = []
        rf = settings.topics.replication_factor
        if missing:
            try:
                await _check_replication_factor(admin, settings)
            except ReplicationFactorError as exc:
                # a set-up mistake, or a node of the cluster down or fenced in a restart: from
                # here the two look the same, and Kafka could not place the replicas either
                raise _ShortOfBrokers(str(exc)) from exc
        for spec in missing:
            configs = spec.kafka_configs()
            configs.setdefault("min.insync.replicas",
                               str(settings.topics.effective_min_insync_replicas))
            topic = NewTopic(
                spec.name,
                num_partitions=spec.partitions,
                replication_factor=rf,
                topic_configs=configs,
            )
            try:
                resp = await admin.create_topics([topic])
                for name, code, *rest in getattr(resp, "topic_errors", []) or []:
                    if code in (0, TopicAlreadyExistsError.errno):
                        continue
                    text = f"creating topic {name}: error {code} {rest}"
                    if code in _TRANSIENT_CREATE_ERRORS or _FENCED in str(rest):
                        raise _TransientCreateError(text)
                    if code == _INVALID_REPLICATION_FACTOR:
                        # the check above saw enough brokers, the controller does not: a
                        # node fenced in a rolling restart (waited for like a restart)
                        raise _ShortOfBrokers(
                            f"{text}; the cluster has fewer live brokers than "
                            f"TRAJBUS_TOPICS__REPLICATION_FACTOR={rf}")
                    raise RuntimeError(text)
            except TopicAlreadyExistsError:
                pass  # raced with another creator: fine
            created.append(spec.name)
        await _wait_visible(admin, [s.name for s in missing])
        present = sorted(s.name for s in specs if s.name in existing)
        return created, present
    finally:
        await admin.close()


class ReplicationFactorError(ValueError):
    """The topics' replication factor cannot be met by the cluster (a set-up mistake)."""


async def _check_replication_factor(admin: AIOKafkaAdminClient, settings: Settings) -> None:
    """Fail at once, saying what to set, when the cluster has fewer live brokers than the
    replication factor asked for (Kafka would refuse each topic with a bare error 38)."""
    rf = settings.topics.replication_factor
    cluster = await admin.describe_cluster()
    brokers = len(cluster.get("brokers", []) or [])
    if rf == 1 and brokers >= 3:
        log.warning("creating topics with one replica on a cluster of %d brokers: a node's "
                    "death stops them until it is back. Set "
                    "TRAJBUS_TOPICS__REPLICATION_FACTOR=3 (README: 'On a replicated cluster')",
                    brokers)
    if brokers and brokers < rf:
        raise ReplicationFactorError(
            f"TRAJBUS_TOPICS__REPLICATION_FACTOR={rf}, but the Kafka cluster at "
            f"{settings.kafka.bootstrap_servers} has {brokers} live broker"
            f"{'s' if brokers != 1 else ''}: topics cannot be created with {rf} replicas. "
            f"Set TRAJBUS_TOPICS__REPLICATION_FACTOR={brokers} or less (1 for a single local "
            "broker), or bring the cluster's missing nodes back (`trajbus kafka status`).")


async def _wait_visible(admin: AIOKafkaAdminClient, names: list[str], timeout: float = 30) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while names:
        have = set(await admin.list_topics())
        names = [n for n in names if n not in have]
        if not names:
            return
        if asyncio.get_running_loop().time() > deadline:
            raise TimeoutError(f"topics not visible after {timeout}s: {names}")
        await asyncio.sleep(0.1)


async def ensure_base_topics(
    settings: Settings, tasks: Iterable[str] = ()
) -> tuple[list[str], list[str]]:
    topics = Topics(settings)
    specs = topics.specs + [
        topics.replay_spec(t, settings.topics.partitions, topics.derived_max_bytes)
        for t in tasks
    ]
    return await ensure_topics(settings, specs)


async def register_schemas(settings: Settings, registry: SchemaRegistry | None = None) -> int:
    """Publish every bundled schema to the schema topic. Idempotent (compacted by key)."""
    registry = registry or default_registry()
    producer = await get_producer(settings.kafka)
    topic = Topics(settings).schemas
    futures = []
    for name in registry.names:
        info = registry.reader(name)
        futures.append(
            await producer.send(topic, info.canonical.encode(), key=info.fingerprint.hex().encode())
        )
    await asyncio.gather(*futures)
    return len(futures)


# -- static membership ---------------------------------------------------------------------
# aiokafka speaks LeaveGroup v0/v1 only, which cannot name a static member (KIP-345), and it
# sends no LeaveGroup at all for one. v3 removes members by group.instance.id, as Kafka's
# Admin.removeMembersFromConsumerGroup does.
class _LeaveGroupResponseV3(Response):
    API_KEY = 13
    API_VERSION = 3
    SCHEMA = Schema(
        ("throttle_time_ms", Int32),
        ("error_code", Int16),
        ("members", Array(("member_id", String("utf-8")), ("group_instance_id", String("utf-8")),
                          ("error_code", Int16))),
    )


class _LeaveGroupRequestV3(RequestStruct):
    API_KEY = 13
    API_VERSION = 3
    RESPONSE_TYPE = _LeaveGroupResponseV3
    SCHEMA = Schema(
        ("group", String("utf-8")),
        ("members", Array(("member_id", String("utf-8")), ("group_instance_id", String("utf-8")))),
    )


class _StaticLeaveGroup(Request[_LeaveGroupRequestV3]):
    API_KEY = 13

    def __init__(self, group: str, instance_id: str) -> None:
        self.group = group
        self.instance_id = instance_id

    def build(self, request_struct_class: type[_LeaveGroupRequestV3]) -> _LeaveGroupRequestV3:
        return request_struct_class(self.group, [("", self.instance_id)])


async def leave_group_as_static_member(settings: Settings, group_id: str, instance_id: str,
                                       timeout_s: float = 10.0) -> None:
    """Remove the static member ``instance_id`` from ``group_id`` now, so its partitions move
    to the other members at once instead of after its session timeout. For a clean stop; a
    crashed member is simply not removed (its restart takes its partitions back). Raises
    ``RuntimeError`` with the broker's error code if the broker refuses; a member the group
    does not know (never joined, or already expired) is not an error."""
    from aiokafka.errors import for_code

    admin = new_admin(settings.kafka, "admin")
    async with asyncio.timeout(timeout_s):
        await admin.start()
        try:
            node = await admin.find_coordinator(group_id)
            resp = await admin._send_request(_StaticLeaveGroup(group_id, instance_id), node)
        finally:
            await admin.close()
    codes = [resp.error_code] + [code for _, _, code in resp.members]
    bad = [c for c in codes if c not in (0, 25)]  # 25 UNKNOWN_MEMBER_ID: not (or no longer) in
    if bad:
        raise RuntimeError(f"LeaveGroup of {instance_id} in {group_id} refused: "
                           f"{for_code(bad[0]).__name__} (error {bad[0]})")
