"""Ordered episode replay for trainers.

:mod:`.core` is the pure reorder core (shuffled, duplicated events in; ordered, deduplicated
segments with explicit gap markers out); :mod:`.client` is the trainers' ``ReplayClient`` /
``SyncReplayClient``, which delivers each episode's events in order, once, and commits only
what the trainer acknowledged.
"""
