"""The reorder on Quix Streams (``quix-eos``): ``processing_guarantee="exactly-once"``, RocksDB
state with its changelog, the same reorder as a stateful ``apply`` keyed by sandbox
(``peer_quix``, run as ``bench_worker.py --peer quix-eos``); and the virtualenv it runs from
(``quix_python``): Quix Streams pins other versions than trajbus's environment, so it gets
one of its own, created on first use from pyproject.toml's ``bench-quix`` pin."""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from peers.reorder_loop import load_schemas, make_decoder

ROOT = Path(__file__).resolve().parents[2]
QUIX_VENV = ROOT / ".trajbus" / "venv-quix"


def peer_quix(a: argparse.Namespace) -> int:
    from quixstreams import Application
    from quixstreams.models.serializers import Deserializer, Serializer

    decode = make_decoder(load_schemas(a.schemas))

    class EventIn(Deserializer):
        """Avro single-object -> (episode key, seq, raw) (None for ticks / no episode)."""

        def __call__(self, value: bytes, ctx: Any) -> Any:
            h = decode(value)["header"]
            ep = h["episode"]
            if ep is None:
                return None
            return (f"{h['sandbox']}/{ep}", h["seq"], value)

    class EventOut(Serializer):
        def __call__(self, value: Any, ctx: Any) -> bytes:
            return bytes(value[1])

    app = Application(
        broker_address=a.bootstrap, consumer_group=a.group, auto_offset_reset="earliest",
        processing_guarantee="exactly-once", commit_interval=a.quix_commit_interval,
        state_dir=tempfile.mkdtemp(prefix="bench-worker-quix-"), use_changelog_topics=True,
        producer_extra_config={"compression.type": a.compression, "linger.ms": 5},
        consumer_extra_config={"isolation.level": "read_committed"},
        loglevel="WARNING")
    topics = [app.topic(t, value_deserializer=EventIn(), key_deserializer="bytes")
              for t in a.in_topics.split(",")]
    out = app.topic(a.out_topic, value_serializer=EventOut(), key_serializer="bytes")

    def reorder(value: Any, state: Any) -> list[tuple[bytes, bytes]]:
        # state is scoped to the message key (the sandbox); one entry per episode:
        # [next seq, {seq: event as latin-1 text}] (state values are JSON)
        key, seq, raw = value
        st = state.get(key)
        if st is None:
            st = [0, {}]
        nxt, buf = st
        s = str(seq)
        if seq < nxt or s in buf:
            return []
        if seq > nxt:
            buf[s] = raw.decode("latin-1")
            state.set(key, st)
            return []
        kb = key.encode()
        released = [(kb, raw)]
        nxt += 1
        while buf:
            early = buf.pop(str(nxt), None)
            if early is None:
                break
            released.append((kb, early.encode("latin-1")))
            nxt += 1
        st[0] = nxt
        state.set(key, st)
        return released

    for topic in topics:
        sdf = app.dataframe(topic)
        sdf = sdf.filter(lambda v: v is not None)
        sdf = sdf.apply(reorder, stateful=True, expand=True)
        sdf.to_topic(out, key=lambda v: v[0])
    app.run(timeout=a.idle, collect=False)
    return 0


def quix_python(a: argparse.Namespace, notes: list[str]) -> str | None:
    """The interpreter of the Quix Streams virtualenv (created on first use), or None."""
    check = ["-c", "import quixstreams, fastavro; print(quixstreams.__version__)"]
    if a.quix_python:
        py = a.quix_python
    else:
        py = str(QUIX_VENV / "bin" / "python")
        if not Path(py).exists() or subprocess.run([py, *check], capture_output=True).returncode:
            pin = quix_pin()
            print(f"[worker] creating {QUIX_VENV} with {pin} (first run only)", flush=True)
            try:
                subprocess.run([sys.executable, "-m", "venv", str(QUIX_VENV)], check=True,
                               capture_output=True, timeout=300)
                subprocess.run([py, "-m", "pip", "install", "-q", pin, "fastavro"], check=True,
                               capture_output=True, timeout=600)
            except (subprocess.SubprocessError, OSError) as exc:
                err = getattr(exc, "stderr", b"") or b""
                notes.append(f"quix-eos skipped: installing {pin} into {QUIX_VENV} failed: "
                             f"{exc} {err.decode(errors='replace')[-300:]}")
                return None
    got = subprocess.run([py, *check], capture_output=True, text=True)
    if got.returncode:
        notes.append(f"quix-eos skipped: {py} cannot import quixstreams: {got.stderr[-300:]}")
        return None
    notes.append(f"quix-eos: Quix Streams {got.stdout.strip()} from {py}")
    return py


def quix_pin() -> str:
    """The quixstreams requirement of pyproject.toml's bench-quix extra."""
    import tomllib

    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"]
    for req in extras.get("bench-quix", []):
        if req.startswith("quixstreams"):
            return str(req)
    return "quixstreams"
