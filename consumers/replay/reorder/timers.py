"""Timer kinds of the reorder core's timer queue (ordered: at one deadline a recycle fires
before an idle timeout, and so on) and the deadline that never comes."""

from __future__ import annotations

NEVER = 2**63 - 1
TIMER_RECYCLE = 0
TIMER_IDLE = 1
TIMER_TOMBSTONE = 2
TIMER_SANDBOX = 3
TIMER_HELD = 4
