"""The replay reorder core's rooms, one concern each: :mod:`.events` (input, outputs, ids),
:mod:`.episode` (one episode's state and content history), :mod:`.codec` (the changelog
format), :mod:`.persistence` (the state as changelog records, out and in), :mod:`.admission`
(held admission for the per-sandbox limit), :mod:`.emission` (segments, gaps, closing),
:mod:`.timers` (deadlines), :mod:`.steps` (the shared transition steps) and :mod:`.machine`
(the state machine: its fast paths and full transition, over those parts). Import from
:mod:`trajbus.consumers.replay.core`."""
