"""Kafka's runtime: the pinned Kafka jars (fetched from Maven Central) and the Java that runs them.

:func:`ensure_jars` returns a directory of the jars ``infra/kafka/pom.xml`` pins (fetched once
per pom, see :mod:`trajbus.infra.maven`), or the directory ``TRAJBUS_KAFKA_LIB_DIR`` names;
:func:`require_java` finds a Java 17+; :func:`java_command` is the command line that runs one of
Kafka's main classes from those jars. Whatever is missing or unusable raises
:class:`KafkaSetupError`, saying what to install or set.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

from trajbus.infra.maven import JarSet, fetch_jars

KAFKA_DIR = Path(__file__).resolve().parent / "kafka"
POM_PATH = KAFKA_DIR / "pom.xml"
LOG4J_CONFIG = KAFKA_DIR / "log4j2.yaml"
DEFAULT_LIB_DIR = KAFKA_DIR / "lib"
MIN_JAVA = 17


class KafkaSetupError(RuntimeError):
    """Java, Maven or the Kafka jars are missing or unusable."""


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


def require_java() -> str:
    """The ``java`` on PATH; KafkaSetupError when there is none or it is older than Java 17."""
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
        require_java()
        return exe

    return fetch_jars(_kafka_jars(), Path(lib_dir), mvn=mvn, force=force, quiet=quiet)


#: JVM options that replace the default tuning (G1 with short pauses) of the local brokers
#: and their storage format, split on whitespace. The test suite sets the lean
#: :data:`LEAN_JVM_OPTIONS` for its many short-lived brokers.
JVM_OPTIONS_ENV = "TRAJBUS_KAFKA_JVM_OPTIONS"
DEFAULT_JVM_OPTIONS = ("-XX:+UseG1GC", "-XX:MaxGCPauseMillis=20")
#: The client JIT only and the serial collector: about half the CPU of the default for a broker
#: that lives minutes (start-up, short bursts; RELIABILITY.md, "Test suite time"), but slower
#: once hot, so not for benchmarks or long runs.
LEAN_JVM_OPTIONS = "-XX:TieredStopAtLevel=1 -XX:+UseSerialGC"


def java_command(lib_dir: Path, main: str, *args: str, heap: str, logs_dir: Path) -> list[str]:
    """The command line that runs Kafka's ``main`` class from the jars in ``lib_dir`` with
    ``args``: at most ``heap`` of heap, G1 with short pauses (or the options of
    ``TRAJBUS_KAFKA_JVM_OPTIONS``), exit on OutOfMemoryError, Kafka's own log (log4j2,
    ``infra/kafka/log4j2.yaml``) under ``logs_dir``."""
    tuning = os.environ.get(JVM_OPTIONS_ENV, "").split() or list(DEFAULT_JVM_OPTIONS)
    return [
        require_java(),
        f"-Xmx{heap}",
        "-Xms128m",
        *tuning,
        "-XX:+ExitOnOutOfMemoryError",
        "-Djava.awt.headless=true",
        f"-Dlog4j2.configurationFile={LOG4J_CONFIG}",
        f"-Dkafka.logs.dir={logs_dir}",
        "-cp",
        f"{lib_dir}/*",
        main,
        *args,
    ]
