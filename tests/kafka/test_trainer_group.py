"""A group of trainers never duplicates and never hands out a fragment as a whole episode
(issue 41, item 2), on a real broker: two and three trainers of one group join and leave at
random moments while a producer writes live replay segments at 1,500 events/s; every episode
of the producer's manifest is acknowledged exactly once across the group, none is delivered
again after an acknowledgement returned, and every episode marked complete holds exactly the
manifest's events. tests/trainer_group_drill.py runs this N times."""

from __future__ import annotations

import pytest
from support import settings_for
from trainer_group import failed, run_group, summary

pytestmark = [pytest.mark.kafka, pytest.mark.slow, pytest.mark.timeout(300)]


@pytest.mark.parametrize(("members", "kind", "seed"),
                         [(2, "async", 1), (3, "mixed", 2)], ids=["two-async", "three-mixed"])
async def test_trainers_joining_and_leaving_acknowledge_each_episode_once(
        kafka_broker: object, unique_name: str, members: int, kind: str, seed: int) -> None:
    settings = settings_for(kafka_broker.bootstrap, unique_name,  # type: ignore[attr-defined]
                            partitions=4)
    report = await run_group(settings, members=members, seed=seed, rate=1500, duration_s=20,
                             kind=kind)
    print(summary([report]))
    print(report["membership"], report["client_stats"])
    assert report["joins"] >= 2, "no member joined or left: the run tested nothing"
    assert not failed(report), report
    assert not report["marked_fragments"], "a member started mid-episode"
