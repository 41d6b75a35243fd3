"""The reorder worker's per-record fast path against the full path it replaced (issue 17, item
2): the same input log gives byte-identical outputs (replay segments, late events, dead
letters, in the same order) and the same changelog.

The full path is the adapter as it was: every record decoded whole with ``Codec.decode`` and
the core's input built by ``InEvent.from_decoded``. The fast path decodes the header first
(``Codec.decode_head``: the body checked, not built). The logs are random: shuffled episodes of
every reordered kind, exact and conflicting duplicates, sandbox-level events (heartbeats,
recycling, drained final seqs), ids the worker refuses, records written with an older schema,
corrupt and foreign bytes, ticks on both inputs; in random batch sizes, as the runner's fetches
cut them. Pure: no broker."""

from __future__ import annotations

import io
import json
import random
from typing import Any

import pytest
from fastavro import schemaless_writer

from trajbus.bus.settings import ReplaySettings, Settings
from trajbus.consumers.engine.processors import ReorderProcessor
from trajbus.consumers.engine.runner import InRecord, OutRecord
from trajbus.consumers.replay.core import InEvent
from trajbus.schemas import models as m
from trajbus.schemas.codec import MAGIC, Decoded, Head, default_codec
from trajbus.schemas.registry import default_registry

codec = default_codec()
T0 = 1_700_000_000_000
EVENTS, CHUNKS = "t.sandbox.events", "t.trace.chunks"


class FullDecodePath(ReorderProcessor):
    """The reference: the adapter's path before the header-first decode."""

    _decoded: Decoded

    def _decode_head(self, rec: InRecord, outs: list[OutRecord]) -> Head | None:
        decoded = self.decode(rec, outs)  # Codec.decode; a dead letter when it raises
        if decoded is None:
            return None
        self._decoded = decoded
        return Head(decoded.kind, decoded.record["header"], {})

    def _event(self, rec: InRecord, head: Head) -> InEvent:
        return InEvent.from_decoded(self._decoded, rec.value, rec.timestamp_ms)


def _old_writer_toolcall(header: dict[str, Any], i: int) -> bytes:
    """A ToolCall written by an older producer (no args_summary): resolved on decode."""
    old = json.loads(default_registry().reader("ToolCall").canonical)
    old["fields"] = [f for f in old["fields"] if f["name"] != "args_summary"]
    info = default_registry().register_writer(old)
    buf = io.BytesIO()
    buf.write(MAGIC + info.fingerprint)
    schemaless_writer(buf, info.parsed, {"header": header, "call_id": f"c{i}", "tool": "exec",
                                         "args_hash": "ab", "args_canonical": None})
    return buf.getvalue()


def _corrupt(rng: random.Random, raw: bytes) -> bytes:
    b = bytearray(raw)
    op = rng.randrange(6)
    if op == 0:  # a flipped byte in the body
        i = rng.randrange(10, len(b))
        b[i] ^= 1 << rng.randrange(8)
    elif op == 1:  # truncated
        del b[rng.randrange(10, len(b)):]
    elif op == 2:  # trailing bytes
        b += bytes([rng.randrange(256)])
    elif op == 3:  # varint-ish and invalid UTF-8 bytes
        for _ in range(3):
            b[rng.randrange(10, len(b))] = rng.choice([0x80, 0xFF, 0x01, 0xC3, 0xED, 0x7F])
    elif op == 4:  # unknown fingerprint
        b[2:10] = rng.randbytes(8)
    else:  # not Avro at all
        return rng.randbytes(rng.randrange(0, 40))
    return bytes(b)


