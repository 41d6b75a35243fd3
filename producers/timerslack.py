"""The calling thread's Linux timer slack (``prctl(PR_SET_TIMERSLACK)``), for the shared sender.

A thread's timer slack is how late the kernel may end its timed sleeps -- including the
timeout of ``epoll_wait`` that an asyncio loop sleeps in until its next timer -- so that
wake-ups due close together happen as one (prctl(2), "PR_SET_TIMERSLACK"; the default is
50 us). An event loop hosting 1,000 emitters whose callers each wake once a second on a timer
then wakes tens of times a second instead of ~1,000 and runs each batch of due callbacks
together, at a fraction of the CPU (docs/decisions/0006-timer-slack.md). Readiness of a socket or
pipe still wakes the loop at once: only timed waits are made later, by at most the slack --
every timed wait of that thread (its ``time.sleep``, lock and queue timeouts too), and of
threads it starts meanwhile: a new thread inherits its creator's current slack (prctl(2)),
the loop's default executor's workers included.

Linux only; elsewhere (or if the call is refused) the functions report that nothing was done.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable

from trajbus.producers.libc import libc_function

__all__ = ["get_timer_slack_ns", "set_timer_slack_ns"]

_PR_SET_TIMERSLACK = 29
_PR_GET_TIMERSLACK = 30
_MAX_NS = 1 << 31  # PR_GET_TIMERSLACK returns it as an int: larger values would read back wrong


_prctl: Callable[..., int] | None = libc_function("prctl")


def get_timer_slack_ns() -> int | None:
    """The calling thread's current timer slack in ns, or None where it cannot be read."""
    if _prctl is None:
        return None
    value = _prctl(_PR_GET_TIMERSLACK, 0, 0, 0, 0)
    return None if value < 0 else int(value)


def set_timer_slack_ns(ns: int) -> bool:
    """Set the calling thread's timer slack to ``ns`` (> 0; 0 would mean "the thread's
    default"). Returns whether it is now in effect (read back: a real-time thread's slack is
    accepted and ignored)."""
    if _prctl is None or not 0 < ns < _MAX_NS:
        return False
    if _prctl(_PR_SET_TIMERSLACK, ctypes.c_ulong(ns), 0, 0, 0) != 0:
        return False
    return get_timer_slack_ns() == ns
