"""The minimal consume/reorder/produce loop the reorder worker is measured beside, on
confluent-kafka (``peer_confluent``) and on aiokafka (``peer_aiokafka``): consume, fastavro
decode of the Avro single-object encoding (fingerprint -> writer schema), the per-episode
reorder (``Reorder``), each released event produced (its original bytes, key
``sandbox/episode``) with a changelog record per touched episode every ``--txn-interval-ms``:
in a transaction with the consumed offsets (``-txn``) or flushed before the offsets are
committed (at-least-once). Each runs as ``bench_worker.py --peer NAME`` in its own process."""

from __future__ import annotations

import argparse
import io
import json
import struct
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

TICK_KEY = b"_tick"
HEADER_LEN = 10  # Avro single-object header: C3 01 + 8-byte fingerprint


def _conf(bootstrap: str, **extra: Any) -> dict[str, Any]:
    return {"bootstrap.servers": bootstrap, **extra}


def load_schemas(path: str) -> dict[bytes, tuple[str, Any]]:
    from fastavro import parse_schema

    raw = json.loads(Path(path).read_text())
    return {bytes.fromhex(fp): (s["kind"], parse_schema(json.loads(s["canonical"])))
            for fp, s in raw.items()}


class Reorder:
    """The minimal per-episode reorder: next expected seq and a buffer of early events.
    Older or already buffered seqs are duplicates (dropped). ``state(key)`` is the changelog
    value: next seq, then the buffered events (length-prefixed)."""

    __slots__ = ("eps",)

    def __init__(self) -> None:
        self.eps: dict[str, list[Any]] = {}

    def add(self, key: str, seq: int, raw: bytes) -> list[bytes]:
        st = self.eps.get(key)
        if st is None:
            st = self.eps[key] = [0, {}]
        nxt, buf = st[0], st[1]
        if seq < nxt or seq in buf:
            return []
        if seq > nxt:
            buf[seq] = raw
            return []
        out = [raw]
        nxt += 1
        while buf:
            early = buf.pop(nxt, None)
            if early is None:
                break
            out.append(early)
            nxt += 1
        st[0] = nxt
        return out

    def state(self, key: str) -> bytes:
        nxt, buf = self.eps[key]
        parts = [struct.pack("<qI", nxt, len(buf))]
        for seq in sorted(buf):
            parts.append(struct.pack("<qI", seq, len(buf[seq])))
            parts.append(buf[seq])
        return b"".join(parts)


def make_decoder(schemas: dict[bytes, tuple[str, Any]]) -> Callable[[bytes], dict[str, Any]]:
    from fastavro import schemaless_reader

    def decode(raw: bytes) -> dict[str, Any]:
        _, schema = schemas[raw[2:HEADER_LEN]]
        buf = io.BytesIO(raw)
        buf.seek(HEADER_LEN)
        rec: dict[str, Any] = schemaless_reader(buf, schema, None)  # type: ignore[assignment]
        return rec

    return decode


