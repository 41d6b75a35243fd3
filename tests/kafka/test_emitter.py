"""SandboxEmitter against a real broker: streams, journal recovery, bounded queue, redaction."""

from __future__ import annotations

import asyncio
import os
import time

import pytest

from trajbus.bus import producer as producer_mod
from trajbus.bus.producer import close_producer
from trajbus.bus.topics import Topics
from trajbus.producers.emitter import (
    EpisodeStateError,
    QueueFullError,
    SandboxEmitter,
    StateDirLockedError,
    SyncEmitter,
    _LoopThread,
)
from trajbus.producers.testing import check_streams, create_topics, make_settings, read_topics
from trajbus.schemas.models import decode_event

pytestmark = [pytest.mark.kafka, pytest.mark.timeout(120)]


@pytest.fixture(autouse=True)
async def _close_shared_producer():
    yield
    if producer_mod._loop is asyncio.get_running_loop():
        await close_producer()


async def test_streams_are_gapless_and_events_decode(kafka_broker, unique_name, tmp_path):
    s = make_settings(kafka_broker.bootstrap, unique_name, tmp_path)
    await create_topics(s)
    async with SandboxEmitter("sb-1", "task-a", settings=s, tenant="acme") as em:
        await em.lifecycle("PROVISIONING")
        await em.lifecycle("ACTIVE", node="n1")
        await em.start_episode("00001", policy_version=7)
        for i in range(50):
            cid = await em.tool_call("00001", "bash", {"cmd": f"echo {i}", "ts": i})
            await em.tool_result("00001", cid, "bash", {"stdout": str(i)}, duration_ms=3)
            if i % 10 == 0:
                await em.heartbeat()
                await em.liveness(True, target="127.0.0.1:8080", latency_ms=2)
        await em.trace_chunk("00001", b"line\n" * 10, file_offset=0, content_type="text/plain")
        await em.end_episode("00001", "TERMINAL", reward=1.0)
        with pytest.raises(EpisodeStateError):
            await em.tool_call("00001", "bash", {})
        with pytest.raises(EpisodeStateError):
            await em.start_episode("00001")
        assert await em.flush(30)
        report = await em.drain(10)
        assert report.complete and report.unflushed == [] and report.final_seqs == {}
    topics = [em.topics.sandbox_events, em.topics.trace_chunks]
    seen = await read_topics(s, topics, lambda xs: any(x.kind == "Drained" for x in xs))
    assert check_streams(seen).problems() == []
    ep = sorted((x for x in seen if x.header["episode"] == "00001"), key=lambda x: x.header["seq"])
    assert ep[0].kind == "EpisodeStart" and ep[-1].kind == "EpisodeEnd"
    assert [x.header["seq"] for x in ep] == list(range(len(ep))) == list(range(103))
    assert {x.header["policy_version"] for x in ep} == {7}
    for x in seen:  # every event validates against its pydantic model
        decode_event(x.value)
    # the watchdog's ignored fields ("ts") do not change the args hash
    calls = [x.record for x in ep if x.kind == "ToolCall"]
    assert len({c["args_hash"] for c in calls}) == 50
    assert all(x.partition == seen[0].partition for x in seen if x.topic == topics[0])
    life = [x.record for x in seen if x.kind == "SandboxLifecycle"]
    assert [(r["previous_state"], r["state"]) for r in life] == [
        (None, "PROVISIONING"), ("PROVISIONING", "ACTIVE")]


async def test_same_call_same_hash_despite_ignored_fields(kafka_broker, unique_name, tmp_path):
    s = make_settings(kafka_broker.bootstrap, unique_name, tmp_path)
    await create_topics(s)
    async with SandboxEmitter("sb-h", "task-a", settings=s) as em:
        await em.start_episode("e")
        await em.tool_call("e", "click", {"x": 1, "timestamp": 1})
        await em.tool_call("e", "click", '{"timestamp": 2, "x": 1.0}')
        await em.tool_call("e", "click", {"x": 2})
        await em.tool_call("e", "big", {"blob": "y" * 10_000})
    seen = await read_topics(s, [em.topics.sandbox_events],
                             lambda xs: sum(x.kind == "ToolCall" for x in xs) == 4)
    calls = sorted((x.record for x in seen if x.kind == "ToolCall"),
                   key=lambda r: r["header"]["seq"])
    assert calls[0]["args_hash"] == calls[1]["args_hash"] != calls[2]["args_hash"]
    assert calls[0]["args_canonical"] == '{"timestamp":1,"x":1}'
    assert calls[3]["args_canonical"] is None and len(calls[3]["args_summary"]) <= 256


