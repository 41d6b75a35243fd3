"""Sequences stay monotonic and gapless, never reused, across an emitter killed with SIGKILL and
restarted, and across a migration (the state directory copied to another "host")."""

from __future__ import annotations

import asyncio
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from trajbus.bus import producer as producer_mod
from trajbus.bus.producer import close_producer
from trajbus.bus.topics import Topics
from trajbus.producers.testing import check_streams, create_topics, make_settings, read_topics

pytestmark = [pytest.mark.kafka, pytest.mark.timeout(240)]

CHILD = r"""
import asyncio, sys
from trajbus.producers.emitter import SandboxEmitter
from trajbus.producers.testing import make_settings

bootstrap, prefix, state_dir, producer_id, target = sys.argv[1:6]
target = int(target)

async def main():
    s = make_settings(bootstrap, prefix, state_dir)
    em = SandboxEmitter("sb-crash", "task-a", settings=s, producer_id=producer_id)
    await em.start()
    print("resumed", em.pending_count, em.next_seq("ep-1"), flush=True)
    if em.lifecycle_state is None:
        await em.lifecycle("ACTIVE")
    if not em.is_open("ep-1") and not em.is_closed("ep-1"):
        await em.start_episode("ep-1")
    i = 0
    while em.next_seq("ep-1") < target:
        cid = await em.tool_call("ep-1", "bash", {"cmd": f"step {i}"})
        await em.tool_result("ep-1", cid, "bash", {"out": i})
        if i % 25 == 0:
            await em.heartbeat()
        if i % 50 == 0:
            print("seq", em.next_seq("ep-1"), flush=True)
            await asyncio.sleep(0.005)
        i += 1
    await em.end_episode("ep-1")
    ok = await em.close(60)
    print("done", ok, flush=True)

asyncio.run(main())
"""


@pytest.fixture(autouse=True)
async def _close_shared_producer():
    yield
    if producer_mod._loop is asyncio.get_running_loop():
        await close_producer()


def _spawn(bootstrap: str, prefix: str, state: Path, pid: str, target: int) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-c", CHILD, bootstrap, prefix, str(state), pid, str(target)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _run_until(proc: subprocess.Popen, min_seq: int, timeout: float = 60) -> int:
    """Read the child's progress until it reports seq >= min_seq; returns that seq."""
    deadline = time.monotonic() + timeout
    assert proc.stdout is not None
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            err = proc.stderr.read() if proc.stderr else ""
            raise AssertionError(f"child exited early: {proc.wait()} {err}")
        if line.startswith("seq ") and int(line.split()[1]) >= min_seq:
            return int(line.split()[1])
    raise AssertionError("child made no progress")


async def test_sigkill_restart_and_migration_keep_seqs_gapless(kafka_broker, unique_name,
                                                                tmp_path):
    s = make_settings(kafka_broker.bootstrap, unique_name, tmp_path)
    await create_topics(s)
    host_a = tmp_path / "host-a" / "sb-crash"
    host_b = tmp_path / "host-b" / "sb-crash"

    # 1. run, SIGKILL mid-stream (events in flight and journaled-but-unsent)
    p1 = _spawn(kafka_broker.bootstrap, unique_name, host_a, "p1", 10**9)
    _run_until(p1, 400)
    p1.send_signal(signal.SIGKILL)
    assert p1.wait(10) == -signal.SIGKILL

    # 2. restart on the same directory, SIGKILL again
    p2 = _spawn(kafka_broker.bootstrap, unique_name, host_a, "p2", 10**9)
    resumed_at = _run_until(p2, 0)
    reached = _run_until(p2, resumed_at + 400)
    p2.send_signal(signal.SIGKILL)
    assert p2.wait(10) == -signal.SIGKILL

    # 3. migration: the directory is handed to a process on another host, which finishes
    shutil.copytree(host_a, host_b)
    p3 = _spawn(kafka_broker.bootstrap, unique_name, host_b, "p3", reached + 300)
    out, err = p3.communicate(timeout=120)
    assert p3.returncode == 0, err
    assert "done True" in out

    topic = Topics(s).sandbox_events
    seen = await read_topics(s, [topic], lambda xs: any(x.kind == "EpisodeEnd" for x in xs),
                             timeout=60)
    check = check_streams(seen)
    assert check.problems() == []
    ep = check.streams[("sb-crash", "ep-1")]
    top = max(ep)
    assert top >= reached + 300 - 1
    assert set(ep) == set(range(top + 1))
    end = [x for x in seen if x.kind == "EpisodeEnd"]
    assert len({x.header["event_id"] for x in end}) == 1 and end[0].header["seq"] == top
    sandbox_stream = check.streams[("sb-crash", None)]
    assert set(sandbox_stream) == set(range(max(sandbox_stream) + 1))
    # several producer ids wrote this episode (one per process), and duplicates, if any,
    # carry the original event id (so downstream dedupe by (sandbox, episode, seq) is exact)
    assert {x.header["producer_id"] for x in seen} >= {"p1", "p3"}


