"""What a local KRaft node is configured with: its ``server.properties``, its cluster id and the
SCRAM credentials its storage is formatted with.

:func:`server_properties` renders a node's settings (one node alone, or one of a cluster's
static quorum; PLAINTEXT for clients, brokers and the controller, plus a SASL_PLAINTEXT
listener when asked). SCRAM users reach the storage format command only as salted passwords
(:func:`scram_format_args`), so no password appears in a command line.
"""

from __future__ import annotations

import base64
import hashlib
import os
import re
import uuid
from collections.abc import Mapping
from pathlib import Path

#: SCRAM mechanisms a SASL listener can accept, and their hash functions.
SCRAM_HASHES = {"SCRAM-SHA-256": "sha256", "SCRAM-SHA-512": "sha512"}
_SCRAM_NAME_RE = re.compile(r"[A-Za-z0-9._-]+")
_SCRAM_ITERATIONS = 8192


def server_properties(
    *,
    host: str,
    port: int,
    controller_port: int,
    node_id: int,
    log_dirs: Path,
    replication: int,
    message_max_bytes: int,
    quorum_voters: str | None,
    sasl_port: int | None,
    scram_mechanisms: tuple[str, ...],
    extra: Mapping[str, str],
) -> dict[str, str]:
    """The ``server.properties`` of a combined broker+controller node: PLAINTEXT clients on
    ``host:port``, its controller on ``controller_port`` (alone, or one of ``quorum_voters``:
    "1@host:port,2@host:port,..."), topics replicated ``replication`` times, records up to
    ``message_max_bytes``; a SASL_PLAINTEXT listener on ``sasl_port`` accepting
    ``scram_mechanisms``; ``extra`` last, overriding any of them."""
    mmb = str(message_max_bytes)
    rf = str(replication)
    # a write is acknowledged once on all replicas in sync, at least RF-1 of them: one
    # node may be down (or restarting) and writes go on; two down and they stop
    min_isr = str(max(1, replication - 1))
    props = {
        "process.roles": "broker,controller",
        "node.id": str(node_id),
        "controller.quorum.bootstrap.servers": f"{host}:{controller_port}",
        "listeners": (
            f"PLAINTEXT://{host}:{port},CONTROLLER://{host}:{controller_port}"
        ),
        "advertised.listeners": f"PLAINTEXT://{host}:{port}",
        "inter.broker.listener.name": "PLAINTEXT",
        "controller.listener.names": "CONTROLLER",
        "listener.security.protocol.map": "CONTROLLER:PLAINTEXT,PLAINTEXT:PLAINTEXT",
        "log.dirs": str(log_dirs),
        "num.partitions": "1",
        "default.replication.factor": rf,
        "min.insync.replicas": min_isr,
        "unclean.leader.election.enable": "false",
        "auto.create.topics.enable": "false",
        # Internal topics: as replicated as the data, and fewer partitions than the
        # defaults (50) so the first consumer group / transaction on a fresh broker is quick.
        "offsets.topic.replication.factor": rf,
        "offsets.topic.num.partitions": "8",
        "transaction.state.log.replication.factor": rf,
        "transaction.state.log.min.isr": min_isr,
        "transaction.state.log.num.partitions": "8",
        "share.coordinator.state.topic.replication.factor": rf,
        "share.coordinator.state.topic.min.isr": min_isr,
        "group.initial.rebalance.delay.ms": "0",
        # After a SIGKILL the restarted broker must wait for its old registration to
        # expire; a shorter session (default 9 s) makes crash-restart tests faster.
        "broker.heartbeat.interval.ms": "1000",
        "broker.session.timeout.ms": "4000",
        # Large trajectory events: see DEFAULT_MESSAGE_MAX_BYTES.
        "message.max.bytes": mmb,
        "replica.fetch.max.bytes": mmb,
        # Keep the compaction buffer (changelog topics) small for a 512 MiB heap.
        "log.cleaner.dedupe.buffer.size": str(32 * 1024 * 1024),
        "num.network.threads": "2",
        "num.io.threads": "4",
    }
    if quorum_voters is not None:
        del props["controller.quorum.bootstrap.servers"]
        props["controller.quorum.voters"] = quorum_voters
    if sasl_port is not None:
        listener = f"SASL_PLAINTEXT://{host}:{sasl_port}"
        props["listeners"] += f",{listener}"
        props["advertised.listeners"] += f",{listener}"
        props["listener.security.protocol.map"] += ",SASL_PLAINTEXT:SASL_PLAINTEXT"
        props["sasl.enabled.mechanisms"] = ",".join(scram_mechanisms)
        for mech in scram_mechanisms:
            props[f"listener.name.sasl_plaintext.{mech.lower()}.sasl.jaas.config"] = (
                "org.apache.kafka.common.security.scram.ScramLoginModule required;"
            )
    props.update(extra)
    return props


def check_scram_options(sasl_port: int | None, scram_users: Mapping[str, str],
                        scram_mechanisms: tuple[str, ...]) -> None:
    """ValueError unless the mechanisms are known, users come with a SASL listener and every
    user name is one the credential syntax can carry."""
    if not scram_mechanisms or not set(scram_mechanisms) <= set(SCRAM_HASHES):
        raise ValueError(f"scram_mechanisms: some of {sorted(SCRAM_HASHES)}")
    if scram_users and sasl_port is None:
        raise ValueError("scram_users need a sasl_port (the SASL_PLAINTEXT listener)")
    for name in scram_users or {}:
        if not _SCRAM_NAME_RE.fullmatch(name):
            raise ValueError(f"SCRAM user name {name!r}: use letters, digits, '.', '_', '-'")


def scram_format_args(scram_users: Mapping[str, str],
                      scram_mechanisms: tuple[str, ...]) -> list[str]:
    """``kafka-storage format`` arguments that bootstrap every user for every mechanism."""
    args: list[str] = []
    for name, password in scram_users.items():
        for mech in scram_mechanisms:
            args += ["--add-scram", _scram_credential(mech, name, password)]
    return args


def _scram_credential(mechanism: str, name: str, password: str) -> str:
    """``kafka-storage format --add-scram`` argument with a salted password (RFC 5802
    ``Hi(password, salt, i)``), so the password itself never appears in a command line."""
    salt = os.urandom(16)
    salted = hashlib.pbkdf2_hmac(
        SCRAM_HASHES[mechanism], password.encode(), salt, _SCRAM_ITERATIONS
    )
    b64 = base64.b64encode
    return (
        f"{mechanism}=[name={name},iterations={_SCRAM_ITERATIONS},"
        f'salt="{b64(salt).decode()}",saltedpassword="{b64(salted).decode()}"]'
    )


def new_cluster_id() -> str:
    """A random Kafka cluster id (base64url of 16 random bytes, as Uuid.randomUuid())."""
    while True:
        cid = base64.urlsafe_b64encode(uuid.uuid4().bytes).rstrip(b"=").decode()
        if not cid.startswith("-"):
            return cid