def peer_confluent(a: argparse.Namespace) -> int:
    from confluent_kafka import Consumer, KafkaError, Producer

    decode = make_decoder(load_schemas(a.schemas))
    txn = a.peer.endswith("-txn")
    c = Consumer(_conf(a.bootstrap, **{
        "group.id": a.group, "enable.auto.commit": False, "auto.offset.reset": "earliest",
        "isolation.level": "read_committed"}))
    pconf = _conf(a.bootstrap, **{"compression.type": a.compression, "linger.ms": 5,
                                  "enable.idempotence": True, "acks": "all",
                                  "queue.buffering.max.messages": 1_000_000})
    if txn:
        pconf["transactional.id"] = f"{a.group}.txn"
    p = Producer(pconf)
    if txn:
        p.init_transactions(60)
    c.subscribe(a.in_topics.split(","))
    r = Reorder()
    add, produce, out_topic = r.add, p.produce, a.out_topic
    dirty: dict[str, int] = {}
    in_txn = False
    pending = False
    last_commit = last_data = time.monotonic()
    interval = a.txn_interval_ms / 1000

    def commit() -> None:
        nonlocal in_txn, pending
        for key, part in dirty.items():
            produce(a.state_topic, r.state(key), key=key.encode(), partition=part)
        dirty.clear()
        if txn:
            p.send_offsets_to_transaction(c.position(c.assignment()),
                                          c.consumer_group_metadata(), 60)
            p.commit_transaction(60)
            in_txn = False
        else:
            p.flush(60)  # outputs acknowledged before the offsets: at-least-once
            c.commit(asynchronous=False)
        pending = False

    while True:
        msgs = c.consume(2000, a.poll_ms / 1000)  # returns at 2000 records or the timeout
        now = time.monotonic()
        if msgs:
            last_data = now
            if txn and not in_txn:
                p.begin_transaction()
                in_txn = True
            for msg in msgs:
                err = msg.error()
                if err is not None:
                    if err.code() == KafkaError._PARTITION_EOF:
                        continue
                    raise RuntimeError(str(err))
                if msg.key() == TICK_KEY:
                    continue
                raw = msg.value() or b""
                h = decode(raw)["header"]
                ep = h["episode"]
                if ep is None:
                    continue
                key = f"{h['sandbox']}/{ep}"
                released = add(key, h["seq"], raw)
                if released:
                    kb = key.encode()
                    for ev in released:
                        produce(out_topic, ev, key=kb)
                dirty[key] = msg.partition() or 0
            pending = True
            p.poll(0)
        elif now - last_data > a.idle:
            break
        if pending and now - last_commit >= interval:
            commit()
            last_commit = now
    if pending:
        commit()
    c.close()
    p.flush(60)
    return 0


async def peer_aiokafka(a: argparse.Namespace) -> int:
    from aiokafka import AIOKafkaConsumer, AIOKafkaProducer

    decode = make_decoder(load_schemas(a.schemas))
    txn = a.peer.endswith("-txn")
    c = AIOKafkaConsumer(*a.in_topics.split(","), bootstrap_servers=a.bootstrap,
                         group_id=a.group, enable_auto_commit=False,
                         auto_offset_reset="earliest", isolation_level="read_committed",
                         max_poll_records=2000)
    p = AIOKafkaProducer(bootstrap_servers=a.bootstrap, compression_type=a.compression,
                         linger_ms=5, enable_idempotence=True, acks="all",
                         transactional_id=f"{a.group}.txn" if txn else None)
    await p.start()
    await c.start()
    r = Reorder()
    add, send, out_topic = r.add, p.send, a.out_topic
    dirty: dict[str, int] = {}
    offsets: dict[Any, int] = {}
    in_txn = False
    last_commit = last_data = time.monotonic()
    interval = a.txn_interval_ms / 1000

    async def commit() -> None:
        nonlocal in_txn
        for key, part in dirty.items():
            await send(a.state_topic, r.state(key), key=key.encode(), partition=part)
        dirty.clear()
        if txn:
            # the records first: a Kafka 4 broker keeps one pending transaction verification
            # per producer, and offsets sent while records are in flight make aiokafka retry
            # (the worker does the same; RELIABILITY.md)
            await p.flush()
            await p.send_offsets_to_transaction(dict(offsets), a.group)
            await p.commit_transaction()
            in_txn = False
        else:
            await p.flush()
            await c.commit(dict(offsets))
        offsets.clear()

    try:
        while True:
            batch = await c.getmany(timeout_ms=100, max_records=2000)
            now = time.monotonic()
            if batch:
                last_data = now
                if txn and not in_txn:
                    await p.begin_transaction()
                    in_txn = True
                for tp, msgs in batch.items():
                    for msg in msgs:
                        if msg.key == TICK_KEY:
                            continue
                        raw = msg.value
                        h = decode(raw)["header"]
                        ep = h["episode"]
                        if ep is None:
                            continue
                        key = f"{h['sandbox']}/{ep}"
                        released = add(key, h["seq"], raw)
                        if released:
                            kb = key.encode()
                            for ev in released:
                                await send(out_topic, ev, key=kb)
                        dirty[key] = tp.partition
                    offsets[tp] = msgs[-1].offset + 1
            elif now - last_data > a.idle:
                break
            if offsets and now - last_commit >= interval:
                await commit()
                last_commit = now
        if offsets:
            await commit()
    finally:
        await c.stop()
        await p.stop()
    return 0
