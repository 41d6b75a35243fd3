"""The blocking façade over the emitter: :class:`SyncEmitter`, for sandbox runtimes that are
not async. Same arguments and guarantees as :class:`~trajbus.producers.emitter.SandboxEmitter`;
every call runs on one background event loop thread per process (:class:`_LoopThread`), so
the process's synchronous emitters share one producer and one send task like async ones.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Awaitable, Callable, Coroutine
from typing import TYPE_CHECKING, Any, TypeVar

from .emitter_results import DrainReport

if TYPE_CHECKING:
    from .emitter import SandboxEmitter

T = TypeVar("T")


class _LoopThread:
    """One background event loop per process for all SyncEmitters (so they share one
    producer, like async emitters do)."""

    _instance: _LoopThread | None = None
    _lock = threading.Lock()

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="trajbus-emitter",
                                       daemon=True)
        self.thread.start()

    @classmethod
    def get(cls) -> _LoopThread:
        with cls._lock:
            if cls._instance is None:
                cls._instance = cls()
            return cls._instance

    def run(self, coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)


class SyncEmitter:
    """Blocking facade over :class:`SandboxEmitter` for runtimes that are not async. Same
    arguments and guarantees; calls run on a shared background loop thread."""

    def __init__(self, sandbox: str, task: str, **kwargs: Any) -> None:
        from .emitter import SandboxEmitter  # the façade imports this module

        self._lt = _LoopThread.get()

        async def make() -> SandboxEmitter:
            return await SandboxEmitter(sandbox, task, **kwargs).start()

        self.emitter: SandboxEmitter = self._lt.run(make())

    def _call(self, fn: Callable[..., Awaitable[T]], *args: Any, **kwargs: Any) -> T:
        async def go() -> T:
            return await fn(*args, **kwargs)

        return self._lt.run(go())

    def lifecycle(self, *a: Any, **k: Any) -> str:
        return self._call(self.emitter.lifecycle, *a, **k)

    def heartbeat(self, *a: Any, **k: Any) -> str:
        return self._call(self.emitter.heartbeat, *a, **k)

    def liveness(self, *a: Any, **k: Any) -> str:
        return self._call(self.emitter.liveness, *a, **k)

    def start_episode(self, *a: Any, **k: Any) -> str:
        return self._call(self.emitter.start_episode, *a, **k)

    def end_episode(self, *a: Any, **k: Any) -> str:
        return self._call(self.emitter.end_episode, *a, **k)

    def tool_call(self, *a: Any, **k: Any) -> str:
        return self._call(self.emitter.tool_call, *a, **k)

    def tool_result(self, *a: Any, **k: Any) -> str:
        return self._call(self.emitter.tool_result, *a, **k)

    def trace_chunk(self, *a: Any, **k: Any) -> str:
        return self._call(self.emitter.trace_chunk, *a, **k)

    def flush(self, timeout: float | None = None) -> bool:
        return self._call(self.emitter.flush, timeout)

    def drain(self, deadline_s: float | None = None, *, detail: str = "") -> DrainReport:
        return self._call(self.emitter.drain, deadline_s, detail=detail)

    def close(self, timeout: float = 10.0) -> bool:
        return self._call(self.emitter.close, timeout)

    def __enter__(self) -> SyncEmitter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
