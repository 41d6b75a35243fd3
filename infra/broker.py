"""A single-node Apache Kafka broker (KRaft, no ZooKeeper, no Docker) for development and tests.

The broker runs from plain jars fetched from Maven Central by ``infra/kafka/pom.xml`` (see
:func:`ensure_jars`); Java 17+ runs it and Maven fetches it on first use::

    from trajbus.infra.broker import LocalBroker

    broker = LocalBroker(data_dir="/tmp/kafka", port=19092)
    broker.start()              # formats storage on first start, waits until the broker answers
    print(broker.bootstrap)     # "127.0.0.1:19092"
    broker.kill()               # SIGKILL, for crash tests; start() again keeps the data
    broker.start()
    broker.stop()               # SIGTERM (controlled shutdown), then SIGKILL after a timeout

Layout of a data directory::

    broker.json          ports and cluster id chosen at first start (reused on restart)
    server.properties    rewritten at every start
    broker.pid           pid of the running JVM
    broker.out           the JVM's stdout/stderr (crashes, JVM errors)
    logs/server.log      Kafka's own log (log4j2, see infra/kafka/log4j2.yaml)
    kraft-logs/          partition data and the KRaft metadata log

SASL/SCRAM (for tests of client authentication): ``LocalBroker(..., sasl_port=P,
scram_users={"alice": "alice-secret"})`` adds a ``SASL_PLAINTEXT://127.0.0.1:P`` listener
accepting ``scram_mechanisms`` (SCRAM-SHA-256 and SCRAM-SHA-512 by default) next to the
PLAINTEXT one (which inter-broker traffic, the controller and :func:`probe_broker` keep
using). The credentials are bootstrapped into the KRaft metadata, for every mechanism, when the
storage is first formatted (``kafka-storage format --add-scram``, passed as salted passwords,
so no password appears in a command line); a data directory formatted without them does not
get them later.

Environment: ``TRAJBUS_KAFKA_PORT`` and ``TRAJBUS_KAFKA_DATA_DIR`` override the default port
(9092) and data directory (``.trajbus/kafka`` under the current directory);
``TRAJBUS_KAFKA_LIB_DIR`` points at an existing directory of Kafka jars (for example the
``libs/`` folder of a Kafka 4.x binary distribution) instead of fetching them.
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import json
import os
import random
import re
import shutil
import signal
import socket
import struct
import subprocess
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any

from trajbus.infra.maven import JarSet, fetch_jars

__all__ = [
    "DEFAULT_MESSAGE_MAX_BYTES",
    "DEFAULT_PORT",
    "KAFKA_DIR",
    "BrokerError",
    "BrokerStatus",
    "KafkaSetupError",
    "LocalBroker",
    "ensure_jars",
    "free_port",
    "kafka_version",
    "probe_broker",
]

KAFKA_DIR = Path(__file__).resolve().parent / "kafka"
POM_PATH = KAFKA_DIR / "pom.xml"
LOG4J_CONFIG = KAFKA_DIR / "log4j2.yaml"
DEFAULT_LIB_DIR = KAFKA_DIR / "lib"

DEFAULT_PORT = 9092
DEFAULT_HOST = "127.0.0.1"
DEFAULT_DATA_DIR = Path(".trajbus") / "kafka"
#: Largest record batch the broker accepts (10 MiB; Kafka's default is ~1 MiB). Trajectory
#: events carrying long token lists or observations can be large; producers must raise
#: ``max_request_size`` to match (and consumers ``max_partition_fetch_bytes``).
DEFAULT_MESSAGE_MAX_BYTES = 10 * 1024 * 1024
MIN_JAVA = 17

_BROKER_MAIN = "kafka.Kafka"
_STORAGE_MAIN = "kafka.tools.StorageTool"


class KafkaSetupError(RuntimeError):
    """Java, Maven or the Kafka jars are missing or unusable."""


class BrokerError(RuntimeError):
    """The broker failed to start or stop, or its port is taken."""


# --------------------------------------------------------------------------------------------
# jars


def kafka_version(pom: Path = POM_PATH) -> str:
    """The Kafka version pinned in ``infra/kafka/pom.xml``."""
    return _kafka_jars(pom).version()


def _kafka_jars(pom: Path = POM_PATH) -> JarSet:
    return JarSet(pom, "kafka.version", "kafka_2.13-*.jar", "Kafka {version} jars", KafkaSetupError)


def _require_tool(name: str, what: str) -> str:
    exe = shutil.which(name)
    if exe is None:
        raise KafkaSetupError(
            f"`{name}` not found on PATH: {what}. Install a JDK 17+ and Apache Maven 3.6+ "
            "(Debian/Ubuntu: `apt-get install openjdk-17-jdk-headless maven`; macOS: "
            "`brew install openjdk@17 maven`), or set TRAJBUS_KAFKA_LIB_DIR to a directory of "
            "Kafka 4.x jars (e.g. the libs/ folder of a Kafka binary distribution)."
        )
    return exe


_java_major_cache: dict[str, int] = {}


def _java_major(java: str) -> int:
    if java not in _java_major_cache:
        out = subprocess.run(
            [java, "-version"], capture_output=True, text=True, check=False, timeout=60
        )
        match = re.search(r'version "(\d+)(?:\.(\d+))?', out.stderr + out.stdout)
        major = 0
        if match:
            major = int(match.group(1))
            if major == 1 and match.group(2):  # "1.8.0_x" style
                major = int(match.group(2))
        _java_major_cache[java] = major
    return _java_major_cache[java]


def _require_java() -> str:
    java = _require_tool("java", "Java 17+ runs the Kafka broker")
    major = _java_major(java)
    if 0 < major < MIN_JAVA:
        raise KafkaSetupError(
            f"{java} is Java {major}; Kafka 4.x needs Java {MIN_JAVA}+ "
            "(put a newer JDK first on PATH)."
        )
    return java


def ensure_jars(lib_dir: Path | None = None, *, force: bool = False, quiet: bool = False) -> Path:
    """Return a directory holding the Kafka runtime jars, fetching them if needed.

    With ``TRAJBUS_KAFKA_LIB_DIR`` set (and no ``lib_dir`` argument) that directory is used
    as is. Otherwise the jars live in ``infra/kafka/lib/``; they are (re)fetched with
    ``mvn -f infra/kafka/pom.xml`` when missing, when the pom changed since the last fetch
    (a stamp file records the Kafka version and the pom's hash), or when ``force`` is set.
    Maven caches downloads in ``~/.m2``. Concurrent callers serialize on a file lock.
    """
    if lib_dir is None:
        env_dir = os.environ.get("TRAJBUS_KAFKA_LIB_DIR")
        if env_dir:
            path = Path(env_dir).expanduser().resolve()
            if not any(path.glob("kafka_2.13-*.jar")):
                raise KafkaSetupError(f"TRAJBUS_KAFKA_LIB_DIR={env_dir} holds no kafka_2.13-*.jar")
            return path
        lib_dir = DEFAULT_LIB_DIR

    def mvn() -> str:
        exe = _require_tool("mvn", "Maven fetches the Kafka jars from Maven Central")
        _require_java()
        return exe

    return fetch_jars(_kafka_jars(), Path(lib_dir), mvn=mvn, force=force, quiet=quiet)


# --------------------------------------------------------------------------------------------
# small helpers


_HANDED_OUT: set[int] = set()
_LOW_PORT = 10_000  # below it: well-known services' ports


def ephemeral_ports() -> tuple[int, int]:
    """The kernel's range of local ports for outgoing connections (Linux; else IANA's)."""
    try:
        lo, hi = (int(x) for x in
                  Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
    except (OSError, ValueError):
        return 49152, 65535
    return lo, hi


def free_port(host: str = DEFAULT_HOST) -> int:
    """A TCP port that is free right now on ``host`` (for tests; racy by nature), never one
    this process was given before, and below the kernel's ephemeral range: the port of a node
    that is stopped and started again must stay free meanwhile, and in the ephemeral range any
    outgoing connection of any process may take it as its local port (a 3-node cluster of the
    drill could not bind its listener: "Address already in use")."""
    lo, _ = ephemeral_ports()
    if lo - 1 > _LOW_PORT + 1000:
        rng = random.SystemRandom()
        for _ in range(500):
            port = rng.randint(_LOW_PORT, lo - 1)
            if port not in _HANDED_OUT and _port_free(host, port):
                _HANDED_OUT.add(port)
                return port
    for _ in range(100):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind((host, 0))
            port = int(sock.getsockname()[1])
        if port not in _HANDED_OUT:
            _HANDED_OUT.add(port)
            return port
    raise OSError("no free port that was not handed out already")


def _port_free(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        # Kafka binds with SO_REUSEADDR too, so TIME_WAIT leftovers do not count as "in use".
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError:
            return False
        return True


def _new_cluster_id() -> str:
    """A random Kafka cluster id (base64url of 16 random bytes, as Uuid.randomUuid())."""
    while True:
        cid = base64.urlsafe_b64encode(uuid.uuid4().bytes).rstrip(b"=").decode()
        if not cid.startswith("-"):
            return cid


def _tail(path: Path, lines: int = 30) -> str:
    try:
        with open(path, "rb") as fh:
            fh.seek(0, os.SEEK_END)
            fh.seek(max(0, fh.tell() - 64 * 1024))
            text = fh.read().decode("utf-8", errors="replace")
    except OSError:
        return "(no log)"
    return "\n".join(text.splitlines()[-lines:]) or "(empty)"


def _pid_alive(pid: int) -> bool:
    """True if ``pid`` exists and is not a zombie."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True  # no /proc (macOS): trust kill(0)
    return stat.rsplit(")", 1)[-1].split()[0] != "Z"


