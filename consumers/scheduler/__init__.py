"""The scheduler: sandbox lifecycle, leases, liveness, drain-before-recycle, placement with
data affinity and tenant credit.

:mod:`.core` is the pure, deterministic decision maker (same inputs, same decisions, byte for
byte); :mod:`.placement` holds node state and best-fit placement (pure, no I/O, no clock).
"""
