"""The stream-processing engine: the transactional worker that runs the pure cores on Kafka
(``trajbus worker``).

:mod:`.runner` feeds a core through its adapter in :mod:`.processors` and commits each batch's
outputs, state changelog and input offsets in one Kafka transaction, so a worker killed at any
point resumes with nothing lost and nothing twice. The runner is a façade over one module per
concern (:mod:`.restore`, :mod:`.transactions`, :mod:`.idle_commit`, :mod:`.ordering`,
:mod:`.ticker`, :mod:`.assignors`; the records in :mod:`.records`). :mod:`.metrics` exports
Prometheus metrics and :mod:`.cli` holds ``trajbus worker`` and ``trajbus replay tail``.
"""