def _pid_cmdline(pid: int) -> str | None:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return None


_SCRAM_HASHES = {"SCRAM-SHA-256": "sha256", "SCRAM-SHA-512": "sha512"}
_SCRAM_NAME_RE = re.compile(r"[A-Za-z0-9._-]+")
_SCRAM_ITERATIONS = 8192


def _scram_credential(mechanism: str, name: str, password: str) -> str:
    """``kafka-storage format --add-scram`` argument with a salted password (RFC 5802
    ``Hi(password, salt, i)``), so the password itself never appears in a command line."""
    salt = os.urandom(16)
    salted = hashlib.pbkdf2_hmac(
        _SCRAM_HASHES[mechanism], password.encode(), salt, _SCRAM_ITERATIONS
    )
    b64 = base64.b64encode
    return (
        f"{mechanism}=[name={name},iterations={_SCRAM_ITERATIONS},"
        f'salt="{b64(salt).decode()}",saltedpassword="{b64(salted).decode()}"]'
    )


# --------------------------------------------------------------------------------------------
# Kafka protocol probe (ApiVersions, then Metadata to see the broker registered and unfenced)


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise ConnectionError("connection closed by broker")
        buf += chunk
    return bytes(buf)


def _request(sock: socket.socket, api_key: int, version: int, corr: int, body: bytes) -> bytes:
    client_id = b"trajbus-probe"
    header = struct.pack(">hhih", api_key, version, corr, len(client_id)) + client_id
    payload = header + body
    sock.sendall(struct.pack(">i", len(payload)) + payload)
    (size,) = struct.unpack(">i", _recv_exact(sock, 4))
    resp = _recv_exact(sock, size)
    (resp_corr,) = struct.unpack(">i", resp[:4])
    if resp_corr != corr:
        raise ConnectionError("correlation id mismatch")
    return resp[4:]


