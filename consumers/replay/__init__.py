"""Ordered episode replay for trainers.

:mod:`.core` is the pure reorder core (shuffled, duplicated events in; ordered, deduplicated
segments with explicit gap markers out). The trainers' client: :mod:`.client`
(``ReplayClient``: subscription, reading, flow control, acknowledgements and commits),
:mod:`.sync` (``SyncReplayClient``, the blocking wrapper), :mod:`.items` (``Segment``,
``Episode``), :mod:`.progress` (what a partition's commit may pass), :mod:`.rebalance`
(what a member commits and keeps when partitions move), :mod:`.notices` and
:mod:`.ratelimit` (what it logs about waits and outages).
"""
