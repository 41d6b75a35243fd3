"""Claim-check: large blobs stored once under a content-addressed key; readers verify sha256."""

from __future__ import annotations

import asyncio
import hashlib
import os

import pytest

from trajbus.archive.blobs import fetch_blob
from trajbus.bus import producer as producer_mod
from trajbus.bus.producer import close_producer
from trajbus.bus.topics import Topics
from trajbus.producers.claimcheck import BlobIntegrityError, ClaimCheck, blob_key
from trajbus.producers.emitter import SandboxEmitter
from trajbus.producers.testing import create_topics, make_settings, read_topics
from trajbus.schemas.models import BlobRef

pytestmark = [pytest.mark.timeout(120)]


@pytest.fixture(autouse=True)
async def _close_shared_producer():
    yield
    if producer_mod._loop is asyncio.get_running_loop():
        await close_producer()


def test_key_layout_and_single_store(tmp_path):
    cc = ClaimCheck(url=str(tmp_path / "arch"), threshold=10)
    data = os.urandom(1000)
    sha = hashlib.sha256(data).hexdigest()
    ref = cc.put(data, "image/png")
    again = cc.put(data, "image/png")
    assert ref == again and cc.puts == 1 and cc.skipped == 1
    assert blob_key(sha) == f"blobs/sha256/{sha[:2]}/{sha[2:4]}/{sha}"
    assert ref.uri.endswith(blob_key(sha)) and ref.size == 1000
    assert fetch_blob(ref) == data
    (tmp_path / "arch" / blob_key(sha)).write_bytes(b"tampered")
    with pytest.raises(BlobIntegrityError):
        fetch_blob(ref)
    with pytest.raises(BlobIntegrityError):
        fetch_blob(BlobRef(uri=ref.uri, size=ref.size, sha256="0" * 64))


def test_s3_store(s3_server):
    import boto3

    boto3.client("s3", endpoint_url=s3_server).create_bucket(Bucket="blobs-test")
    cc = ClaimCheck(url="s3://blobs-test/trajbus", endpoint_url=s3_server, threshold=10)
    data = os.urandom(5000)
    ref = cc.put(data)
    assert ref.uri.startswith("s3://blobs-test/trajbus/blobs/sha256/")
    assert fetch_blob(ref, endpoint_url=s3_server) == data


@pytest.mark.kafka
async def test_emitter_claim_checks_large_chunks(kafka_broker, unique_name, tmp_path):
    s = make_settings(kafka_broker.bootstrap, unique_name, tmp_path, claim_check_threshold=100_000)
    s.archive.url = str(tmp_path / "archive")
    await create_topics(s)
    big = os.urandom(3 * 1024 * 1024)
    async with SandboxEmitter("sb-cc", "task-a", settings=s) as em:
        await em.start_episode("e")
        await em.trace_chunk("e", b"small\n", file_offset=0)
        await em.trace_chunk("e", big, file_offset=6, content_type="image/png")
    seen = await read_topics(s, [Topics(s).trace_chunks], lambda xs: len(xs) >= 2)
    small, large = sorted(seen, key=lambda x: x.header["seq"])
    assert small.record["data"] == b"small\n" and small.record["blob"] is None
    assert large.record["data"] is None and len(large.value) < 4096
    ref = BlobRef(**large.record["blob"])
    assert ref.size == len(big) and ref.content_type == "image/png"
    assert fetch_blob(ref) == big
    assert large.record["sha256"] == ref.sha256 == hashlib.sha256(big).hexdigest()


@pytest.mark.kafka
async def test_archived_episode_trace_includes_claim_check_blobs(kafka_broker, unique_name,
                                                                 tmp_path, capsys):
    """A trace of an inline chunk, a claim-checked chunk and an inline tail, archived, is
    rebuilt whole by `trajbus archive episode --trace-out` (the blob fetched and verified);
    `--no-blobs` leaves the blob out and names it; a tampered blob is refused."""
    import argparse

    from trajbus.archive import cli as archive_cli
    from trajbus.archive.archiver import run_archiver
    from trajbus.archive.storage import open_store
    from trajbus.producers.claimcheck import blob_key

    s = make_settings(kafka_broker.bootstrap, unique_name, tmp_path, claim_check_threshold=100_000)
    s.archive.url = str(tmp_path / "archive")
    s.archive.spool_dir = str(tmp_path / "spool")
    await create_topics(s)
    head, big, tail = b"head\n", os.urandom(300_000), b"tail\n"
    async with SandboxEmitter("sb-cc", "task-a", settings=s) as em:
        await em.start_episode("e")
        await em.trace_chunk("e", head, file_offset=0)
        await em.trace_chunk("e", big, file_offset=len(head), content_type="image/png")
        await em.trace_chunk("e", tail, file_offset=len(head) + len(big))
        await em.end_episode("e")
    stats = await run_archiver(s, until_idle=True, dead_letter=lambda *a: None)
    assert stats.rows >= 5

    def cli(*argv: str) -> int:
        parser = argparse.ArgumentParser(prog="trajbus")
        archive_cli.register(parser.add_subparsers(dest="cmd"))
        args = parser.parse_args(["archive", "--url", s.archive.url, "episode", "--task",
                                  "task-a", "--sandbox", "sb-cc", "--episode", "e", *argv])
        return int(args.func(args))

    out = tmp_path / "e.trace"
    assert cli("--trace-out", str(out)) == 0
    assert out.read_bytes() == head + big + tail
    assert cli("--trace-out", str(out), "--no-blobs") == 0
    assert out.read_bytes() == head + b"\0" * len(big) + tail
    assert "1 claim-check chunks left out" in capsys.readouterr().err
    # tamper with the blob: the rebuilt trace is refused, not silently wrong
    store = open_store(s.archive.url)
    key = blob_key(hashlib.sha256(big).hexdigest())
    store.put_bytes(key, b"x" * len(big))
    from trajbus.archive import blobs

    blobs._stores.clear()
    assert cli("--trace-out", str(tmp_path / "bad.trace")) == 1
    assert "cannot fetch a claim-check blob" in capsys.readouterr().err