def probe_broker(host: str, port: int, timeout: float = 2.0) -> int | None:
    """Ask the broker at host:port for its live brokers using the Kafka wire protocol.

    Returns the number of unfenced brokers in its Metadata response (0 while it is still
    registering), or None if nothing answers the Kafka protocol there.
    """
    try:
        with socket.create_connection((host, port), timeout=timeout) as sock:
            sock.settimeout(timeout)
            # ApiVersions v0: supported by every broker, tells us the Metadata version range.
            resp = _request(sock, api_key=18, version=0, corr=1, body=b"")
            (error,) = struct.unpack(">h", resp[:2])
            if error != 0:
                return None
            (count,) = struct.unpack(">i", resp[2:6])
            md_range: tuple[int, int] | None = None
            for i in range(count):
                key, lo, hi = struct.unpack(">hhh", resp[6 + 6 * i : 12 + 6 * i])
                if key == 3:
                    md_range = (lo, hi)
            # Metadata v4..v8 share a non-flexible layout: throttle_time_ms, then brokers.
            usable = [v for v in range(4, 9) if md_range and md_range[0] <= v <= md_range[1]]
            if not usable:
                return 1  # the broker answers; we cannot count brokers on this version
            version = max(usable)
            body = struct.pack(">i", -1) + b"\x00"  # all topics, no auto-creation
            if version >= 8:
                body += b"\x00\x00"  # include_cluster/topic_authorized_operations = false
            resp = _request(sock, api_key=3, version=version, corr=2, body=body)
            (brokers,) = struct.unpack(">i", resp[4:8])
            return brokers
    except (OSError, ConnectionError, struct.error):
        return None


