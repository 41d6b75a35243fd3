"""What each commit style of the trainer client costs (issue 41, item 4).

A replay topic is filled with live-sized segments (one event each, as the reorder processor
releases a live episode) and read back to the end by a fresh consumer group for each style,
acknowledging each segment (``segments()``) or each episode (``episodes()``):

* ``per-ack``: ``commit_every_ms=0``: every ``ack()`` returns once its commit is done;
* ``every-N-ms``: ``commit_every_ms=N``: acks return at once, a background task commits what
  is acknowledged at most every N ms.

Reported per style: events/s of the catch-up (wall time from the first record to the last
acknowledgement; the final commit at ``stop()`` included), the commits made, and the time
spent inside ``ack()``. Both styles keep the guarantee "nothing acknowledged is lost" (a
commit never passes an unacknowledged segment; stop and a rebalance commit what is
acknowledged); they differ in what a crash re-delivers: nothing (per-ack) or the
acknowledgements of the last N ms. Usage::

    python bench/bench_trainer_commit.py [--bootstrap HOST:PORT] [--episodes 1000]
        [--json out.json]

Without ``--bootstrap`` a private broker is started (and stopped).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

from aiokafka import AIOKafkaProducer

from trajbus.bus.admin import ensure_topics
from trajbus.bus.settings import KafkaSettings, Settings, TopicSettings
from trajbus.bus.topics import Topics, episode_record_key
from trajbus.consumers.replay.client import ReplayClient
from trajbus.schemas import models as m

TASK = "bench-commit"
STYLES = {"per-ack": 0.0, "every-10-ms": 10.0, "every-100-ms": 100.0, "every-1000-ms": 1000.0}


def live_episode(i: int, rng: random.Random) -> list[bytes]:
    """One episode as the reorder processor publishes it live: one segment per event."""
    sandbox, episode = f"sb-{i % 64}", f"ep-{i}"

    def hdr(seq: int) -> m.Envelope:
        return m.Envelope(event_id=f"{episode}-{seq}", task=TASK, sandbox=sandbox,
                          episode=episode, seq=seq, event_time_ms=1_700_000_000_000 + seq,
                          producer_id="bench")

    events = [m.EpisodeStart(header=hdr(0)).encode()]
    for s in range(rng.randint(8, 12)):
        events.append(m.ToolCall(header=hdr(len(events)), call_id=f"c{s}", tool="exec",
                                 args_hash=f"{s:064x}", args_canonical='{"cmd": "ls"}').encode())
        events.append(m.ToolResult(header=hdr(len(events)), call_id=f"c{s}", tool="exec",
                                   status=m.ToolStatus.OK, result_hash=f"{s:064x}").encode())
    events.append(m.EpisodeEnd(header=hdr(len(events)),
                               outcome=m.EpisodeOutcome.TERMINAL).encode())
    out = []
    for seq, event in enumerate(events):
        last = seq == len(events) - 1
        out.append(m.ReplaySegment(
            header=m.Envelope(event_id=f"seg-{episode}-{seq}", task=TASK, sandbox=sandbox,
                              episode=episode, seq=seq, producer_id="bench"),
            first_seq=seq, last_seq=seq, events=[event], is_first=seq == 0, is_last=last,
            is_terminal=last).encode())
    return out


async def fill(settings: Settings, episodes: int) -> int:
    topics = Topics(settings)
    await ensure_topics(settings, [topics.replay_spec(TASK, settings.topics.partitions,
                                                      topics.derived_max_bytes)])
    producer = AIOKafkaProducer(bootstrap_servers=settings.kafka.bootstrap_servers,
                                linger_ms=5)
    await producer.start()
    rng = random.Random(41)
    n = 0
    try:
        # episodes interleaved in groups of 16, as a live fleet's are
        for base in range(0, episodes, 16):
            segs = {i: live_episode(i, rng) for i in range(base, min(episodes, base + 16))}
            longest = max(map(len, segs.values()))
            for k in range(longest):
                for i, s in segs.items():
                    if k < len(s):
                        ep = f"ep-{i}"
                        await producer.send(topics.replay(TASK), s[k],
                                            key=episode_record_key(f"sb-{i % 64}", ep))
                        n += 1
        await producer.flush()
    finally:
        await producer.stop()
    return n


class _Timed(ReplayClient):
    """The client, counting its commits."""

    commits = 0

    async def _commit(self) -> None:
        await super()._commit()
        self.commits += 1


async def read_back(settings: Settings, style: str, every_ms: float, unit: str,
                    expected_events: int) -> dict[str, Any]:
    group = f"bench-commit-{style}-{unit}-{uuid.uuid4().hex[:6]}"
    client = _Timed(TASK, group, settings, commit_every_ms=every_ms, max_in_flight=1024)
    await client.start()
    events = acks = 0
    in_ack = 0.0
    started: float | None = None
    try:
        items = client.segments(idle_timeout=5) if unit == "segment" else \
            client.episodes(idle_timeout=5)
        async for item in items:
            if started is None:
                started = time.perf_counter()
            events += len(item.events)
            t = time.perf_counter()
            await client.ack(item)
            in_ack += time.perf_counter() - t
            acks += 1
            if events >= expected_events:
                break
    finally:
        await client.stop()  # its final commit counts: what a checkpoint would wait for
    took = time.perf_counter() - (started or time.perf_counter())
    return {"events": events, "acks": acks, "commits": client.commits,
            "seconds": round(took, 3), "events_per_s": round(events / took) if took else 0,
            "seconds_in_ack": round(in_ack, 3),
            "ack_us_mean": round(in_ack / acks * 1e6, 1) if acks else 0}


async def main_async(args: argparse.Namespace, bootstrap: str) -> dict[str, Any]:
    settings = Settings(kafka=KafkaSettings(bootstrap_servers=bootstrap),
                        topics=TopicSettings(prefix=f"bc{uuid.uuid4().hex[:6]}", partitions=2))
    segments = await fill(settings, args.episodes)
    # the events: one per segment
    out: dict[str, Any] = {"episodes": args.episodes, "segments": segments,
                           "events_per_segment": 1, "partitions": 2, "styles": {}}
    for unit in ("segment", "episode"):
        for style, every_ms in STYLES.items():
            best: dict[str, Any] | None = None
            for _ in range(args.repeat):
                r = await read_back(settings, style, every_ms, unit, segments)
                if best is None or r["events_per_s"] > best["events_per_s"]:
                    best = r
            assert best is not None
            out["styles"][f"ack-per-{unit}/{style}"] = best
            print(f"ack per {unit:7s} {style:14s} {best['events_per_s']:>8,} events/s  "
                  f"{best['commits']:>6} commits  {best['seconds_in_ack']:.2f} s in ack()",
                  flush=True)
    per = out["styles"]["ack-per-segment/per-ack"]["events_per_s"]
    coalesced = out["styles"]["ack-per-segment/every-100-ms"]["events_per_s"]
    out["coalesced_over_per_ack_segments"] = round(coalesced / per, 1) if per else None
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bootstrap", default="")
    ap.add_argument("--episodes", type=int, default=1000)
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    broker = None
    bootstrap = args.bootstrap
    if not bootstrap:
        from trajbus.infra.broker import LocalBroker, free_port

        broker = LocalBroker(data_dir=Path(tempfile.mkdtemp(prefix="bench-commit-")),
                             port=free_port(), controller_port=free_port())
        broker.start(timeout=120)
        bootstrap = broker.bootstrap
    try:
        result = asyncio.run(main_async(args, bootstrap))
    finally:
        if broker is not None:
            broker.stop()
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    json.dump(result, sys.stdout, indent=2)
    print()


if __name__ == "__main__":
    main()
