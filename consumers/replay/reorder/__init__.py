"""The replay reorder core's rooms, one concern each: :mod:`.events` (input, outputs, ids),
:mod:`.episode` (one episode's state and content history), :mod:`.codec` (the changelog
format), :mod:`.admission` (held admission for the per-sandbox limit), :mod:`.timers` and
:mod:`.machine` (the state machine). Import from :mod:`trajbus.consumers.replay.core`."""
