"""ReorderProcessor.handle_batch (what the runner calls once per transaction) against
ReorderProcessor.handle (one record at a time): the same core calls, so the same state; the
replay output differs only in how an episode's consecutive events are cut into segments.
Pure: no broker."""

from __future__ import annotations

import random
from collections import defaultdict
from typing import Any

import pytest
from support import make_episodes, shuffled_with_duplicates

from trajbus.bus.settings import ReplaySettings, Settings
from trajbus.consumers.engine.processors import ReorderProcessor
from trajbus.consumers.engine.runner import InRecord, OutRecord
from trajbus.schemas import models as m
from trajbus.schemas.codec import default_codec

codec = default_codec()
T0 = 1_700_000_000_000


def _log(seed: int, n_episodes: int = 30) -> list[InRecord]:
    """Shuffled, duplicated episodes on the events topic, with ticks on both input topics
    (the watermark) and a few missing seqs that only a gap timeout releases."""
    rng = random.Random(seed)
    eps = make_episodes(n_episodes, seed, steps=8, t0=T0)
    stream = shuffled_with_duplicates(eps, seed, dup_rate=0.15, window=12)
    dropped = {rng.randrange(len(stream)) for _ in range(3)}  # holes -> gaps after timeout
    out: list[InRecord] = []
    now = T0
    off = 0
    for i, (sandbox, raw) in enumerate(stream):
        if i in dropped:
            continue
        out.append(InRecord("t.sandbox.events", 0, off, sandbox.encode(), raw, now))
        off += 1
        if i % 17 == 0:  # ticks on both inputs; time moves 1 s per tick
            now += 1000
            for topic in ("t.sandbox.events", "t.trace.chunks"):
                tick = m.Tick(header=m.Envelope(task="_tick", sandbox="_tick", seq=i,
                                                event_time_ms=now, producer_id="test"))
                out.append(InRecord(topic, 0, off, b"_tick", tick.encode(), now))
                off += 1
    for _ in range(12):  # let every gap time out
        now += 1000
        for topic in ("t.sandbox.events", "t.trace.chunks"):
            tick = m.Tick(header=m.Envelope(task="_tick", sandbox="_tick", seq=0,
                                            event_time_ms=now, producer_id="test"))
            out.append(InRecord(topic, 0, off, b"_tick", tick.encode(), now))
            off += 1
    return out


def _settings(**replay: Any) -> Settings:
    s = Settings()
    s.topics.prefix = "t"
    s.replay = ReplaySettings(gap_timeout_ms=3000, **replay)
    return s


def _view(outs: list[OutRecord]) -> dict[str, Any]:
    """Per episode: event seqs in delivery order, gaps, first/last flags; other outputs."""
    eps: dict[tuple[str, str], dict[str, Any]] = defaultdict(
        lambda: {"seqs": [], "gaps": [], "segments": [], "terminal": None})
    other: list[tuple[str, bytes]] = []
    for o in outs:
        d = codec.decode(o.value)
        if d.kind != "ReplaySegment":
            other.append((o.topic, o.value))
            continue
        r = d.record
        h = r["header"]
        ep = eps[(h["sandbox"], h["episode"])]
        seqs = [codec.decode(e).header["seq"] for e in r["events"]]
        if seqs:
            assert seqs == list(range(r["first_seq"], r["last_seq"] + 1))
        ep["seqs"] += seqs
        if r["gap"] is not None:
            ep["gaps"].append((r["gap"]["from_seq"], r["gap"]["to_seq"], seqs[:1]))
        ep["segments"].append((h["seq"], r["is_first"], r["is_last"], len(seqs),
                               o.key, o.topic))
        if r["is_last"]:
            ep["terminal"] = r["is_terminal"]
    return {"eps": dict(eps), "other": other}


@pytest.mark.parametrize("seed", [1, 2, 3])
@pytest.mark.parametrize("cap", [1024, 3])
def test_batches_deliver_the_same_events_in_fewer_segments(seed: int, cap: int) -> None:
    settings = _settings(max_segment_events=cap)
    log = _log(seed)
    single, batched = ReorderProcessor(settings), ReorderProcessor(settings)
    outs_single = [o for rec in log for o in single.handle(rec)]
    rng = random.Random(seed)
    outs_batched: list[OutRecord] = []
    i = 0
    while i < len(log):  # batches of random size, as getmany returns them
        n = rng.choice([1, 2, 5, 40, 300])
        outs_batched += batched.handle_batch(log[i:i + n])
        i += n
    # the core saw identical calls: identical state (what the changelog persists)
    assert single.core.snapshot() == batched.core.snapshot()
    a, b = _view(outs_single), _view(outs_batched)
    assert a["other"] == b["other"]  # late events and dead letters unchanged, same order
    assert a["eps"].keys() == b["eps"].keys()
    assert any(ep["gaps"] for ep in a["eps"].values())  # the log exercises gap markers
    merged = 0
    for key, ea in a["eps"].items():
        eb = b["eps"][key]
        assert eb["seqs"] == ea["seqs"]  # the same events, in order, once
        assert eb["gaps"] == ea["gaps"] and eb["terminal"] == ea["terminal"]
        sa, sb = ea["segments"], eb["segments"]
        assert sb[0][1] and not any(s[1] for s in sb[1:])  # is_first on the first only
        assert sa[-1][2] == sb[-1][2] and not any(s[2] for s in sb[:-1])  # is_last last only
        idx = [s[0] for s in sb]
        assert idx == sorted(set(idx)) and set(idx) <= {s[0] for s in sa}
        assert all(s[3] <= cap for s in sb)  # the core's segment cap still holds
        assert {(s[4], s[5]) for s in sb} == {(s[4], s[5]) for s in sa}  # key, topic
        merged += len(sa) - len(sb)
    assert merged > 0


def test_handle_batch_of_one_equals_handle() -> None:
    settings = _settings()
    log = _log(7, n_episodes=5)
    a, b = ReorderProcessor(settings), ReorderProcessor(settings)
    for rec in log:
        assert [(o.topic, o.key, o.value) for o in a.handle(rec)] == \
            [(o.topic, o.key, o.value) for o in b.handle_batch([rec])]