async def test_restart_resends_unacked_journal_and_continues(kafka_broker, unique_name, tmp_path):
    """An emitter aborted with events journaled but never sent: the next one on the same
    directory sends them (same event ids and seqs) and continues after them."""
    s = make_settings(kafka_broker.bootstrap, unique_name, tmp_path)
    await create_topics(s)
    em = SandboxEmitter("sb-r", "task-a", settings=s)
    await em.start()
    await em.start_episode("e1")
    # Stop the sender so these stay journaled only, then abort (a crash).
    assert em._sender is not None
    await em.flush(10)
    em._sender.cancel()
    ids = [await em.tool_call("e1", "t", {"i": i}) for i in range(20)]
    assert em.pending_count == 20
    await em.abort()
    em2 = SandboxEmitter("sb-r", "task-a", settings=s)
    assert em2.pending_count == 20 and em2.next_seq("e1") == 21 and em2.is_open("e1")
    async with em2:
        await em2.tool_call("e1", "t", {"i": 20})
        await em2.end_episode("e1")
    seen = await read_topics(s, [em.topics.sandbox_events],
                             lambda xs: any(x.kind == "EpisodeEnd" for x in xs))
    assert check_streams(seen).problems() == []
    seqs = sorted(x.header["seq"] for x in seen if x.header["episode"] == "e1")
    assert seqs == list(range(23))
    assert len(ids) == 20


async def test_acknowledged_events_leave_the_journal_promptly(kafka_broker, unique_name,
                                                            tmp_path):
    """Disk per emitter is bounded by what is unacknowledged plus ``drained_roll_bytes``, not
    by the 32 MiB segment: once everything in the active segment is acked, the emitter rolls
    to a fresh snapshot and deletes the drained segment. The state survives the roll."""
    s = make_settings(kafka_broker.bootstrap, unique_name, tmp_path)
    await create_topics(s)
    state = tmp_path / "sb-j"
    roll = 64 * 1024
    journal_dir = state / "journal"

    def journal_bytes() -> int:
        return sum(p.stat().st_size for p in journal_dir.glob("seg-*.log"))

    async with SandboxEmitter("sb-j", "task-a", settings=s, state_dir=state,
                              drained_roll_bytes=roll) as em:
        await em.start_episode("e1")
        written = 0
        for burst in range(6):
            for i in range(500):
                await em.tool_call("e1", "bash", {"cmd": f"echo {burst}-{i}", "pad": "x" * 200})
            assert await em.flush(30)
            written += 500
            # the acks wake the sender, which journals them and rolls the drained segment
            deadline = asyncio.get_running_loop().time() + 10
            while journal_bytes() > 2 * roll and asyncio.get_running_loop().time() < deadline:
                await asyncio.sleep(0.02)
            assert journal_bytes() <= 2 * roll, (burst, journal_bytes())
        assert written * 300 > 10 * roll  # far more was written than the journal now holds
    em2 = SandboxEmitter("sb-j", "task-a", settings=s, state_dir=state)
    assert em2.pending_count == 0 and em2.next_seq("e1") == 3001 and em2.is_open("e1")
    await em2.abort()


async def test_state_dir_is_exclusive(kafka_broker, unique_name, tmp_path):
    s = make_settings(kafka_broker.bootstrap, unique_name, tmp_path)
    em = SandboxEmitter("sb-x", "task-a", settings=s)
    with pytest.raises(StateDirLockedError):
        SandboxEmitter("sb-x", "task-a", settings=s)
    await em.abort()
    await SandboxEmitter("sb-x", "task-a", settings=s).abort()  # free again after abort


