"""What ``trajbus watchdog explain`` shows: for one stream, why the loop rule fired or did not,
candidate by candidate."""

from __future__ import annotations

from dataclasses import dataclass

from .rules import LoopRules


@dataclass(frozen=True, slots=True)
class CandidateExplanation:
    """The current window for one cycle length and what keeps it from firing."""

    cycle_length: int
    pattern: tuple[str, ...]
    calls: int
    repeat_count: int
    span_ms: int
    first_seq: int
    result_changes: int
    primitive: bool
    since: str
    blockers: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class Explanation:
    """Why the loop rule fired or did not, for one stream (``trajbus watchdog explain``)."""

    task: str
    sandbox: str
    episode: str | None
    rules: LoopRules
    last_seq: int
    last_event_time_ms: int
    calls_seen: int
    open_calls: int
    stalled: bool
    loop_active: bool
    loop_cycle_length: int
    candidates: tuple[CandidateExplanation, ...]

    @property
    def verdict(self) -> str:
        if self.loop_active:
            return f"LOOP active (cycle length {self.loop_cycle_length}); alert already sent"
        if any(not c.blockers for c in self.candidates):
            return "loop conditions met (fires on the next tool event)"
        return "no loop"

    def render(self) -> str:
        r = self.rules
        lines = [
            f"sandbox {self.sandbox} episode {self.episode} task {self.task}: {self.verdict}",
            f"  thresholds: repeats>={r.loop_min_repeats} span>={r.loop_min_span_ms}ms "
            f"result changes<={r.loop_max_distinct_results} cycles<={r.max_cycle_length} "
            f"dry_run={r.dry_run}",
            f"  calls={self.calls_seen} last_seq={self.last_seq} open_calls={self.open_calls} "
            f"stalled={self.stalled}",
        ]
        for c in self.candidates:
            state = "MET" if not c.blockers else "; ".join(c.blockers)
            lines.append(
                f"  L={c.cycle_length} pattern={list(c.pattern)} repeats={c.repeat_count} "
                f"span={c.span_ms}ms first_seq={c.first_seq} changes={c.result_changes} "
                f"since: {c.since} -> {state}"
            )
        return "\n".join(lines)

