"""Group commit of journal syncs: the emitters of one process share their fdatasync rounds.

(The emitters now send through :mod:`trajbus.producers.sender`, whose rounds sync every
journal of a round in one thread hand-off the same way; this stays for code that syncs on its
own.) Every emitter with ``durability="fsync"`` syncs its journal before it sends what it
appended.
Done one by one, 1,000 emitters on a node cost 1,000 thread hand-offs a second, each waiting
behind the others in the default thread pool. :class:`GroupSync` runs one *round* at a time
per event loop: the emitters that ask while a round runs wait for the next one, which syncs all
of their journals in one thread hand-off.

Guarantee (the one the emitter relies on, "durable before sent"): :meth:`GroupSync.sync`
returns only after an ``fdatasync`` of the caller's fd that *started after the call*, so
every byte written to the fd before the call is on disk. A failed sync raises its ``OSError``
to that caller only.
"""

from __future__ import annotations

import asyncio
import os
import weakref
from collections.abc import Callable

SyncFn = Callable[[int], None]


class GroupSync:
    """Coalesces ``fdatasync`` calls of one event loop into rounds, one round at a time."""

    def __init__(self, sync_fn: SyncFn = os.fdatasync) -> None:
        self._sync_fn = sync_fn
        self._next: list[tuple[int, asyncio.Future[None]]] = []
        self._running = False
        self.rounds = 0  # rounds run (for tests and metrics)
        self.syncs = 0  # sync calls served

    async def sync(self, fd: int) -> None:
        """Return once an fdatasync of ``fd`` that started after this call has succeeded."""
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._next.append((fd, fut))
        if not self._running:
            self._running = True
            asyncio.get_running_loop().create_task(self._rounds())
        await fut

    async def _rounds(self) -> None:
        try:
            while self._next:
                batch, self._next = self._next, []
                # callers registered before this point only: later ones wait for the next round
                errors = await asyncio.to_thread(self._sync_all, [fd for fd, _ in batch])
                self.rounds += 1
                self.syncs += len(batch)
                for (_, fut), exc in zip(batch, errors, strict=True):
                    if fut.done():
                        continue  # the caller was cancelled
                    if exc is None:
                        fut.set_result(None)
                    else:
                        fut.set_exception(exc)
        finally:
            self._running = False
            if self._next:  # registered while this task was being cancelled or failing
                for _, fut in self._next:
                    if not fut.done():
                        fut.set_exception(OSError("journal sync round ended"))
                self._next = []

    def _sync_all(self, fds: list[int]) -> list[OSError | None]:
        out: list[OSError | None] = []
        synced: dict[int, OSError | None] = {}
        for fd in fds:
            if fd not in synced:
                try:
                    self._sync_fn(fd)
                    synced[fd] = None
                except OSError as exc:
                    synced[fd] = exc
            out.append(synced[fd])
        return out


_by_loop: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, GroupSync] = (
    weakref.WeakKeyDictionary())


def group_sync() -> GroupSync:
    """The running event loop's shared :class:`GroupSync` (created on first use)."""
    loop = asyncio.get_running_loop()
    gs = _by_loop.get(loop)
    if gs is None:
        gs = _by_loop[loop] = GroupSync()
    return gs
