"""The fleet simulator: deterministic for a seed, and its manifest matches what Kafka holds."""

from __future__ import annotations

import asyncio
from collections import defaultdict

import pytest

from trajbus.bus import producer as producer_mod
from trajbus.bus.producer import close_producer
from trajbus.producers.simulator import load_manifest, simulate
from trajbus.producers.testing import check_streams, create_topics, make_settings, read_topics

pytestmark = [pytest.mark.kafka, pytest.mark.timeout(300)]

KNOBS = dict(loop=0.25, cycle=0.15, nonloop=0.15, crash=0.3, migrate=0.4, duplicate=0.05,
             shuffle_window=4, blob=0.05, blob_bytes=1_200_000, steps_min=3, steps_max=8,
             wait_for_placement=False)  # no scheduler here: every sandbox starts at once


@pytest.fixture(autouse=True)
async def _close_shared_producer():
    yield
    if producer_mod._loop is asyncio.get_running_loop():
        await close_producer()


def _content(m: dict) -> list:
    return sorted((e["task"], e["sandbox"], e["episode"], e["behaviour"], e["outcome"],
                   [tuple(a) for a in e["acked"]]) for e in m["episodes"])


async def test_simulator_manifest_matches_kafka_and_is_deterministic(kafka_broker, unique_name,
                                                                      tmp_path):
    s = make_settings(kafka_broker.bootstrap, unique_name, tmp_path / "s1",
                      claim_check_threshold=1_000_000)
    s.archive.url = str(tmp_path / "archive")
    await create_topics(s)
    m = await simulate(s, sandboxes=8, episodes=3, seed=7, manifest_path=tmp_path / "m1.json",
                       **KNOBS)
    data = load_manifest(tmp_path / "m1.json")
    assert data["events_acked"] > 0 and data["loops"]
    assert any(len(p) > 1 for p in data["producer_ids"].values())  # migrations happened
    t = s.topics
    topics = [f"{t.prefix}.sandbox.events", f"{t.prefix}.trace.chunks"]
    total = sum(len(e.acked) for e in m.episodes) + sum(
        len(v) for v in m.sandbox_streams.values())
    seen = await read_topics(s, topics, lambda xs: len({(x.header["sandbox"],
                                                         x.header["episode"], x.header["seq"])
                                                        for x in xs}) >= total, timeout=90)
    assert check_streams(seen).problems() == []
    on_kafka: dict[tuple, set] = defaultdict(set)
    for x in seen:
        h = x.header
        on_kafka[(h["task"], h["sandbox"], h["episode"])].add((h["seq"], h["event_id"]))
    for e in m.episodes:
        assert set(e.acked) == on_kafka[(e.task, e.sandbox, e.episode)], e.episode
        if e.outcome is not None:
            kinds = {x.kind for x in seen if x.header["sandbox"] == e.sandbox and
                     x.header["episode"] == e.episode and x.header["seq"] == e.final_seq}
            assert kinds == {"EpisodeEnd"}
    assert any(x.record.get("blob") for x in seen if x.kind == "TraceChunk")
    life = sorted((x for x in seen if x.kind == "SandboxLifecycle"
                   and x.header["sandbox"] == m.episodes[0].sandbox),
                  key=lambda x: x.header["seq"])  # shuffled on the wire: order by seq
    states = [x.record["state"] for x in life]
    assert states[0] == "PROVISIONING" and states[-1] == "RECYCLED"
    # loops: >= 20 identical calls over >= 2 minutes of event time
    for lp in m.loops:
        calls = sorted((x for x in seen if x.kind == "ToolCall" and x.header["sandbox"] ==
                        lp.sandbox and x.header["episode"] == lp.episode and lp.loop_span and
                        lp.loop_span[0] <= x.header["seq"] <= lp.loop_span[1]),
                       key=lambda x: x.header["seq"])
        assert len(calls) >= 20
        assert calls[-1].header["event_time_ms"] - calls[0].header["event_time_ms"] >= 120_000
        assert len({c.record["args_hash"] for c in calls}) <= 2

    # same seed, fresh topics and state: the same events (ids, seqs, contents)
    s2 = make_settings(kafka_broker.bootstrap, unique_name + "-b", tmp_path / "s2",
                       claim_check_threshold=1_000_000)
    s2.archive.url = str(tmp_path / "archive")
    await create_topics(s2)
    await simulate(s2, sandboxes=8, episodes=3, seed=7, manifest_path=tmp_path / "m2.json",
                   **KNOBS)
    assert _content(load_manifest(tmp_path / "m2.json")) == _content(data)
