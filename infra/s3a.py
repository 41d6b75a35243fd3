"""The jars Spark needs to read ``s3a://`` paths, fetched from Maven Central on demand.

PySpark ships Hadoop's client (``hadoop-client-api``/``-runtime``) but not ``hadoop-aws``, which
holds ``S3AFileSystem``, nor the AWS SDK v2 it calls. ``infra/spark/pom.xml`` names
``hadoop-aws`` at PySpark's Hadoop version and only the SDK modules S3A loads (not the SDK's
all-services ``bundle`` jar that ``hadoop-aws`` declares); :func:`ensure_s3a_jars` copies them
into ``infra/spark/lib/`` (git-ignored) with Maven, once::

    from pyspark.sql import SparkSession
    from trajbus.infra.s3a import s3a_jars

    spark = SparkSession.builder.config("spark.jars", ",".join(s3a_jars())).getOrCreate()

``spark.jars`` is read when the session's JVM starts: set it on the first session of a
process. ``make spark-jars`` (``python -m trajbus.infra.s3a``) fetches them and prints their
directory. On a machine without Maven, give ``spark.jars`` the jars the pom names, fetched
elsewhere.
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

from trajbus.infra.kafka_runtime import KafkaSetupError, require_java
from trajbus.infra.maven import JarSet, fetch_jars

__all__ = ["POM_PATH", "S3A_LIB_DIR", "S3ASetupError", "ensure_s3a_jars", "hadoop_version",
           "s3a_jars", "spark_hadoop_version"]

POM_PATH = Path(__file__).resolve().parent / "spark" / "pom.xml"
S3A_LIB_DIR = POM_PATH.parent / "lib"
_MARKER = "hadoop-aws-*.jar"


class S3ASetupError(RuntimeError):
    """Java or Maven is missing, or the jars could not be fetched."""


def hadoop_version(pom: Path = POM_PATH) -> str:
    """The ``hadoop-aws`` version pinned in ``infra/spark/pom.xml`` (PySpark's Hadoop)."""
    return _s3a_jars(pom).version()


def _s3a_jars(pom: Path = POM_PATH) -> JarSet:
    return JarSet(pom, "hadoop.version", _MARKER,
                  "hadoop-aws {version} and the AWS SDK modules S3A needs", S3ASetupError)


def ensure_s3a_jars(lib_dir: Path | None = None, *, force: bool = False,
                    quiet: bool = False) -> Path:
    """Return a directory holding ``hadoop-aws`` and the AWS SDK modules S3A needs.

    The jars live in ``lib_dir`` (default ``infra/spark/lib/``) and are (re)fetched with
    ``mvn -f infra/spark/pom.xml`` when missing, when the pom changed since the last fetch (a
    stamp records its hash) or when ``force`` is set; Maven caches downloads in ``~/.m2``.
    Concurrent callers serialize on a file lock. Raises :class:`S3ASetupError` when Java or
    Maven is missing or the fetch fails.
    """

    def mvn() -> str:
        exe = shutil.which("mvn")
        if exe is None:
            raise S3ASetupError(
                "`mvn` not found on PATH: Maven fetches hadoop-aws and the AWS SDK for Spark's "
                "s3a:// from Maven Central (Debian/Ubuntu: `apt-get install maven`), or give "
                "Spark (spark.jars) the jars infra/spark/pom.xml names, fetched elsewhere.")
        try:
            require_java()
        except KafkaSetupError as exc:
            raise S3ASetupError(str(exc)) from exc
        return exe

    return fetch_jars(_s3a_jars(), Path(lib_dir or S3A_LIB_DIR), mvn=mvn, force=force,
                      quiet=quiet)


def spark_hadoop_version() -> str | None:
    """The Hadoop version the installed PySpark bundles (from its ``hadoop-client-api`` jar),
    or None without PySpark."""
    try:
        import pyspark
    except ImportError:
        return None
    for jar in (Path(pyspark.__file__).parent / "jars").glob("hadoop-client-api-*.jar"):
        return jar.name.removeprefix("hadoop-client-api-").removesuffix(".jar")
    return None


def s3a_jars(lib_dir: Path | None = None) -> list[str]:
    """The jar paths to give Spark (``spark.jars``, comma-joined), fetched if needed.

    Raises :class:`S3ASetupError` when the installed PySpark bundles another Hadoop than the
    ``hadoop-aws`` the pom pins (mixed Hadoop versions fail at the first ``s3a://`` call)."""
    bundled, pinned = spark_hadoop_version(), hadoop_version()
    if bundled is not None and bundled != pinned:
        raise S3ASetupError(
            f"the installed PySpark bundles Hadoop {bundled}, but {POM_PATH} pins hadoop-aws "
            f"{pinned}: set <hadoop.version> to {bundled} and <sdk.version> to the "
            "software.amazon.awssdk:bundle version that hadoop-aws declares, or install a "
            f"PySpark built with Hadoop {pinned}")
    return sorted(str(jar) for jar in ensure_s3a_jars(lib_dir).glob("*.jar"))


def main(argv: list[str] | None = None) -> int:
    """``python -m trajbus.infra.s3a [--force]``: fetch the jars, print their directory."""
    args = sys.argv[1:] if argv is None else argv
    try:
        lib = ensure_s3a_jars(force="--force" in args)
    except S3ASetupError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    jars = list(lib.glob("*.jar"))
    size = sum(j.stat().st_size for j in jars)
    print(f"hadoop-aws {hadoop_version()} and the AWS SDK for s3a://: {len(jars)} jars, "
          f"{size / 1e6:.0f} MB in {lib}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