def _log(seed: int, n_sandboxes: int = 6) -> list[InRecord]:
    rng = random.Random(seed)
    stream: list[tuple[str, bytes]] = []  # (topic, bytes)

    def header(sb: str, ep: str | None, seq: int, t: int, task: str = "task-a",
               event_id: str | None = None) -> m.Envelope:
        return m.Envelope(event_id=f"{sb}-{ep}-{seq}" if event_id is None else event_id,
                          task=task, sandbox=sb, episode=ep, seq=seq, event_time_ms=t,
                          producer_id="test", policy_version=rng.choice([None, 3]))

    for s in range(n_sandboxes):
        sb = f"sb-{s}"
        t = T0 + rng.randrange(5000)
        finals: dict[str, int] = {}
        for e in range(rng.randint(1, 3)):
            ep = f"ep-{seed}-{s}-{e}"
            evs: list[tuple[str, bytes]] = [(EVENTS, m.EpisodeStart(
                header=header(sb, ep, 0, t), context={"k": "v" * rng.randrange(3)}).encode())]
            steps = rng.randint(1, 8)
            seq = 0
            for i in range(steps):
                seq += 1
                kind = rng.choice(["ToolCall", "ToolResult", "TraceChunk", "old"])
                hdr = header(sb, ep, seq, t + seq)
                if kind == "old":
                    raw = _old_writer_toolcall(hdr.model_dump(mode="json"), i)
                else:
                    from trajbus.schemas.samples import sample_event

                    raw = sample_event(kind, hdr, i).encode()
                evs.append((CHUNKS if kind == "TraceChunk" else EVENTS, raw))
                if rng.random() < 0.08:  # a conflicting duplicate: same seq, other content
                    evs.append((EVENTS, m.ToolCall(header=hdr, call_id="other", tool="x",
                                                   args_hash="ff").encode()))
            if rng.random() < 0.7:
                seq += 1
                outcome = rng.choice([m.EpisodeOutcome.TERMINAL, m.EpisodeOutcome.TRUNCATED])
                evs.append((EVENTS, m.EpisodeEnd(header=header(sb, ep, seq, t + seq),
                                                 outcome=outcome, reward=0.5).encode()))
            else:
                finals[ep] = seq + rng.choice([0, 0, 1])  # drained; sometimes one missing
            if rng.random() < 0.15:  # an event after the end
                evs.append((EVENTS, m.ToolCall(header=header(sb, ep, seq + 3, t), call_id="x",
                                               tool="x", args_hash="x").encode()))
            stream += evs
            t += 100
        # sandbox-level stream
        stream.append((EVENTS, m.Heartbeat(header=header(sb, None, 1, t)).encode()))
        if finals:
            stream.append((EVENTS, m.Drained(header=header(sb, None, 2, t), final_seqs=[
                m.EpisodeFinalSeq(episode=k, final_seq=v) for k, v in finals.items()],
                complete=True).encode()))
        if rng.random() < 0.5:
            stream.append((EVENTS, m.SandboxLifecycle(
                header=header(sb, None, 3, t), state=m.LifecycleState.RECYCLED,
                reason="test").encode()))
    # ids and shapes the adapter refuses
    stream.append((EVENTS, m.ToolCall(header=header("sb-0", "ep-x", 1, T0, task="bad/task"),
                                      call_id="c", tool="t", args_hash="h").encode()))
    stream.append((EVENTS, m.ToolCall(header=header("sb-0", "ep-y", 1, T0, event_id=""),
                                      call_id="c", tool="t", args_hash="h").encode()))
    stream.append((EVENTS, m.ToolCall(header=header("sb-0", None, 1, T0), call_id="c",
                                      tool="t", args_hash="h").encode()))
    # exact duplicates, corrupt copies, local disorder
    stream += [x for x in stream if rng.random() < 0.15]
    stream += [(tp, _corrupt(rng, raw)) for tp, raw in stream if rng.random() < 0.08]
    for i in range(0, len(stream), 10):
        chunk = stream[i:i + 10]
        rng.shuffle(chunk)
        stream[i:i + 10] = chunk
    # the log: ticks on both inputs now and then (the watermark), then long enough for every
    # gap, recycle grace and tombstone to time out
    out: list[InRecord] = []
    now = T0
    offsets = {EVENTS: 0, CHUNKS: 0}

    def add(topic: str, key: bytes, value: bytes) -> None:
        out.append(InRecord(topic, 0, offsets[topic], key, value, now))
        offsets[topic] += 1

    def ticks() -> None:
        for topic in (EVENTS, CHUNKS):
            add(topic, b"_tick", m.Tick(header=m.Envelope(
                task="_tick", sandbox="_tick", seq=0, event_time_ms=now,
                producer_id="test")).encode())

    for i, (topic, raw) in enumerate(stream):
        add(topic, b"k", raw)
        if i % 13 == 0:
            now += 700
            ticks()
    for _ in range(20):
        now += 3000
        ticks()
    return out


def _settings() -> Settings:
    s = Settings()
    s.topics.prefix = "t"
    s.replay = ReplaySettings(gap_timeout_ms=3000, tombstone_ttl_ms=20_000,
                              max_buffered_per_episode=6, max_open_episodes_per_sandbox=2)
    return s


def _run(proc: ReorderProcessor, log: list[InRecord], seed: int) -> list[Any]:
    """Outputs (topic, key, value) and changelog records, batch by batch."""
    rng = random.Random(seed)
    got: list[Any] = []
    i = 0
    while i < len(log):
        n = rng.choice([1, 3, 17, 100, 1000])
        got.append([(o.topic, o.key, o.value) for o in proc.handle_batch(log[i:i + n])])
        got.append(proc.take_dirty())
        i += n
    got.append(proc.core.counters())
    return got


@pytest.mark.parametrize("seed", range(12))
def test_the_fast_path_writes_exactly_what_the_full_decode_path_wrote(seed: int) -> None:
    log = _log(seed)
    full = _run(FullDecodePath(_settings()), log, seed)
    fast = _run(ReorderProcessor(_settings()), log, seed)
    assert fast == full
    # the log exercised what it is meant to
    outs = [o for batch in full[:-1][0::2] for o in batch]
    topics = {t for t, _, _ in outs}
    assert {"t.replay.task-a", "t.deadletter"} <= topics, topics
    reasons = {codec.decode(v).record["reason_code"] for t, _, v in outs if t == "t.deadletter"}
    assert {"corrupt_body", "invalid_id"} & reasons, reasons


def test_records_of_the_current_schemas_are_never_decoded_whole() -> None:
    proc = ReorderProcessor(_settings())
    proc.codec = type(codec)(codec.registry)  # a codec of its own, to watch
    whole: list[bytes] = []
    decode = proc.codec.decode
    proc.codec.decode = lambda data: whole.append(data) or decode(data)  # type: ignore
    current = {codec.registry.reader(k).fingerprint for k in (
        "ToolCall", "ToolResult", "TraceChunk", "EpisodeStart", "EpisodeEnd", "Heartbeat",
        "SandboxLifecycle", "Tick")}
    log = []
    for r in _log(3):
        try:
            codec.decode(r.value)
        except Exception:
            continue
        if r.value[2:10] in current:
            log.append(r)
    assert len(log) > 100
    proc.handle_batch(log)
    assert whole == []
