"""What keeps a group of trainers exactly-once, without a broker (issue 41, item 2; the broker
drill is tests/kafka/test_trainer_group.py): an episode says whether it is whole; the commit point
never passes the first segment of an episode not acknowledged; what is acknowledged beyond it
travels in the commit's metadata -- compactly enough for thousands of interleaved live
segments -- so the partition's next owner skips it; an acknowledgement made after the
partition went to another member is void."""

from __future__ import annotations

import asyncio
import json
import random

import pytest
from aiokafka import TopicPartition
from aiokafka.structs import OffsetAndMetadata

from trajbus.consumers.replay.client import (
    Episode,
    ReplayClient,
    Segment,
    _PartitionProgress,
    _StartAt,
    encode_acked_beyond,
    fragment_reason,
    parse_acked_beyond,
)

TP = TopicPartition("p.replay.t", 0)


def seg(index: int, first: int, last: int, *, is_last: bool = False, offset: int = 0,
        gap: tuple[int, int] | None = None, tenure: int = 0) -> Segment:
    events: list = [object()] * (last - first + 1)  # stand-ins: only their number counts
    return Segment(task="t", sandbox="sb", episode="ep", index=index, first_seq=first,
                   last_seq=last, events=events, gap=gap, is_first=index == 0,
                   is_last=is_last, is_terminal=is_last, topic=TP.topic,
                   partition=TP.partition, offset=offset, _tenure=tenure)


def episode(*segments: Segment) -> Episode:
    return Episode("t", "sb", "ep", segments=list(segments), is_terminal=segments[-1].is_terminal)


# -- Episode.complete ------------------------------------------------------------------------
def test_an_episode_from_its_first_segment_to_its_last_is_complete() -> None:
    ep = episode(seg(0, 0, 0), seg(1, 1, 3), seg(2, 4, 4, is_last=True))
    assert ep.complete and ep.fragment_reason is None


def test_declared_gaps_do_not_make_a_fragment() -> None:
    """Events the reorder engine declared lost are the episode's content (``gaps``); every
    segment is there, so it is complete."""
    ep = episode(seg(0, 0, 1), seg(1, 5, 6, gap=(2, 4), is_last=True))
    assert ep.complete
    one_gap_marker = Segment(task="t", sandbox="sb", episode="ep", index=1, first_seq=2,
                             last_seq=1, events=[], gap=(2, 9), is_first=False, is_last=True,
                             is_terminal=False, topic=TP.topic, partition=0, offset=0)
    assert episode(seg(0, 0, 1), one_gap_marker).complete


def test_an_episode_read_from_after_its_first_segment_is_a_marked_fragment() -> None:
    """What a ``start=`` time inside an episode, or a partition moved mid-episode, gave
    before: the episode's tail (e.g. only its EpisodeEnd) handed out as if whole."""
    ep = episode(seg(3, 7, 7, is_last=True))
    assert not ep.complete
    assert ep.fragment_reason == "started_mid_episode"
    assert not ep.truncated  # a fragment of a TERMINAL episode: only `complete` tells


def test_a_missing_middle_segment_makes_a_marked_fragment() -> None:
    ep = episode(seg(0, 0, 0), seg(2, 3, 4, is_last=True))
    assert fragment_reason(ep.segments) == "missing_segments"
    assert not ep.complete


# -- the commit point and its metadata -------------------------------------------------------
def test_the_commit_point_stops_at_the_first_segment_of_an_episode_not_acknowledged() -> None:
    """X: offsets 10, 12 (acknowledged); Y: 11 (open). The commit point stops at 11, Y's
    first segment; X's 12 travels in the metadata. The partition's next owner starts at 11
    and skips 12: it gets Y whole and never a fragment of X (before: the metadata was read
    only at start(), so a member already in the group re-delivered 12 -- X's EpisodeEnd --
    as an episode of its own)."""
    p = _PartitionProgress(10)
    for offset in (10, 11, 12):
        p.note_read(offset)
    assert p.ack(10) and p.ack(12)
    p.advance()
    assert p.committed == 11
    meta = p.metadata()
    nxt = _PartitionProgress.from_commit(11, meta)
    assert not nxt.skip_on_restart(11)  # Y's first segment: read
    assert nxt.skip_on_restart(12)  # X's last: acknowledged, skipped
    assert nxt.ack(11)  # Y acknowledged there: the point passes 11 and the carried 12
    nxt.advance()
    assert nxt.committed == 13 and nxt.metadata() == ""


def test_thousands_of_interleaved_acknowledgements_fit_the_metadata() -> None:
    """Live segments hold ~1 event and episodes interleave: one long episode open holds the
    commit point while thousands of others are acknowledged beyond it. They must all reach
    the next owner (before: a JSON list cut at ~500 offsets, the rest delivered again)."""
    rng = random.Random(5)
    p = _PartitionProgress(0)
    open_offsets = set(rng.sample(range(1, 20_000), 400)) | {0}  # the episodes still open
    for offset in range(20_000):
        p.note_read(offset)
        if offset not in open_offsets:
            p.ack(offset)
    p.advance()
    assert p.committed == 0
    meta = p.metadata()
    assert p.metadata_cut == 0 and len(meta) <= 3500
    nxt = _PartitionProgress.from_commit(0, meta)
    skipped = {o for o in range(20_000) if nxt.skip_on_restart(o)}
    assert skipped == set(range(20_000)) - open_offsets


