"""Jars from Maven Central, fetched once per pom into a directory of the repository.

One pom per set of jars (``infra/kafka/pom.xml``: the broker; ``infra/spark/pom.xml``:
Spark's ``s3a://``). :func:`fetch_jars` guarantees:

- **Fetched once.** A stamp file in the directory records the pinned version and the pom's
  sha256; the jars are fetched again only when it no longer matches (or ``force``).
- **Never half there.** Maven writes into a staging directory; the jars replace the old ones
  only after the fetch succeeded and the marker jar is among them; the stamp comes last.
- **One fetch at a time.** Concurrent callers (pytest workers, a CLI) serialize on a file lock
  and the later ones find the jars fresh.
- **Errors that say what to do**, raised as the caller's error class.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

STAMP_NAME = ".trajbus-jars.stamp"


@dataclass(frozen=True)
class JarSet:
    """What one pom fetches: ``version_property`` (the pom property the stamp records, e.g.
    ``kafka.version``), ``marker`` (a glob one of its jars matches: the fetch worked),
    ``what`` (for messages; ``{version}`` is replaced) and ``error`` (the error class
    raised)."""

    pom: Path
    version_property: str
    marker: str
    what: str
    error: type[Exception]

    def version(self) -> str:
        """The version the pom pins (its ``version_property``)."""
        prop = re.escape(self.version_property)
        match = re.search(rf"<{prop}>\s*([^<\s]+)\s*</{prop}>", self.pom.read_text())
        if not match:
            raise self.error(f"no <{self.version_property}> property in {self.pom}")
        return match.group(1)

    def stamp(self) -> str:
        digest = hashlib.sha256(self.pom.read_bytes()).hexdigest()
        return f"{self.version_property}={self.version()}\npom.sha256={digest}\n"

    def fresh(self, lib_dir: Path) -> bool:
        """The jars in ``lib_dir`` are this pom's, complete."""
        try:
            return ((lib_dir / STAMP_NAME).read_text() == self.stamp()
                    and any(lib_dir.glob(self.marker)))
        except OSError:
            return False


@contextlib.contextmanager
def file_lock(path: Path) -> Iterator[None]:
    """An exclusive lock on ``path`` (created) for the ``with`` block, across processes."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def fetch_jars(jars: JarSet, lib_dir: Path, *, mvn: Callable[[], str],
               force: bool = False, quiet: bool = False) -> Path:
    """``lib_dir`` holding ``jars``, fetched with ``mvn -f <pom> package`` if they are not
    fresh (see the module docstring). ``mvn`` returns the Maven executable after checking
    the tools it needs (raising the caller's error with what to install)."""
    lib_dir = lib_dir.resolve()
    if not force and jars.fresh(lib_dir):
        return lib_dir
    with file_lock(lib_dir / ".fetch.lock"):
        if not force and jars.fresh(lib_dir):  # another process just fetched
            return lib_dir
        exe = mvn()
        staging = lib_dir / f".staging-{os.getpid()}"
        shutil.rmtree(staging, ignore_errors=True)
        what = jars.what.format(version=jars.version())
        if not quiet:
            print(f"fetching {what} from Maven Central (first run only)...", file=sys.stderr,
                  flush=True)
        started = time.monotonic()
        cmd = [exe, "-q", "-B", "-f", str(jars.pom), f"-DoutputDirectory={staging}", "package"]
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
            if proc.returncode != 0 or not any(staging.glob(jars.marker)):
                tail = "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-40:])
                raise jars.error(
                    f"fetching {what} failed (exit {proc.returncode}): {' '.join(cmd)}\n"
                    f"{tail}\n(is Maven Central reachable? proxies go in ~/.m2/settings.xml)")
            (lib_dir / STAMP_NAME).unlink(missing_ok=True)  # not fresh until the stamp is back
            for old in lib_dir.glob("*.jar"):
                old.unlink()
            for jar in staging.glob("*.jar"):
                jar.replace(lib_dir / jar.name)
            (lib_dir / STAMP_NAME).write_text(jars.stamp())
        finally:
            shutil.rmtree(staging, ignore_errors=True)
        if not quiet:
            print(f"fetched {what} into {lib_dir} in {time.monotonic() - started:.0f} s",
                  file=sys.stderr, flush=True)
    return lib_dir
