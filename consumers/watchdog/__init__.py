"""The watchdog: catch looping agents in the tool-call stream, leave progressing agents alone.

:mod:`.core` is the pure, deterministic loop detector (alerts and terminate decisions, no
clock, no I/O); :mod:`.canonical` is the canonical JSON that makes equal tool calls hash
equal -- a contract shared with the emitter, which fills the events' hashes with it.
"""
