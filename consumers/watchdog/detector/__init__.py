"""The watchdog core's rooms, one concern each: :mod:`.outputs` (alerts, decisions, dead
letters, ids), :mod:`.rules` (a task's thresholds), :mod:`.stream` (one stream's state and its
changelog form), :mod:`.inputs` (reading and diagnosing input records), :mod:`.loops` (the
loop and stall alerts over a stream), :mod:`.explain` and :mod:`.machine` (the detector).
Import from :mod:`trajbus.consumers.watchdog.core`."""
