"""A broker for a benchmark and its files: the given bootstrap or a local broker of its own
for the run (``broker_for``), a partition's segment files and the log cleaner's checkpoint."""

from __future__ import annotations

import contextlib
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path


@contextlib.contextmanager
def broker_for(bootstrap: str | None, name: str) -> Iterator[str]:
    """``bootstrap`` as it is, or (None) the bootstrap of a LocalBroker (free ports, a
    temporary data directory ``<name>-kafka-*``) started for the block and removed after."""
    if bootstrap is not None:
        yield bootstrap
        return
    from trajbus.infra.broker import LocalBroker, free_port

    broker_dir = Path(tempfile.mkdtemp(prefix=f"{name}-kafka-"))
    broker = LocalBroker(data_dir=broker_dir, port=free_port(), controller_port=free_port())
    try:
        broker.start(timeout=120)
        yield broker.bootstrap
    finally:
        broker.stop(timeout=30)
        shutil.rmtree(broker_dir, ignore_errors=True)


def segments(log_dir: Path, topic: str, partition: int) -> list[tuple[int, int]]:
    """(base offset, bytes) of each segment file of a partition, in order."""
    d = log_dir / f"{topic}-{partition}"
    out = []
    for f in d.glob("*.log"):
        try:
            out.append((int(f.stem), f.stat().st_size))
        except (OSError, ValueError):
            continue
    return sorted(out)


def cleaner_checkpoint(log_dir: Path, topic: str) -> dict[int, int]:
    """The log cleaner's cleaned-up-to offset per partition of ``topic``."""
    out: dict[int, int] = {}
    try:
        lines = (log_dir / "cleaner-offset-checkpoint").read_text().splitlines()
    except OSError:
        return out
    for line in lines[2:]:
        parts = line.split()
        if len(parts) == 3 and parts[0] == topic:
            out[int(parts[1])] = int(parts[2])
    return out
