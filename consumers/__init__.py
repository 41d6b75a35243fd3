"""trajbus.consumers: everything that reads the event log, one room per role.

* :mod:`~trajbus.consumers.engine` -- the transactional worker (`trajbus worker`) that runs
  the processors: runner, Kafka adapters, metrics.
* :mod:`~trajbus.consumers.replay` -- ordered episode replay: the reorder core and the
  trainers' ``ReplayClient``.
* :mod:`~trajbus.consumers.watchdog` -- loop detection: the watchdog core and canonical JSON.
* :mod:`~trajbus.consumers.scheduler` -- scheduling decisions: the scheduler core and placement.
* :mod:`~trajbus.consumers.operator` -- operators' read-mostly tools and commands (status,
  explain, consume, dead letters, alerts, waterfall).

The ``core`` modules of replay, watchdog and scheduler are pure (no Kafka, no clock, no I/O);
Kafka lives in ``engine``, the replay client (``replay.client`` and its rooms) and
``operator``.
"""