CHILD_MANY = r"""
import asyncio, sys
from trajbus.producers.emitter import SandboxEmitter
from trajbus.producers.sender import shared_sender
from trajbus.producers.testing import make_settings

bootstrap, prefix, state_dir, producer_id, n, target = sys.argv[1:7]
n, target = int(n), int(target)

async def drive(em, report):
    if not em.is_open("ep-1") and not em.is_closed("ep-1"):
        await em.start_episode("ep-1")
    i = 0
    while em.next_seq("ep-1") < target:
        await em.tool_call("ep-1", "bash", {"cmd": f"step {i}"})
        if report and i % 50 == 0 and shared_sender().syncfs_calls > 0:
            # progress is reported once the group commit has run
            print("seq", em.next_seq("ep-1"), shared_sender().syncfs_calls, flush=True)
        await asyncio.sleep(0.001)
        i += 1
    await em.end_episode("ep-1")

async def main():
    s = make_settings(bootstrap, prefix, state_dir)
    assert s.producer.journal_sync == "filesystem"
    ems = [await SandboxEmitter(f"sb-{i}", "task-a", settings=s, producer_id=producer_id,
                                state_dir=f"{state_dir}/sb-{i}").start() for i in range(n)]
    await asyncio.gather(*(drive(em, i == 0) for i, em in enumerate(ems)))
    ok = all(await asyncio.gather(*(em.close(60) for em in ems)))
    print("done", ok, shared_sender().syncfs_calls, flush=True)

asyncio.run(main())
"""


def _spawn_many(bootstrap: str, prefix: str, state: Path, pid: str, n: int,
                target: int) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-c", CHILD_MANY, bootstrap, prefix, str(state), pid, str(n),
         str(target)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


async def test_sigkill_of_a_process_of_many_emitters_sharing_journal_syncs(
        kafka_broker, unique_name, tmp_path):
    """Eight emitters in one process commit their journals together (one syncfs per send
    round); SIGKILLed twice mid-stream and restarted on the same directories, every sandbox's
    seqs stay gapless and each event id is sent under one seq only."""
    s = make_settings(kafka_broker.bootstrap, unique_name, tmp_path)
    await create_topics(s)
    state, n = tmp_path / "node", 8
    for pid in ("p1", "p2"):
        p = _spawn_many(kafka_broker.bootstrap, unique_name, state, pid, n, 10**9)
        at = _run_until(p, 0)
        _run_until(p, at + 150)
        p.send_signal(signal.SIGKILL)  # mid-stream, after group commits (progress says so)
        assert p.wait(10) == -signal.SIGKILL
    p3 = _spawn_many(kafka_broker.bootstrap, unique_name, state, "p3", n, 0)
    out, err = p3.communicate(timeout=120)
    assert p3.returncode == 0, err
    assert out.strip().splitlines()[-1].split()[:2] == ["done", "True"], out

    topic = Topics(s).sandbox_events
    seen = await read_topics(
        s, [topic], lambda xs: sum(x.kind == "EpisodeEnd" for x in xs) >= n, timeout=60)
    check = check_streams(seen)
    assert check.problems() == []
    for i in range(n):
        ep = check.streams[(f"sb-{i}", "ep-1")]
        assert len(ep) > 150 and set(ep) == set(range(max(ep) + 1)), f"sb-{i}"
    by_id: dict[str, set[int]] = {}
    for x in seen:
        by_id.setdefault(x.header["event_id"], set()).add(x.header["seq"])
    assert all(len(seqs) == 1 for seqs in by_id.values())
