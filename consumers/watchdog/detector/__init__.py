"""The watchdog core's rooms, one concern each: :mod:`.outputs` (alerts, decisions, dead
letters, ids), :mod:`.rules` (a task's thresholds), :mod:`.stream` (one stream's state and its
changelog form), :mod:`.inputs` (reading and diagnosing input records), :mod:`.loops` (the
loop and stall alerts over a stream), :mod:`.timers` (time per log and the timers),
:mod:`.tracking` (opening, ending and loading streams), :mod:`.explain` and :mod:`.machine`
(the detector: the tool events' hot path, over those parts). Import from
:mod:`trajbus.consumers.watchdog.core`."""