def test_runs_that_do_not_fit_are_cut_from_the_top_and_counted() -> None:
    runs = [(i * 10, i * 10 + 1 + i % 7) for i in range(1, 20_000)]
    scrambled = random.Random(1)
    runs = sorted({(a + scrambled.randint(0, 3), b + 4) for a, b in runs})
    runs = [r for i, r in enumerate(runs) if i == 0 or r[0] > runs[i - 1][1]]
    text, cut = encode_acked_beyond(runs, 0)
    assert 0 < cut < len(runs) and len(text) <= 3500
    back = parse_acked_beyond(text, 0)
    assert back == runs[: len(runs) - cut]  # the lowest kept: the commit point reaches them


def test_holes_between_acknowledgements_travel_with_them_and_old_metadata_is_read() -> None:
    p = _PartitionProgress(0)
    for offset in (0, 2, 3, 6):  # 1, 4, 5: transaction markers (no record)
        p.note_read(offset)
    p.ack(2)
    p.ack(3)
    assert p.beyond() == [(1, 4)]  # the marker at 1 is passed too; 0 is not acknowledged
    legacy = _PartitionProgress.from_commit(5, json.dumps([7, 8, 10]))  # before 2026-12-05
    assert [o for o in range(5, 12) if legacy.skip_on_restart(o)] == [7, 8, 10]
    assert parse_acked_beyond("r1:not base64!", 0) == []  # unreadable: nothing skipped


# -- acknowledgements across tenures ---------------------------------------------------------
def _client() -> ReplayClient:
    async def build() -> ReplayClient:
        return ReplayClient("t", "g")

    return asyncio.run(build())


def test_an_ack_of_a_segment_handed_out_before_the_partition_moved_is_void() -> None:
    client = _client()
    first = client._progress[TP] = _PartitionProgress(0, epoch=1)
    first.note_read(0)
    client._handed_out[TP] = {0: 0}
    client._in_flight = 1
    held = seg(0, 0, 0, is_last=True, offset=0, tenure=1)
    client._lose([TP])  # the partition went to another member
    assert client._in_flight == 0  # not the trainer's to release any more
    client._progress[TP] = _PartitionProgress(0, epoch=2)  # and came back: a new tenure
    assert client._acknowledge(held, by_trainer=True) is None  # void
    assert client._progress[TP].acked == set()  # the re-read delivers it again
    assert client.stats["acks_after_partition_moved"] == 1


def test_a_partition_lost_forgets_its_finished_episodes() -> None:
    """Should the partition come back, an episode this member delivered under its earlier
    tenure (and whose acknowledgement is void) must be delivered again, not dropped as a
    duplicate of itself."""
    client = _client()
    other = TopicPartition(TP.topic, 1)
    client._finished[("sb", "a")] = TP
    client._finished[("sb", "b")] = other
    client._delivered_hwm[("sb", "c")] = (4, TP)
    client._lose([TP])
    assert dict(client._finished) == {("sb", "b"): other}
    assert not client._delivered_hwm


@pytest.mark.parametrize("strict", [True, False])
def test_ack_says_whether_it_counts(strict: bool) -> None:
    """Per-ack commits: True once a commit carried it. Coalesced: True while the partition
    is this member's (its commits, the revocation's included, carry it)."""

    async def run() -> tuple[bool, bool]:
        client = ReplayClient("t", "g", commit_every_ms=0 if strict else 50)
        committed: list[dict] = []

        class Consumer:
            def assignment(self) -> set[TopicPartition]:
                return {TP}

            async def commit(self, offsets: dict) -> None:
                committed.append(offsets)

        client._consumer = Consumer()  # type: ignore[assignment]
        client._progress[TP] = _PartitionProgress(0, epoch=1)
        client._handed_out[TP] = {0: 0, 1: 0}
        client._in_flight = 2
        kept = await client.ack(seg(0, 0, 0, offset=0, tenure=1))
        client._lose([TP])
        moved = await client.ack(seg(1, 1, 1, offset=1, tenure=1))
        if client._committer is not None:
            client._committer.cancel()
        return kept, moved

    kept, moved = asyncio.run(run())
    assert kept is True and moved is False


async def _ack_during_a_revocation(client: ReplayClient) -> asyncio.Task[bool]:
    """``client`` holding one segment of TP unacknowledged when a revocation begins (a
    committer task that commits nothing meanwhile): the trainer's ack of it, started and
    given 50 ms."""
    client._progress[TP] = _PartitionProgress(0, epoch=1)
    client._handed_out[TP] = {0: 0}
    client._in_flight = 1
    client._settled.clear()  # a revocation has begun
    client._committer = asyncio.create_task(asyncio.sleep(3600))  # no commit here
    ack = asyncio.create_task(client.ack(seg(0, 0, 0, offset=0, tenure=1)))
    await asyncio.sleep(0.05)
    return ack


