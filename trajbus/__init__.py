"""trajbus: the trajectory data bus for agentic-RL sandbox fleets.

The public API, importable from the top (``from trajbus import ReplayClient``); the deep
paths (``trajbus.consumers.replay.client``) keep working. Names load on first use, so
``import trajbus`` (and the CLI's start-up) stays cheap.

- trainers: :class:`ReplayClient` (async), :class:`SyncReplayClient`, their
  :class:`Segment` / :class:`Episode`, :class:`FlowControlError`, :func:`list_tasks`;
- sandbox runtimes: :class:`SandboxEmitter` and its :class:`DrainReport`;
- the data team: :class:`ArchiveReader` (SQL over the Parquet archive);
- everyone: :class:`Settings` / :func:`get_settings` (``TRAJBUS_*`` environment variables).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

_EXPORTS = {
    "ReplayClient": "trajbus.consumers.replay.client",
    "SyncReplayClient": "trajbus.consumers.replay.client",
    "Segment": "trajbus.consumers.replay.client",
    "Episode": "trajbus.consumers.replay.client",
    "FlowControlError": "trajbus.consumers.replay.client",
    "list_tasks": "trajbus.consumers.replay.client",
    "SandboxEmitter": "trajbus.producers.emitter",
    "DrainReport": "trajbus.producers.emitter",
    "ArchiveReader": "trajbus.archive.query",
    "Settings": "trajbus.bus.settings",
    "get_settings": "trajbus.bus.settings",
}

__all__ = [
    "ArchiveReader", "DrainReport", "Episode", "FlowControlError", "ReplayClient",
    "SandboxEmitter", "Segment", "Settings", "SyncReplayClient", "__version__", "get_settings",
    "list_tasks",
]

if TYPE_CHECKING:
    from trajbus.archive.query import ArchiveReader
    from trajbus.bus.settings import Settings, get_settings
    from trajbus.consumers.replay.client import (
        Episode,
        FlowControlError,
        ReplayClient,
        Segment,
        SyncReplayClient,
        list_tasks,
    )
    from trajbus.producers.emitter import DrainReport, SandboxEmitter


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'trajbus' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # once loaded, a plain attribute
    return value


def __dir__() -> list[str]:
    return sorted(__all__)
