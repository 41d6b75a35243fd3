"""The scheduler: sandbox lifecycle, leases, liveness, drain-before-recycle, placement with
data affinity and tenant credit.

:mod:`.core` is the pure, deterministic decision maker (same inputs, same decisions, byte for
byte), a façade over one module per concern: :mod:`.lifecycle` (what sandboxes report),
:mod:`.drain` (drain before recycle), :mod:`.admission` (requests, tenant credit, queues),
:mod:`.persistence` (changelog records), over :mod:`.base` (shared fields, decisions, deadlines),
:mod:`.state` (state records) and :mod:`.outputs` (decisions, dead letters). :mod:`.placement`
holds node state and best-fit placement (pure, no I/O, no clock).
"""
