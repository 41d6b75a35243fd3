"""Ordered episode replay for trainers.

:mod:`.core` is the pure reorder core (shuffled, duplicated events in; ordered, deduplicated
segments with explicit gap markers out). The trainers' client: :mod:`.client`
(``ReplayClient``, a façade composed of one mixin per concern over :mod:`.state`:
:mod:`.lifecycle`, :mod:`.iteration`, :mod:`.fetching` (reading, flow control),
:mod:`.decoding`, :mod:`.acks` (acknowledgements), :mod:`.commits`, :mod:`.positions` (start
positions); :mod:`.config`: subscription and options), :mod:`.sync` (``SyncReplayClient``,
the blocking wrapper), :mod:`.items` (``Segment``, ``Episode``), :mod:`.progress` (what a
partition's commit may pass), :mod:`.rebalance` (what a member commits and keeps when
partitions move), :mod:`.notices` and :mod:`.ratelimit` (what it logs about waits and
outages).
"""
