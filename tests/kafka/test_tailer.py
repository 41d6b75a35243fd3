"""The trace tailer: bytes reassembled from Kafka equal the file across tailer restarts;
truncation and replacement are announced with ``reset``."""

from __future__ import annotations

import asyncio
import os
import random
from pathlib import Path

import pytest

from trajbus.bus import producer as producer_mod
from trajbus.bus.producer import close_producer
from trajbus.bus.topics import Topics
from trajbus.producers.emitter import SandboxEmitter
from trajbus.producers.tailer import TraceTailer
from trajbus.producers.testing import Seen, check_streams, create_topics, make_settings, read_topics

pytestmark = [pytest.mark.kafka, pytest.mark.timeout(180)]


@pytest.fixture(autouse=True)
async def _close_shared_producer():
    yield
    if producer_mod._loop is asyncio.get_running_loop():
        await close_producer()


def _reassemble(seen: list[Seen], episode: str) -> bytes:
    """Rebuild a trace file from its chunks: dedupe by seq, order by seq, restart at resets."""
    by_seq = {x.header["seq"]: x.record for x in seen
              if x.kind == "TraceChunk" and x.header["episode"] == episode}
    buf = bytearray()
    for seq in sorted(by_seq):
        r = by_seq[seq]
        if r["reset"]:
            buf = bytearray()
        assert r["file_offset"] == len(buf), (seq, r["file_offset"], len(buf))
        buf += r["data"]
    return bytes(buf)


async def test_tailer_bytes_equal_file_across_restarts(kafka_broker, unique_name, tmp_path):
    s = make_settings(kafka_broker.bootstrap, unique_name, tmp_path / "state")
    await create_topics(s)
    trace_dir = tmp_path / "shm" / "rt-trace"
    trace_dir.mkdir(parents=True)
    rng = random.Random(3)
    path = trace_dir / "episode_00007.trace"
    written = bytearray()
    em = None
    for round_ in range(6):
        # the agent writes more (sometimes ending mid-line)
        with open(path, "ab") as fh:
            for _ in range(rng.randint(20, 60)):
                line = (f"step {len(written)} " + "x" * rng.randint(0, 300) + "\n").encode()
                fh.write(line)
                written += line
            if round_ % 2:
                fh.write(b"partial-")
                written += b"partial-"
        em = SandboxEmitter("sb-tail", "task-t", settings=s)
        await em.start()
        tailer = TraceTailer(em, trace_dir, chunk_size=1024)
        await tailer.poll_once()
        if round_ % 2:
            await em.abort()  # crash: whatever was not acked is re-sent by the next emitter
        else:
            await em.close(30)
    (trace_dir / "episode_00007.done").write_text('{"outcome": "TERMINAL", "reward": 0.5}')
    async with SandboxEmitter("sb-tail", "task-t", settings=s) as em:
        tailer = TraceTailer(em, trace_dir, chunk_size=1024)
        await tailer.run(once=True)
        await tailer.run(once=True)  # idempotent once done
        assert em.is_closed("00007")
    topics = [Topics(s).sandbox_events, Topics(s).trace_chunks]
    seen = await read_topics(s, topics, lambda xs: any(x.kind == "EpisodeEnd" for x in xs))
    assert check_streams(seen).problems() == []
    assert _reassemble(seen, "00007") == bytes(written) == path.read_bytes()
    end = next(x for x in seen if x.kind == "EpisodeEnd")
    assert end.record["reward"] == 0.5
    assert all(len(x.record["data"]) <= 1024 for x in seen if x.kind == "TraceChunk")


async def test_tailer_reports_truncation_and_replacement(kafka_broker, unique_name, tmp_path):
    s = make_settings(kafka_broker.bootstrap, unique_name, tmp_path / "state")
    await create_topics(s)
    trace_dir = tmp_path / "trace"
    trace_dir.mkdir()
    path = trace_dir / "episode_1.trace"
    async with SandboxEmitter("sb-trunc", "task-t", settings=s) as em:
        tailer = TraceTailer(em, trace_dir, chunk_size=64)
        path.write_bytes(b"a" * 50 + b"\n" + b"b" * 50 + b"\n")
        await tailer.poll_once()
        path.write_bytes(b"short\n")  # truncated in place (same inode)
        await tailer.poll_once()
        tmp = trace_dir / "new.tmp"
        tmp.write_bytes(b"replaced content\n")
        os.replace(tmp, path)  # replaced (new inode)
        await tailer.poll_once()
        Path(trace_dir / "episode_1.done").touch()
        await tailer.poll_once()
        assert tailer.resets == 2
    seen = await read_topics(s, [Topics(s).trace_chunks],
                             lambda xs: sum(1 for x in xs if x.record["reset"]) >= 2)
    resets = [x.record["reset"] for x in sorted(seen, key=lambda x: x.header["seq"])
              if x.record["reset"]]
    assert resets == ["truncated", "replaced"]
    assert _reassemble(seen, "1") == b"replaced content\n"


def test_tailer_cli_registers():
    import argparse

    from trajbus.producers.cli import register

    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers(dest="cmd")
    register(sub)
    ns = parser.parse_args(["tail-traces", "/dev/shm/x-trace", "--sandbox", "sb", "--task", "t",
                            "--once", "--poll-ms", "50"])
    assert ns.once and ns.poll_ms == 50 and callable(ns.func)
    ns = parser.parse_args(["simulate", "--sandboxes", "3", "--episodes", "2", "--seed", "1"])
    assert ns.sandboxes == 3 and callable(ns.func)
