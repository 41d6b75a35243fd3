"""What a simulated fleet is asked to do and what it reports: :class:`SimConfig` (the knobs of
:func:`trajbus.producers.simulator.simulate`) and :class:`Manifest` (per episode the (seq,
event id) pairs the broker acknowledged, the outcome and the loop span; the sandbox streams,
producer ids, duplicates, placements), written as JSON that :func:`load_manifest` reads back.

Guarantee: the manifest holds only what the broker acknowledged, so tests can compare the
pipeline's output with it exactly.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

DEFAULT_START_MS = 1_767_225_600_000  # 2026-01-01T00:00:00Z


@dataclass
class SimConfig:
    sandboxes: int = 10
    episodes: int = 3
    seed: int = 0
    tasks: list[str] = field(default_factory=lambda: ["swe-bench", "web-shop", "math-proofs"])
    tenants: list[str] = field(default_factory=lambda: ["acme", "globex", "initech"])
    nodes: int = 4
    steps_min: int = 5
    steps_max: int = 25
    loop: float = 0.1
    cycle: float = 0.05
    nonloop: float = 0.05
    crash: float = 0.05
    migrate: float = 0.1
    duplicate: float = 0.02
    shuffle_window: int = 0
    blob: float = 0.02
    blob_bytes: int = 2 * 1024 * 1024
    trace_line_bytes: int = 400
    start_ms: int = DEFAULT_START_MS
    durability: str = "os"
    concurrency: int = 256
    # > 0: nodes keep reporting every this many wall-clock seconds while the fleet runs (a live
    # scheduler marks nodes stale without reports); 0: one burst at the start (deterministic);
    # None: 0.5 when waiting for placements, else 0.
    node_report_every_s: float | None = None
    # Closed loop: each sandbox starts only once the scheduler placed it (see the module doc).
    wait_for_placement: bool = True
    first_decision_timeout_s: float = 120.0  # no decision about a request by then: an error
    placement_timeout_s: float = 600.0  # not placed by then (from the request): an error
    # Closed loop: a sandbox that ran a looping episode waits up to this long, before it
    # drains, for the scheduler's TERMINATE about it, and acknowledges it (DecisionAck), as a
    # runtime that stops the agent would; 0: never waits (it acknowledges one seen already).
    terminate_wait_s: float = 30.0


@dataclass
class EpisodeRecord:
    task: str
    sandbox: str
    episode: str
    behaviour: str
    outcome: str | None = None  # TERMINAL, TRUNCATED, or None (never ended)
    final_seq: int | None = None
    acked: list[tuple[int, str]] = field(default_factory=list)
    loop_span: tuple[int, int] | None = None  # (first_seq, last_seq) of the repetition


@dataclass
class Manifest:
    config: dict[str, Any]
    episodes: list[EpisodeRecord]
    sandbox_streams: dict[str, list[tuple[int, str]]]
    producer_ids: dict[str, list[str]]
    duplicates_sent: int
    events_acked: int
    blobs: int
    # closed loop: sandbox -> {"decisions": [kinds in order], "node", "waited_s"}
    placements: dict[str, dict[str, Any]] = field(default_factory=dict)
    # closed loop: sandbox -> event id of the scheduler's TERMINATE it acknowledged
    terminate_acks: dict[str, str] = field(default_factory=dict)

    @property
    def loops(self) -> list[EpisodeRecord]:
        return [e for e in self.episodes if e.behaviour in ("loop", "cycle")]

    def to_json(self) -> dict[str, Any]:
        return {
            "config": self.config,
            "episodes": [asdict(e) for e in self.episodes],
            "sandbox_streams": self.sandbox_streams,
            "producer_ids": self.producer_ids,
            "loops": [{"task": e.task, "sandbox": e.sandbox, "episode": e.episode,
                       "kind": e.behaviour, "first_seq": e.loop_span[0] if e.loop_span else None,
                       "last_seq": e.loop_span[1] if e.loop_span else None}
                      for e in self.loops],
            "duplicates_sent": self.duplicates_sent,
            "events_acked": self.events_acked,
            "blobs": self.blobs,
            "placements": self.placements,
            "terminate_acks": self.terminate_acks,
        }

    def write(self, path: str | Path) -> None:
        p = Path(path)
        p.parent.mkdir(parents=True, exist_ok=True)
        tmp = p.with_suffix(p.suffix + ".tmp")
        tmp.write_text(json.dumps(self.to_json(), indent=1))
        tmp.replace(p)


def load_manifest(path: str | Path) -> dict[str, Any]:
    data: dict[str, Any] = json.loads(Path(path).read_text())
    return data
