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

This module is the launcher (:class:`LocalBroker`) and the façade of what it is built from:
the Kafka jars and Java (:mod:`~trajbus.infra.kafka_runtime`), a node's configuration
(:mod:`~trajbus.infra.broker_config`), ports (:mod:`~trajbus.infra.ports`), the readiness probe
(:mod:`~trajbus.infra.kafka_probe`) and process checks (:mod:`~trajbus.infra.processes`), whose
public names import from here too.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any, overload

from trajbus.infra.broker_config import (
    check_scram_options,
    new_cluster_id,
    scram_format_args,
    server_properties,
)
from trajbus.infra.kafka_probe import probe_broker
from trajbus.infra.kafka_runtime import (
    DEFAULT_LIB_DIR,
    KAFKA_DIR,
    LOG4J_CONFIG,
    MIN_JAVA,
    POM_PATH,
    KafkaSetupError,
    ensure_jars,
    java_command,
    kafka_version,
    require_java,
)
from trajbus.infra.ports import DEFAULT_HOST, ephemeral_ports, free_port, port_free
from trajbus.infra.processes import file_tail, freeze, pid_alive, pid_cmdline

__all__ = [
    "DEFAULT_DATA_DIR",
    "DEFAULT_HOST",
    "DEFAULT_LIB_DIR",
    "DEFAULT_MESSAGE_MAX_BYTES",
    "DEFAULT_PORT",
    "KAFKA_DIR",
    "LOG4J_CONFIG",
    "MIN_JAVA",
    "POM_PATH",
    "BrokerError",
    "BrokerStatus",
    "KafkaSetupError",
    "LocalBroker",
    "ensure_jars",
    "ephemeral_ports",
    "free_port",
    "kafka_version",
    "probe_broker",
]

# private names some callers import from here
_require_java = require_java
_pid_alive = pid_alive
_port_free = port_free
_new_cluster_id = new_cluster_id

DEFAULT_PORT = 9092
DEFAULT_DATA_DIR = Path(".trajbus") / "kafka"
#: Largest record batch the broker accepts (10 MiB; Kafka's default is ~1 MiB). Trajectory
#: events carrying long token lists or observations can be large; producers must raise
#: ``max_request_size`` to match (and consumers ``max_partition_fetch_bytes``).
DEFAULT_MESSAGE_MAX_BYTES = 10 * 1024 * 1024

_BROKER_MAIN = "kafka.Kafka"
_STORAGE_MAIN = "kafka.tools.StorageTool"


class BrokerError(RuntimeError):
    """The broker failed to start or stop, or its port is taken."""


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


class _InDataDir:
    """A path in a broker's data directory, as a read-only attribute of :class:`LocalBroker`."""

    def __init__(self, *parts: str) -> None:
        self.parts = parts

    @overload
    def __get__(self, broker: None, owner: type[Any]) -> _InDataDir: ...
    @overload
    def __get__(self, broker: LocalBroker, owner: type[Any]) -> Path: ...
    def __get__(self, broker: LocalBroker | None, owner: type[Any]) -> Path | _InDataDir:
        return self if broker is None else broker.data_dir.joinpath(*self.parts)

    def __set__(self, broker: LocalBroker, value: object) -> None:
        raise AttributeError("a broker's paths follow its data_dir")


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
        check_scram_options(sasl_port, scram_users or {}, tuple(scram_mechanisms))
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

    meta_file = _InDataDir("broker.json")
    properties_file = _InDataDir("server.properties")
    pid_file = _InDataDir("broker.pid")
    stdout_file = _InDataDir("broker.out")
    logs_dir = _InDataDir("logs")
    log_file = _InDataDir("logs", "server.log")  # Kafka's own log
    kraft_dir = _InDataDir("kraft-logs")

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
        if not pid_alive(pid):
            return None
        cmdline = pid_cmdline(pid)
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
        """This node's ``server.properties`` (rewritten at every start)."""
        return server_properties(
            host=self.host, port=self.port, controller_port=self.controller_port,
            node_id=self.node_id, log_dirs=self.kraft_dir, replication=self.replication,
            message_max_bytes=self.message_max_bytes, quorum_voters=self.quorum_voters,
            sasl_port=self.sasl_port, scram_mechanisms=self.scram_mechanisms,
            extra=self.extra_properties)

    def _write_properties(self) -> None:
        lines = [f"# written by trajbus.infra.broker.LocalBroker at {time.ctime()}"]
        lines += [f"{k}={v}" for k, v in self.server_properties().items()]
        self.properties_file.write_text("\n".join(lines) + "\n")

    def _java_cmd(self, lib_dir: Path, main: str, *args: str) -> list[str]:
        return java_command(lib_dir, main, *args, heap=self.heap, logs_dir=self.logs_dir)

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
        cmd += scram_format_args(self._scram_users, self.scram_mechanisms)
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
            if not port_free(self.host, port):
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
        cluster_id = str(meta.get("cluster_id") or self._cluster_id or new_cluster_id())
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
        return pid_alive(pid)

    def _failure(self, what: str) -> str:
        parts = [f"Kafka broker at {self.bootstrap} ({self.data_dir}) {what}."]
        parts.append(f"--- last lines of {self.log_file} ---\n{file_tail(self.log_file)}")
        parts.append(f"--- last lines of {self.stdout_file} ---\n{file_tail(self.stdout_file)}")
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
            elif not pid_alive(pid):
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
        a frozen VM) until :meth:`resume`. Returns once every thread of it has stopped."""
        pid = self.pid()
        if pid is None:
            raise BrokerError(f"no broker running for {self.data_dir}")
        try:
            freeze(pid)
        except TimeoutError as exc:
            raise BrokerError(f"broker pid {pid} did not stop: {exc}") from exc

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
