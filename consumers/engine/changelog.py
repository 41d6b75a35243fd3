"""The configuration of a processor's state changelog topic (compacted, one partition per
core slot), chosen so a restore reads little more than the live keys."""

from __future__ import annotations

# A restore reads the whole changelog partition: the compacted part (the live keys, and the
# tombstones of deleted keys, kept delete.retention.ms after the cleaner first reached them),
# the closed segments the cleaner has not reached yet, and the active segment, which Kafka never
# compacts. With Kafka's defaults (1 GiB / 7 days segments, tombstones a day) a restore after
# hours of history reads millions of records, most of them superseded. So: segments as small as
# the largest record batch allows (changelog_configs raises SEGMENT_FLOOR_BYTES to that batch
# plus 1 MiB: a batch must fit in a segment, and a state record may be as large as the topic's
# max.message.bytes; ~10 MiB with the default 8 MiB records), rolled at the latest after 10
# minutes, cleaned once 10% is dirty (with a compacted part this small, any closed segment is)
# and at most 15 minutes after a write; tombstones go 3 minutes after their first cleaning,
# far longer than a restore under load takes, so a restore never misses a delete
# (docs/decisions/0017-changelog-segments-and-tombstones.md has the measurements). Existing
# changelogs keep the configs they were created with (ensure_topics does not alter them):
# `kafka-configs --alter` to apply these.
SEGMENT_FLOOR_BYTES = 4 * 1024 * 1024
CHANGELOG_CONFIGS = {
    "segment.ms": str(10 * 60_000),
    "segment.bytes": str(SEGMENT_FLOOR_BYTES),
    "min.cleanable.dirty.ratio": "0.1",
    "max.compaction.lag.ms": str(15 * 60_000),
    "delete.retention.ms": str(3 * 60_000),
}


def changelog_configs(max_batch_bytes: int) -> dict[str, str]:
    """:data:`CHANGELOG_CONFIGS`, with segments large enough for the largest record batch the
    runner may write (the broker refuses a batch larger than a segment)."""
    seg = max(int(CHANGELOG_CONFIGS["segment.bytes"]), max_batch_bytes + 1024 * 1024)
    return {**CHANGELOG_CONFIGS, "segment.bytes": str(seg)}

