"""The topic catalog: every topic trajbus uses, with its partitions, retention and compaction.

Keys decide ordering: sandbox-side topics are keyed by sandbox id, so one sandbox's events
stay in one partition; replay and late topics are keyed by :func:`episode_record_key`
(``sandbox/episode``): one episode stays in one partition, and episodes spread over all
partitions (episode ids repeat across sandboxes, so the bare id would use only a few).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from trajbus.bus.settings import Settings

DAY_MS = 24 * 3600 * 1000
WRAP_HEADROOM = 1024 * 1024
_TASK_RE = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9._-]{0,120}$")


def episode_record_key(sandbox: str, episode: str) -> bytes:
    """The Kafka key of an episode's records on replay and late topics."""
    return f"{sandbox}/{episode}".encode()


@dataclass(frozen=True, slots=True)
class TopicSpec:
    name: str
    partitions: int
    doc: str
    key: str
    retention_ms: int = 7 * DAY_MS
    compacted: bool = False
    max_message_bytes: int | None = None
    configs: dict[str, str] = field(default_factory=dict)

    def kafka_configs(self) -> dict[str, str]:
        cfg = {
            "retention.ms": str(self.retention_ms),
            "cleanup.policy": "compact" if self.compacted else "delete",
        }
        if self.max_message_bytes:
            cfg["max.message.bytes"] = str(self.max_message_bytes)
        cfg.update(self.configs)
        return cfg


class Topics:
    """Topic names, derived from the settings' prefix."""

    def __init__(self, settings: Settings) -> None:
        p = settings.topics.prefix
        n = settings.topics.partitions
        big = settings.topics.max_message_bytes
        # Derived records wrap an input record (a dead letter, a one-event replay segment):
        # their topics accept a little more, so the largest valid input always fits.
        self.derived_max_bytes = derived = big + WRAP_HEADROOM
        self.prefix = p
        self.sandbox_events = f"{p}.sandbox.events"
        self.trace_chunks = f"{p}.trace.chunks"
        self.control = f"{p}.control"
        self.nodes = f"{p}.fleet.nodes"
        self.decisions = f"{p}.scheduler.decisions"
        self.alerts = f"{p}.watchdog.alerts"
        self.deadletter = f"{p}.deadletter"
        self.deadletter_status = f"{p}.deadletter-status"
        self.late = f"{p}.late"
        self.schemas = f"{p}.schemas"
        # The processors' timeouts count from a record's log time (its Kafka timestamp): on
        # the topics the fleet writes, that is the broker's append time, so a sandbox whose
        # clock is off cannot move it.
        append_time = {"message.timestamp.type": "LogAppendTime"}
        self._specs = [
            TopicSpec(self.sandbox_events, n, "lifecycle, heartbeats, probes, tool calls and "
                      "results, episode start/end, drained", "sandbox", configs=append_time),
            TopicSpec(self.trace_chunks, n, "trace chunks (inline bytes or claim-check refs)",
                      "sandbox", max_message_bytes=big, configs=append_time),
            TopicSpec(self.control, 1, "sandbox requests, trainer releases, ticks: the "
                      "scheduler's single ordered input", "tenant", configs=append_time),
            TopicSpec(self.nodes, 1, "node resource reports (~every 500 ms)", "node",
                      retention_ms=DAY_MS, configs=append_time),
            TopicSpec(self.decisions, n, "scheduling decisions with reasons", "sandbox"),
            TopicSpec(self.alerts, n, "watchdog alerts with evidence", "sandbox"),
            TopicSpec(self.deadletter, n, "input a processor could not accept, with reason "
                      "and original bytes", "source key", retention_ms=30 * DAY_MS,
                      max_message_bytes=derived),
            TopicSpec(self.deadletter_status, 1, "what was done about a dead letter: "
                      "re-driven (where to) or resolved (with a note); compacted, latest wins",
                      "dead letter id", retention_ms=-1, compacted=True),
            TopicSpec(self.late, n, "events that arrived after their gap was closed", "episode",
                      max_message_bytes=derived),
            TopicSpec(self.schemas, 1, "writer schemas by fingerprint (compacted)",
                      "fingerprint hex", retention_ms=-1, compacted=True),
        ]

    def replay(self, task: str) -> str:
        """The per-task replay topic for trainers."""
        return f"{self.prefix}.replay.{validate_name('task', task)}"

    def replay_spec(
        self, task: str, partitions: int = 6, max_bytes: int | None = None
    ) -> TopicSpec:
        return TopicSpec(self.replay(task), partitions, f"ordered replay segments of task {task}",
                         "sandbox/episode", max_message_bytes=max_bytes)

    @property
    def specs(self) -> list[TopicSpec]:
        return list(self._specs)

    @property
    def input_topics(self) -> list[str]:
        return [self.sandbox_events, self.trace_chunks]

    @property
    def context_areas(self) -> dict[str, str]:
        """The decision context the archiver keeps beside the events: topic -> archive area.
        Scheduling decisions (the scheduler's and the watchdog's, told apart by producer),
        watchdog alerts and dead letters."""
        return {self.decisions: "decisions", self.alerts: "alerts",
                self.deadletter: "dead_letters"}

    @property
    def archive_topics(self) -> list[str]:
        """What ``trajbus archive run`` reads by default: the input topics and the context."""
        return [*self.input_topics, *self.context_areas]


def validate_name(what: str, value: str) -> str:
    """Task and sandbox ids end up in topic names and archive paths: allow a safe alphabet only."""
    if not _TASK_RE.match(value) or ".." in value:
        raise ValueError(
            f"invalid {what} id {value!r}: use letters, digits, '.', '_' or '-' "
            "(at most 121 characters, no '..', not starting with '.' or '-')"
        )
    return value
