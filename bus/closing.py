"""The one way trajbus stops a Kafka client: bounded, never a traceback, nothing left open.

Guarantee of :func:`close_client`: it returns once the client's connections are closed, or
after ``timeout`` seconds, and it raises nothing but the caller's own cancellation. What went
wrong is logged at WARNING (a broker that is away, a close that hung); the known aiokafka bug
below at DEBUG, since it is no fault of anyone's.

Why a guard is needed (aiokafka 0.12-0.14, upstream issue aio-libs/aiokafka#647, open since
2020): ``AIOKafkaConsumer.stop()`` raises :class:`asyncio.CancelledError` when a fetch task is
pending at that moment -- on a cluster that is the normal case while a node is down, since the
fetch to that node sits in its retry back-off. ``Fetcher.close`` cancels each pending fetch
and awaits it without suppressing the cancellation, so ``stop()`` ends there: the client's
connections are never closed (a file-descriptor leak per try), and a caller that does not
expect a ``CancelledError`` from a call it did not cancel ends in a traceback (or, worse,
mistakes it for its own cancellation). :func:`close_client` tells the two apart -- the
caller's task is not being cancelled, the stop task ended cancelled -- and finishes the close
that aiokafka left half done.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any

log = logging.getLogger("trajbus.kafka")

#: How long a close may take before it is given up (a producer flushing to a broker that is
#: away, a consumer leaving a group whose coordinator is down).
CLOSE_TIMEOUT_S = 15.0


def _retrieve(task: asyncio.Future[Any]) -> None:
    """Mark a left-behind task's outcome as seen ("exception was never retrieved" otherwise)."""
    if not task.cancelled():
        task.exception()


async def _finish_aiokafka_close(client: Any) -> None:
    """Do what aiokafka's ``stop()`` skipped after the cancelled fetch it awaited: cancel the
    fetcher's other pending requests and close the connections."""
    fetcher = getattr(client, "_fetcher", None)
    pending = list(getattr(fetcher, "_pending_tasks", ()) or ())
    for task in pending:
        task.cancel()
    if pending:
        await asyncio.gather(*pending, return_exceptions=True)
    connections = getattr(client, "_client", None) or getattr(client, "client", None)
    close = getattr(connections, "close", None)
    if close is not None:
        with contextlib.suppress(Exception):
            await close()


async def close_client(client: Any, what: str = "Kafka client", *,
                       timeout: float = CLOSE_TIMEOUT_S) -> bool:
    """Stop an aiokafka consumer or producer (``stop()``) or admin client (``close()``).

    Returns True if it closed cleanly, False if it closed with an error or was given up after
    ``timeout`` (both logged). Never raises, except :class:`asyncio.CancelledError` when the
    *caller* is cancelled (then the close goes on in the background, its outcome retrieved).
    Safe to call on a client that never started or is already closed.
    """
    if client is None:
        return True
    stop = getattr(client, "stop", None) or client.close
    task: asyncio.Future[Any] = asyncio.ensure_future(stop())
    try:
        # not wait_for: it would wait for a cancelled stop() to end, and aiokafka's stop can go
        # on waiting for the broker after a cancel (a producer's flush, an open transaction)
        await asyncio.wait({task}, timeout=timeout)
    except asyncio.CancelledError:
        task.add_done_callback(_retrieve)
        raise
    if not task.done():
        task.cancel()
        task.add_done_callback(_retrieve)
        with contextlib.suppress(Exception):
            await asyncio.wait_for(_finish_aiokafka_close(client), timeout=2.0)
        log.warning("%s did not close within %.0f s (is the broker away?); its connections "
                    "were closed without it", what, timeout)
        return False
    if task.cancelled():
        # aio-libs/aiokafka#647: a pending fetch was cancelled under stop(); not our caller
        log.debug("%s: aiokafka's stop() ended on a cancelled fetch (aiokafka#647); "
                  "finishing the close", what)
        await _finish_aiokafka_close(client)
        return True
    exc = task.exception()
    if exc is not None:
        log.warning("%s did not close cleanly (%s: %s)", what, type(exc).__name__, exc)
        with contextlib.suppress(Exception):
            await asyncio.wait_for(_finish_aiokafka_close(client), timeout=2.0)
        return False
    return True
