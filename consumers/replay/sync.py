"""The blocking trainer client: :class:`SyncReplayClient` runs a :class:`ReplayClient` on an
event loop of its own (a daemon thread) for trainers that are not asyncio programs."""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import sys
import threading
from collections.abc import AsyncGenerator, Callable, Coroutine, Iterable, Iterator
from typing import Any, TypeVar

from trajbus.bus.positions import StartPosition
from trajbus.bus.settings import Settings
from trajbus.consumers.replay.client import (
    DEFAULT_COMMIT_EVERY_MS,
    FLOW_CONTROL_TIMEOUT_S,
    ReplayClient,
)
from trajbus.consumers.replay.items import Episode, Segment
from trajbus.schemas.codec import Codec

log = logging.getLogger("trajbus.consumers.replay.client")

T = TypeVar("T")
_SYNC_CLOSE_TIMEOUT_S = 10.0


class SyncReplayClient:
    """Blocking wrapper for trainers that are not asyncio programs: the same arguments and
    methods as :class:`ReplayClient`, run on an event loop of its own (a daemon thread)."""

    def __init__(
        self,
        tasks: Iterable[str] | str,
        group_id: str,
        settings: Settings | None = None,
        *,
        task_pattern: str | None = None,
        start: StartPosition = "resume",
        max_in_flight: int = 256,
        drop_truncated: bool = False,
        drop_gappy: bool = False,
        max_staleness: int | None = None,
        current_policy_version: Callable[[], int] | None = None,
        codec: Codec | None = None,
        commit_every_ms: float = DEFAULT_COMMIT_EVERY_MS,
        flow_control_timeout_s: float | None = FLOW_CONTROL_TIMEOUT_S,
        group_instance_id: str | None = None,
    ) -> None:
        """See :class:`ReplayClient` (the same parameters, checked by a test)."""
        kwargs: dict[str, Any] = dict(
            task_pattern=task_pattern, start=start, max_in_flight=max_in_flight,
            drop_truncated=drop_truncated, drop_gappy=drop_gappy, max_staleness=max_staleness,
            current_policy_version=current_policy_version, codec=codec,
            commit_every_ms=commit_every_ms, flow_control_timeout_s=flow_control_timeout_s,
            group_instance_id=group_instance_id)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True,
                                        name=f"replay-client-{group_id}")
        self._thread.start()
        try:
            self._client: ReplayClient = self._run(
                _build((tasks, group_id, settings), kwargs))
            self._run(self._client.start())
        except BaseException:  # a refused argument, no broker: no thread left behind
            self._stop_loop()
            raise

    def _run(self, coro: Coroutine[Any, Any, T]) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    def segments(self, idle_timeout: float | None = None) -> Iterator[Segment]:
        """See :meth:`ReplayClient.segments`; leaving the loop early loses nothing."""
        return self._iterate(self._client.segments(idle_timeout))

    def episodes(self, idle_timeout: float | None = None) -> Iterator[Episode]:
        """See :meth:`ReplayClient.episodes`; leaving the loop early loses nothing."""
        return self._iterate(self._client.episodes(idle_timeout))

    def _iterate(self, agen: AsyncGenerator[T, None]) -> Iterator[T]:
        try:
            while True:
                step = asyncio.run_coroutine_threadsafe(agen.__anext__(), self._loop)
                try:
                    item = step.result()
                except StopAsyncIteration:
                    return
                except BaseException:  # Ctrl-C while waiting: the step must not run on
                    step.cancel()  # and hand out a segment nobody receives
                    raise
                yield item
        finally:  # a loop left early: what was read and not handed out is read again
            self._close_iterator(agen)

    def _close_iterator(self, agen: AsyncGenerator[Any, None]) -> None:
        """Close ``agen`` on the client's loop and wait (a bounded time) for it. Not from the
        loop's own thread (a garbage collection may finalize an iterator there) nor while the
        interpreter shuts down (the loop's daemon thread no longer runs): the next iterator
        releases what this one held anyway."""
        if (sys.is_finalizing() or not self._thread.is_alive()
                or threading.current_thread() is self._thread):
            return

        async def close() -> None:
            while getattr(agen, "ag_running", False):  # a step being cancelled (Ctrl-C) ends
                await asyncio.sleep(0.01)
            await agen.aclose()

        done = asyncio.run_coroutine_threadsafe(close(), self._loop)
        try:
            done.result(timeout=_SYNC_CLOSE_TIMEOUT_S)
        except Exception as exc:  # never raised out of the finally it runs in
            done.cancel()
            log.warning("replay client: an iterator could not be closed (%s: %s); the next "
                        "one reads again what it held", type(exc).__name__, exc)

    def ack(self, item: Segment | Episode) -> bool:
        """See :meth:`ReplayClient.ack`: False when the item's partition went to another
        member since it was handed out (that member delivers it again)."""
        result: bool = self._run(self._client.ack(item))
        return result

    def commit(self) -> None:
        """Commit every acknowledgement made so far; returns once the broker has it (before a
        checkpoint, say). See :meth:`ReplayClient.commit`."""
        self._run(self._client.commit())

    def list_tasks(self, include_debug: bool = False) -> list[str]:
        """See :meth:`ReplayClient.list_tasks`."""
        return self._run(self._client.list_tasks(include_debug))

    def missing_tasks(self) -> list[str]:
        """See :meth:`ReplayClient.missing_tasks`."""
        return self._run(self._client.missing_tasks())

    @property
    def stats(self) -> dict[str, int]:
        """See ``ReplayClient.stats``."""
        return self._client.stats

    def close(self) -> None:
        """Stop the client (its last commit, bounded) and its thread. Never raises but the
        caller's own interruption (Ctrl-C); safe to call twice."""
        if not self._thread.is_alive():
            return
        try:
            self._run(self._client.stop())
        except (Exception, concurrent.futures.CancelledError) as exc:  # stop() logs its own
            log.warning("replay client %s: stop failed (%s: %s)", self._client.group_id,
                        type(exc).__name__, exc)
        finally:
            self._stop_loop()

    def _stop_loop(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=5)

    def __enter__(self) -> SyncReplayClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


async def _build(args: tuple[Any, ...], kwargs: dict[str, Any]) -> ReplayClient:
    return ReplayClient(*args, **kwargs)  # built on the client's loop (asyncio.Event binding)