async def test_queue_full_raises_without_consuming_a_seq(kafka_broker, unique_name, tmp_path):
    s = make_settings(kafka_broker.bootstrap, unique_name, tmp_path, queue_max_events=5,
                      queue_full_timeout_s=0.3)
    await create_topics(s)
    em = SandboxEmitter("sb-q", "task-a", settings=s)
    await em.start()
    assert em._sender is not None
    em._sender.cancel()  # nothing gets acknowledged: the queue fills
    for _ in range(5):
        await em.heartbeat()
    with pytest.raises(QueueFullError):
        await em.heartbeat()
    assert em.next_seq() == 5
    await em.abort()
    # spill policy: accepted onto disk, sent later
    em2 = SandboxEmitter("sb-q", "task-a", settings=s, queue_policy="spill")
    async with em2:
        for _ in range(20):
            await em2.heartbeat()
        assert await em2.flush(30)
    seen = await read_topics(s, [em.topics.sandbox_events], lambda xs: len(xs) >= 25)
    assert sorted(x.header["seq"] for x in seen) == list(range(25))


async def test_redaction_planted_secrets_never_reach_kafka(kafka_broker, unique_name, tmp_path):
    secret = "zz-planted-secret-9f8e7d"
    other_sandbox_secret = "yy-other-sandbox-secret-42"
    shapes = {
        "openai": "sk-proj-abcdefghijklmnopqrstuvwxyz012345",
        "aws": "AKIAIOSFODNN7EXAMPLE",
        "bearer": "Bearer eyJhbGciOiJIUzI1NiJ9abcdefghij",
        "url": "postgres://admin:hunter2hunter2@db:5432/x",
        "pem": "-----BEGIN RSA PRIVATE KEY-----\nMIIEowIBAAKCAQEA\n-----END RSA PRIVATE KEY-----",
    }
    s = make_settings(kafka_broker.bootstrap, unique_name, tmp_path)
    await create_topics(s)
    env = {"OPENAI_API_KEY": secret, "PATH": "/usr/bin"}
    other = SandboxEmitter("sb-other", "task-a", settings=s, env={"GITHUB_TOKEN":
                                                                   other_sandbox_secret})
    async with SandboxEmitter("sb-sec", "task-a", settings=s, env=env) as em, other:
        await em.start_episode("e")
        cid = await em.tool_call("e", "http", {"url": shapes["url"], "headers": {
            "Authorization": shapes["bearer"]}, "key": secret, "password": "pw-123456"})
        await em.tool_result("e", cid, "http", f"echo {secret} {shapes['openai']} {shapes['aws']}\n"
                                               f"curl -H 'Authorization: {shapes['bearer']}'")
        trace = f"step 1 env OPENAI_API_KEY={secret}\n{shapes['pem']}\n{shapes['aws']}\n".encode()
        await em.trace_chunk("e", trace, file_offset=0, content_type="text/plain")
        await em.liveness(False, error=f"connect {shapes['url']} failed")
        await em.end_episode("e", reason=f"done {secret}")
        await other.heartbeat()
        counts = dict(em.redactor.counts)
    seen = await read_topics(s, [em.topics.sandbox_events, em.topics.trace_chunks],
                             lambda xs: any(x.kind == "EpisodeEnd" for x in xs) and
                             any(x.kind == "Heartbeat" for x in xs))
    blob = b"".join(x.value for x in seen)
    for planted in [secret, "hunter2hunter2", "pw-123456", "IOSFODNN7EXAMPLE", "MIIEowIBAAKCAQEA",
                    "abcdefghijklmnopqrstuvwxyz012345", "eyJhbGciOiJIUzI1NiJ9abcdefghij"]:
        assert planted.encode() not in blob, planted
    # the other sandbox's secret is not even known to this emitter's redactor
    assert all(other_sandbox_secret not in v for _, v in em.redactor.env_secrets)
    assert counts["env:OPENAI_API_KEY"] >= 4
    for rule in ("aws_access_key", "url_password", "private_key", "sensitive_key",
                 "openai_key", "bearer_token"):
        assert counts.get(rule, 0) >= 1, (rule, counts)
    chunk = next(x for x in seen if x.kind == "TraceChunk")
    assert chunk.record["length"] == len(trace) == len(chunk.record["data"])  # offsets kept


