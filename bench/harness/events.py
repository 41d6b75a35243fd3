"""Event records for the benchmarks' inputs: Avro-ready templates of the four event kinds,
the schemas file the peers decode with, probe records (one new episode per partition), and
late sends (``displace_late``)."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any


def event_templates() -> tuple[dict[str, Any], ...]:
    """Avro-ready records of EpisodeStart, ToolCall, ToolResult and EpisodeEnd (built once
    through the models, so every field is present); copy one and set the header and fields."""
    from trajbus.schemas import models as m

    def tmpl(ev: Any) -> dict[str, Any]:
        return m._avro_ready(ev.to_record())

    hdr = m.Envelope(event_id="x", task="t", sandbox="s", episode="e", seq=0, producer_id="p")
    return (tmpl(m.EpisodeStart(header=hdr, tenant="team-a", context={"dataset": "v3"})),
            tmpl(m.ToolCall(header=hdr, call_id="c", tool="shell", args_hash="0" * 64)),
            tmpl(m.ToolResult(header=hdr, call_id="c", tool="shell", status=m.ToolStatus.OK,
                              result_hash="0" * 64, duration_ms=1)),
            tmpl(m.EpisodeEnd(header=hdr, outcome=m.EpisodeOutcome.TERMINAL)))


def write_schemas(path: Path) -> None:
    """{fingerprint hex: {kind, parsing canonical form}} of every bundled schema, for the peers
    (which decode with fastavro alone)."""
    from trajbus.schemas.codec import default_codec

    reg = default_codec().registry
    path.write_text(json.dumps({
        info.fingerprint.hex(): {"kind": info.short_name, "canonical": info.canonical}
        for info in (reg.reader(n) for n in reg.names)}))


def probe_records(partitions: int, task: str, tag: str
                  ) -> tuple[list[tuple[bytes, bytes, int | None]], dict[bytes, int]]:
    """One EpisodeStart of a new sandbox/episode per input partition; the replay keys."""
    from trajbus.bus.topics import episode_record_key
    from trajbus.schemas import models as m

    recs: list[tuple[bytes, bytes, int | None]] = []
    keys: dict[bytes, int] = {}
    for p in range(partitions):
        sb = ep = f"probe-{tag}-p{p}"
        ev = m.EpisodeStart(header=m.Envelope(event_id=f"{ep}-0", task=task, sandbox=sb,
                                              episode=ep, seq=0, producer_id=f"sandbox/{sb}"))
        recs.append((sb.encode(), ev.encode(), p))
        keys[episode_record_key(sb, ep)] = p
    return recs, keys


def displace_late(evs: list[Any], rng: random.Random, fraction: float) -> None:
    """In place: about ``fraction`` of the items move 1-3 places later (a late send)."""
    j = 0
    while j < len(evs) - 1:
        if rng.random() < fraction:
            k = min(len(evs) - 1, j + rng.randint(1, 3))
            evs.insert(k, evs.pop(j))
            j = k + 1
        else:
            j += 1
