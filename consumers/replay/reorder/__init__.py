"""The replay reorder core's rooms, one concern each: :mod:`.events` (input, outputs, ids),
:mod:`.episode` (one episode's state and content history), :mod:`.codec` (the changelog
format), :mod:`.admission` (held admission for the per-sandbox limit), :mod:`.emission`
(segments, gaps, closing), :mod:`.timers` (deadlines) and :mod:`.machine` (the state machine:
the transitions, over those parts). Import from :mod:`trajbus.consumers.replay.core`."""