def test_sync_wrapper(kafka_broker, unique_name, tmp_path):
    s = make_settings(kafka_broker.bootstrap, unique_name, tmp_path)
    asyncio.run(create_topics(s))
    with SyncEmitter("sb-sync", "task-a", settings=s) as em:
        em.lifecycle("ACTIVE")
        em.start_episode("e")
        cid = em.tool_call("e", "t", {"a": 1})
        em.tool_result("e", cid, "t", "ok")
        report = em.drain(10)
        assert report.complete and report.final_seqs == {"e": 2}
    _LoopThread.get().run(close_producer())
    seen = asyncio.run(read_topics(s, [Topics(s).sandbox_events], lambda xs: len(xs) >= 5))
    assert check_streams(seen).problems() == []


def test_event_ids_are_uuid4_hex() -> None:
    import uuid

    from trajbus.producers.emitter import _new_event_id

    ids = {_new_event_id() for _ in range(2000)}
    assert len(ids) == 2000
    for x in ids:
        u = uuid.UUID(hex=x)
        assert u.hex == x and u.version == 4 and u.variant == uuid.RFC_4122


def test_a_forked_child_never_repeats_its_parents_event_ids() -> None:
    """Ids come in batches from one os.urandom call; a child must not take the rest of the
    parent's batch."""
    from trajbus.producers.emitter import _new_event_id

    _new_event_id()  # the parent has a batch under way
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        os.write(w, "".join(_new_event_id() for _ in range(10)).encode())
        os._exit(0)
    os.close(w)
    child = os.read(r, 4096).decode()
    os.close(r)
    os.waitpid(pid, 0)
    parent = "".join(_new_event_id() for _ in range(10))
    assert len(child) == len(parent) == 320
    assert {child[i:i + 32] for i in range(0, 320, 32)}.isdisjoint(
        {parent[i:i + 32] for i in range(0, 320, 32)})


def test_cached_partitioner_picks_the_default_partitioners_partition() -> None:
    import random

    from aiokafka.partitioner import DefaultPartitioner

    from trajbus.bus.producer import CachedPartitioner, producer_options

    cached, default = CachedPartitioner(), DefaultPartitioner()
    rng = random.Random(3)
    for _ in range(5000):
        key = rng.randbytes(rng.randint(0, 40))
        parts = list(range(rng.randint(1, 64)))
        assert cached(key, parts, parts) == default(key, parts, parts) == cached(key, parts, parts)
    assert cached(None, [0, 1, 2], [1]) == 1
    assert isinstance(producer_options(make_settings("127.0.0.1:9092", "p").kafka)["partitioner"],
                      CachedPartitioner)


def test_journal_header_text_is_what_json_dumps_writes() -> None:
    """The journal's direct formatting of event headers is byte-identical to json.dumps (so
    journals written before and after read the same)."""
    import json
    import random

    from trajbus.producers.journal import _header_json

    rng = random.Random(5)
    strs = ["E", "e", "é", "\u2028", 'q"u', "b\\s", "\x00", "\ud800", "ep-1", "x" * 50, "😀"]
    for _ in range(20000):
        h: dict[str, object] = {
            "t": rng.choice(strs), "rid": rng.choice([0, 1, -5, 2**70, True]),
            "s": rng.choice(strs), "q": rng.choice([0, 7, 2**40, 1.5]), "id": rng.choice(strs),
            "k": rng.choice(strs), "tp": rng.choice(strs)}
        if rng.random() < 0.1:
            h["open"] = True
        if rng.random() < 0.1:
            h = dict(reversed(list(h.items())))
        assert _header_json(h) == json.dumps(h, separators=(",", ":")), h


@pytest.mark.timeout(30)
async def test_state_dir_reopens_while_a_forked_child_still_holds_the_lock(
        kafka_broker, unique_name, tmp_path):
    # A process that spawns children (an agent runtime, the demo starting its worker) forks
    # them with every descriptor, the emitter's lock among them, until they exec: an emitter
    # re-opened on its directory in that moment (a migration) waits for the lock, briefly.
    s = make_settings(kafka_broker.bootstrap, unique_name, tmp_path)
    em = SandboxEmitter("sb-fork", "task-a", settings=s)
    child = os.fork()
    if child == 0:  # between fork and exec: holds a copy of the lock's descriptor
        time.sleep(0.3)
        os._exit(0)
    try:
        await em.abort()
        again = SandboxEmitter("sb-fork", "task-a", settings=s)
        await again.abort()
    finally:
        os.waitpid(child, 0)