@pytest.mark.parametrize("kept", [True, False])
def test_a_coalesced_ack_during_a_rebalance_waits_for_its_outcome(kept: bool) -> None:
    """From the start of a revocation (whose commit may be made already, without this ack)
    until the new assignment, an ack cannot promise anything: it returns once the group has
    settled -- True if the partition stayed, False if it went (before, an ack made while the
    revocation's commit was under way returned True and went with the partition: the drill
    saw such an episode acknowledged by both members)."""

    async def run() -> bool:
        client = ReplayClient("t", "g", commit_every_ms=50)
        ack = await _ack_during_a_revocation(client)
        assert not ack.done()
        if not kept:
            client._lose([TP])
        client._settled.set()  # the new assignment
        result = await asyncio.wait_for(ack, 5)
        client._committer.cancel()
        return result

    assert asyncio.run(run()) is kept


def test_a_coalesced_ack_the_revocation_commit_carried_counts_though_the_partition_went() -> None:
    """An ack made while a revocation waited for a commit under way is carried by the
    revocation's own commit: the partition's next owner skips it, so this ack is the group's
    (before, it returned False, and nobody acknowledged the episode: the drill's run 4 had 3
    such episodes, never delivered again)."""

    async def run() -> bool:
        client = ReplayClient("t", "g", commit_every_ms=50)

        class Consumer:
            def assignment(self) -> set[TopicPartition]:
                return {TP}

            async def commit(self, offsets: dict) -> None:
                pass

        client._consumer = Consumer()  # type: ignore[assignment]
        ack = await _ack_during_a_revocation(client)
        await client._commit()  # the revocation's commit, after the one under way
        client._lose([TP])  # the partition goes
        client._settled.set()
        result = await asyncio.wait_for(ack, 5)
        client._committer.cancel()
        return result

    assert asyncio.run(run()) is True


# -- a partition kept across a rebalance ---------------------------------------------------
def _take_again(progress: _PartitionProgress, group_commit: OffsetAndMetadata | Exception | None
                ) -> bool:
    """Whether this member still holds ``progress`` after a rebalance that assigned it the
    partition again, the group's commit of it being ``group_commit`` now."""

    async def run() -> bool:
        client = ReplayClient("t", "g")

        class Consumer:
            def assignment(self) -> set[TopicPartition]:
                return {TP}

        async def fetch_committed(tp: TopicPartition) -> OffsetAndMetadata | None:
            if isinstance(group_commit, Exception):
                raise group_commit
            return group_commit

        client._consumer = Consumer()  # type: ignore[assignment]
        client._fetch_committed = fetch_committed  # type: ignore[method-assign]
        client._progress[TP] = progress
        await _StartAt(client)._take([TP])
        return client._progress.get(TP) is progress

    return asyncio.run(run())


def test_a_partition_kept_while_the_group_had_no_commit_stays_this_members() -> None:
    assert _take_again(_PartitionProgress(0, epoch=1), None) is True


def test_a_partition_kept_whose_commit_is_still_this_tenures_stays_this_members() -> None:
    progress = _PartitionProgress.from_commit(40, "", epoch=1)
    progress.ack(40)
    progress.advance()
    progress.last_committed = (41, "")  # its commit succeeded
    assert _take_again(progress, OffsetAndMetadata(41, "")) is True


def test_a_tenure_that_began_without_a_commit_is_stale_once_another_member_committed() -> None:
    """This member read from the beginning of a new group's partition, acknowledged up to 100
    without a commit reaching the group (it was evicted), and another member took the
    partition meanwhile and committed 40 with what it acknowledged beyond. Kept, this
    member's progress would skip nothing of the other's and deliver its episodes again."""
    progress = _PartitionProgress(0, epoch=1)
    for offset in range(100):
        progress.ack(offset)
    progress.advance()
    assert _take_again(progress, OffsetAndMetadata(40, encode_acked_beyond([(41, 90)], 40)[0])
                       ) is False


def test_a_partition_whose_group_commit_cannot_be_read_is_given_up() -> None:
    assert _take_again(_PartitionProgress(0, epoch=1), RuntimeError("coordinator away")) is False


def test_a_start_sought_behind_the_groups_commit_stays_this_members() -> None:
    """start="earliest" on a group with commit 100: the tenure sought 0 and saw 100; a
    rebalance before its first commit finds the group's commit still 100 -- nobody else
    committed -- and keeps it (given up, the partition was read on from 100: 0-99 never
    delivered)."""
    progress = _PartitionProgress(0, epoch=1)
    progress.last_committed = (100, "")
    assert _take_again(progress, OffsetAndMetadata(100, "")) is True
    assert _take_again(progress, OffsetAndMetadata(120, "")) is False