# --------------------------------------------------------------------------------------------
# the broker


@dataclass(frozen=True)
class BrokerStatus:
    running: bool
    pid: int | None
    port: int
    controller_port: int
    bootstrap: str
    data_dir: Path
    log_file: Path

    def as_dict(self) -> dict[str, object]:
        return {
            "running": self.running,
            "pid": self.pid,
            "port": self.port,
            "controller_port": self.controller_port,
            "bootstrap": self.bootstrap,
            "data_dir": str(self.data_dir),
            "log_file": str(self.log_file),
        }


class LocalBroker:
    """One single-node KRaft broker (combined broker+controller) in a data directory.

    ``port``/``controller_port`` default to ``TRAJBUS_KAFKA_PORT`` or 9092 and port+1; once a
    data directory has been started, its recorded ports are reused unless given explicitly
    (the controller endpoint is part of the KRaft metadata, so it must not change).
    """

    def __init__(
        self,
        data_dir: str | os.PathLike[str] | None = None,
        port: int | None = None,
        controller_port: int | None = None,
        *,
        host: str = DEFAULT_HOST,
        heap: str = "512m",
        message_max_bytes: int = DEFAULT_MESSAGE_MAX_BYTES,
        extra_properties: Mapping[str, str] | None = None,
        lib_dir: Path | None = None,
        sasl_port: int | None = None,
        scram_users: Mapping[str, str] | None = None,
        scram_mechanisms: tuple[str, ...] = ("SCRAM-SHA-256", "SCRAM-SHA-512"),
        node_id: int = 1,
        quorum_voters: str | None = None,
        cluster_id: str | None = None,
        replication: int = 1,
    ) -> None:
        if data_dir is None:
            data_dir = os.environ.get("TRAJBUS_KAFKA_DATA_DIR") or DEFAULT_DATA_DIR
        self.data_dir = Path(data_dir).expanduser().resolve()
        self.host = host
        # One node of a cluster (infra/cluster.py): its id, the static controller quorum
        # ("1@host:port,2@host:port,..."), the cluster's id and its replication factor.
        self.node_id = node_id
        self.quorum_voters = quorum_voters
        self._cluster_id = cluster_id
        if replication < 1:
            raise ValueError("replication must be at least 1")
        self.replication = replication
        self.heap = heap
        self.message_max_bytes = message_max_bytes
        self.extra_properties = dict(extra_properties or {})
        self._lib_dir = lib_dir
        self._proc: subprocess.Popen[bytes] | None = None
        if not scram_mechanisms or not set(scram_mechanisms) <= set(_SCRAM_HASHES):
            raise ValueError(f"scram_mechanisms: some of {sorted(_SCRAM_HASHES)}")
        if scram_users and sasl_port is None:
            raise ValueError("scram_users need a sasl_port (the SASL_PLAINTEXT listener)")
        for name in scram_users or {}:
            if not _SCRAM_NAME_RE.fullmatch(name):
                raise ValueError(f"SCRAM user name {name!r}: use letters, digits, '.', '_', '-'")
        self.sasl_port = sasl_port
        self.scram_mechanisms = tuple(scram_mechanisms)
        self._scram_users = dict(scram_users or {})  # never logged nor shown in repr

        meta = self._read_meta()
        if port is None:
            env_port = os.environ.get("TRAJBUS_KAFKA_PORT")
            if env_port:
                port = int(env_port)
            elif "port" in meta:
                port = int(meta["port"])
            else:
                port = DEFAULT_PORT
        if controller_port is None:
            controller_port = (
                int(meta["controller_port"]) if "controller_port" in meta else port + 1
            )
        if port == controller_port:
            raise ValueError("port and controller_port must differ")
        self.port = port
        self.controller_port = controller_port

    # paths ----------------------------------------------------------------------------------
    @property
    def bootstrap(self) -> str:
        return f"{self.host}:{self.port}"

    @property
    def sasl_bootstrap(self) -> str:
        """``host:sasl_port`` of the SASL_PLAINTEXT listener (ValueError without one)."""
        if self.sasl_port is None:
            raise ValueError("this broker has no SASL listener (sasl_port=None)")
        return f"{self.host}:{self.sasl_port}"

    @property
    def meta_file(self) -> Path:
        return self.data_dir / "broker.json"

    @property
    def properties_file(self) -> Path:
        return self.data_dir / "server.properties"

    @property
    def pid_file(self) -> Path:
        return self.data_dir / "broker.pid"

    @property
    def stdout_file(self) -> Path:
        return self.data_dir / "broker.out"

    @property
    def logs_dir(self) -> Path:
        return self.data_dir / "logs"

    @property
    def log_file(self) -> Path:
        """Kafka's own log (server.log)."""
        return self.logs_dir / "server.log"

    @property
    def kraft_dir(self) -> Path:
        return self.data_dir / "kraft-logs"

    def _read_meta(self) -> dict[str, Any]:
        try:
            data = json.loads(self.meta_file.read_text())
        except (OSError, ValueError):
            return {}
        return data if isinstance(data, dict) else {}

    # status ---------------------------------------------------------------------------------
    def pid(self) -> int | None:
        """Pid of this data directory's running broker, or None (stale pid files ignored)."""
        if self._proc is not None and self._proc.poll() is not None:
            self._proc = None  # reaped
        try:
            pid = int(self.pid_file.read_text().strip())
        except (OSError, ValueError):
            return None
        if not _pid_alive(pid):
            return None
        cmdline = _pid_cmdline(pid)
        if cmdline is not None and (
            _BROKER_MAIN not in cmdline or str(self.properties_file) not in cmdline
        ):
            return None  # pid reused by an unrelated process
        return pid

    def is_running(self) -> bool:
        return self.pid() is not None

    def status(self) -> BrokerStatus:
        pid = self.pid()
        return BrokerStatus(
            running=pid is not None,
            pid=pid,
            port=self.port,
            controller_port=self.controller_port,
            bootstrap=self.bootstrap,
            data_dir=self.data_dir,
            log_file=self.log_file,
        )

    # start ----------------------------------------------------------------------------------
    def server_properties(self) -> dict[str, str]:
        mmb = str(self.message_max_bytes)
        rf = str(self.replication)
        # a write is acknowledged once on all replicas in sync, at least RF-1 of them: one
        # node may be down (or restarting) and writes go on; two down and they stop
        min_isr = str(max(1, self.replication - 1))
        props = {
            "process.roles": "broker,controller",
            "node.id": str(self.node_id),
            "controller.quorum.bootstrap.servers": f"{self.host}:{self.controller_port}",
            "listeners": (
                f"PLAINTEXT://{self.host}:{self.port},CONTROLLER://{self.host}:{self.controller_port}"
            ),
            "advertised.listeners": f"PLAINTEXT://{self.host}:{self.port}",
            "inter.broker.listener.name": "PLAINTEXT",
            "controller.listener.names": "CONTROLLER",
            "listener.security.protocol.map": "CONTROLLER:PLAINTEXT,PLAINTEXT:PLAINTEXT",
            "log.dirs": str(self.kraft_dir),
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
        if self.quorum_voters is not None:
            del props["controller.quorum.bootstrap.servers"]
            props["controller.quorum.voters"] = self.quorum_voters
        if self.sasl_port is not None:
            listener = f"SASL_PLAINTEXT://{self.host}:{self.sasl_port}"
            props["listeners"] += f",{listener}"
            props["advertised.listeners"] += f",{listener}"
            props["listener.security.protocol.map"] += ",SASL_PLAINTEXT:SASL_PLAINTEXT"
            props["sasl.enabled.mechanisms"] = ",".join(self.scram_mechanisms)
            for mech in self.scram_mechanisms:
                props[f"listener.name.sasl_plaintext.{mech.lower()}.sasl.jaas.config"] = (
                    "org.apache.kafka.common.security.scram.ScramLoginModule required;"
                )
        props.update(self.extra_properties)
        return props

    def _write_properties(self) -> None:
        lines = [f"# written by trajbus.infra.broker.LocalBroker at {time.ctime()}"]
        lines += [f"{k}={v}" for k, v in self.server_properties().items()]
        self.properties_file.write_text("\n".join(lines) + "\n")

    def _java_cmd(self, lib_dir: Path, main: str, *args: str) -> list[str]:
        return [
            _require_java(),
            f"-Xmx{self.heap}",
            "-Xms128m",
            "-XX:+UseG1GC",
            "-XX:MaxGCPauseMillis=20",
            "-XX:+ExitOnOutOfMemoryError",
            "-Djava.awt.headless=true",
            f"-Dlog4j2.configurationFile={LOG4J_CONFIG}",
            f"-Dkafka.logs.dir={self.logs_dir}",
            "-cp",
            f"{lib_dir}/*",
            main,
            *args,
        ]

    def _formatted(self) -> bool:
        return (self.kraft_dir / "meta.properties").exists()

    def _format(self, lib_dir: Path, cluster_id: str) -> None:
        cmd = self._java_cmd(
            lib_dir,
            _STORAGE_MAIN,
            "format",
            *(() if self.quorum_voters is not None else ("--standalone",)),
            "-t",
            cluster_id,
            "-c",
            str(self.properties_file),
        )
        for name, password in self._scram_users.items():
            for mech in self.scram_mechanisms:
                cmd += ["--add-scram", _scram_credential(mech, name, password)]
        proc = subprocess.run(cmd, capture_output=True, text=True, check=False, timeout=120)
        if proc.returncode != 0 or not self._formatted():
            raise BrokerError(
                f"formatting Kafka storage in {self.kraft_dir} failed "
                f"(exit {proc.returncode}):\n{(proc.stdout + proc.stderr).strip()[-4000:]}"
            )

    def start(self, timeout: float = 60.0) -> None:
        """Start the broker (formatting storage on first use) and wait until it answers.

        Idempotent: if this data directory's broker is already running, only waits for it.
        Raises BrokerError (with the tail of the broker log) if it does not come up in time.
        """
        pid = self.launch()
        try:
            self.wait_ready(timeout, pid=pid)
        except BaseException:
            if self._proc is not None and self._proc.pid == pid:  # ours: do not leave it half up
                self._terminate(pid, 10.0)
                self.pid_file.unlink(missing_ok=True)
            raise

    def launch(self) -> int:
        """Start the broker's JVM (formatting storage on first use) without waiting for it to
        answer; returns its pid (the running one's if it is up already). The nodes of a
        cluster are launched together: none answers before a majority of controllers runs."""
        existing = self.pid()
        if existing is not None:
            return existing
        ports = [("port", self.port), ("controller port", self.controller_port)]
        if self.sasl_port is not None:
            ports.append(("SASL port", self.sasl_port))
        for what, port in ports:
            if not _port_free(self.host, port):
                raise BrokerError(
                    f"{what} {self.host}:{port} is already in use by another process "
                    f"(not the broker of {self.data_dir}); pick another with --port / "
                    "TRAJBUS_KAFKA_PORT, or stop whatever listens there "
                    f"(e.g. `ss -ltnp 'sport = :{port}'`)."
                )
        lib_dir = ensure_jars(self._lib_dir)
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self.logs_dir.mkdir(exist_ok=True)

        meta = self._read_meta()
        cluster_id = str(meta.get("cluster_id") or self._cluster_id or _new_cluster_id())
        self._write_properties()
        if not self._formatted():
            self._format(lib_dir, cluster_id)
        self.meta_file.write_text(
            json.dumps(
                {
                    "cluster_id": cluster_id,
                    "port": self.port,
                    "controller_port": self.controller_port,
                    "kafka_version": kafka_version(),
                },
                indent=2,
            )
        )

        cmd = self._java_cmd(lib_dir, _BROKER_MAIN, str(self.properties_file))
        with open(self.stdout_file, "ab") as out:
            out.write(f"\n=== {time.ctime()} starting: {' '.join(cmd)}\n".encode())
            out.flush()
            self._proc = subprocess.Popen(
                cmd,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                cwd=self.data_dir,
                start_new_session=True,  # own process group: survives the caller's Ctrl-C
            )
        self.pid_file.write_text(f"{self._proc.pid}\n")
        return self._proc.pid

    def wait_ready(self, timeout: float = 60.0, *, pid: int | None = None) -> None:
        """Wait until the broker answers Metadata with itself registered (unfenced)."""
        deadline = time.monotonic() + timeout
        pid = pid if pid is not None else self.pid()
        while True:
            if probe_broker(self.host, self.port, timeout=2.0):
                return
            if pid is None or not self._alive(pid):
                raise BrokerError(self._failure("exited during startup"))
            if time.monotonic() >= deadline:
                raise BrokerError(self._failure(f"did not answer within {timeout:.0f} s"))
            time.sleep(0.2)

    def _alive(self, pid: int) -> bool:
        if self._proc is not None and self._proc.pid == pid:
            return self._proc.poll() is None
        return _pid_alive(pid)

    def _failure(self, what: str) -> str:
        parts = [f"Kafka broker at {self.bootstrap} ({self.data_dir}) {what}."]
        parts.append(f"--- last lines of {self.log_file} ---\n{_tail(self.log_file)}")
        parts.append(f"--- last lines of {self.stdout_file} ---\n{_tail(self.stdout_file)}")
        return "\n".join(parts)

    # stop -----------------------------------------------------------------------------------
    def _wait_gone(self, pid: int, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while True:
            if self._proc is not None and self._proc.pid == pid:
                try:
                    self._proc.wait(timeout=max(0.0, min(0.2, deadline - time.monotonic())))
                    self._proc = None
                    return True
                except subprocess.TimeoutExpired:
                    pass
            elif not _pid_alive(pid):
                return True
            else:
                time.sleep(0.1)
            if time.monotonic() >= deadline:
                return False

    def _terminate(self, pid: int, timeout: float) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)
        if not self._wait_gone(pid, timeout):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
            if not self._wait_gone(pid, 10.0):
                raise BrokerError(f"broker pid {pid} survived SIGKILL")

    def stop(self, timeout: float = 30.0) -> None:
        """Controlled shutdown: SIGTERM the pid in the pid file, SIGKILL after ``timeout``."""
        pid = self.pid()
        if pid is not None:
            self._terminate(pid, timeout)
        self.pid_file.unlink(missing_ok=True)

    def kill(self) -> None:
        """SIGKILL the broker at once (crash simulation). The data directory stays usable:
        ``start()`` recovers the logs. The stale pid file is left behind, as after a crash."""
        pid = self.pid()
        if pid is None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
        if not self._wait_gone(pid, 10.0):
            raise BrokerError(f"broker pid {pid} survived SIGKILL")

    def pause(self) -> None:
        """SIGSTOP the broker: it holds its connections and answers nothing (a long GC pause,
        a frozen VM) until :meth:`resume`."""
        pid = self.pid()
        if pid is None:
            raise BrokerError(f"no broker running for {self.data_dir}")
        os.kill(pid, signal.SIGSTOP)

    def resume(self) -> None:
        """SIGCONT a broker stopped by :meth:`pause`."""
        pid = self.pid()
        if pid is not None:
            os.kill(pid, signal.SIGCONT)

    def restart(self, timeout: float = 60.0) -> None:
        self.stop()
        self.start(timeout)

    def __enter__(self) -> LocalBroker:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    def __repr__(self) -> str:
        return f"LocalBroker(data_dir={str(self.data_dir)!r}, port={self.port})"
