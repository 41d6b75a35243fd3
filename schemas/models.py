"""pydantic v2 models mirroring the Avro schemas in `schemas/avro/` field by field.

The `.avsc` files are the contract; these models are the typed Python face of it (a test,
`tests/unit/test_schema_models.py`, proves the two agree). Build events with them, encode with
:func:`encode_event`, decode with :func:`decode_event`. Hot paths (processor cores) work on
the decoded dicts directly and skip model validation.
"""

from __future__ import annotations

import time
import uuid
from enum import StrEnum
from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict, Field

from trajbus.schemas.codec import Codec, Decoded, default_codec


def new_event_id() -> str:
    return uuid.uuid4().hex


def now_ms() -> int:
    return time.time_ns() // 1_000_000


class Envelope(BaseModel):
    """trajbus.Envelope: the header every event carries."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    event_id: str = Field(default_factory=new_event_id)
    task: str
    sandbox: str
    episode: str | None = None
    seq: int = Field(ge=0)
    event_time_ms: int = Field(default_factory=now_ms)
    producer_id: str
    policy_version: int | None = None


class Event(BaseModel):
    """Base of every event kind. ``KIND`` is the Avro record's short name."""

    model_config = ConfigDict(extra="forbid", frozen=True, use_enum_values=False)
    KIND: ClassVar[str] = ""
    NAMESPACE: ClassVar[str] = "trajbus.events"

    header: Envelope

    def to_record(self) -> dict[str, Any]:
        return self.model_dump(mode="python", exclude_none=False, round_trip=True)

    def encode(self, codec: Codec | None = None) -> bytes:
        return (codec or default_codec()).encode(self.KIND, _avro_ready(self.to_record()))


def _avro_ready(value: Any) -> Any:
    # Enums go to Avro as their symbol strings.
    if isinstance(value, StrEnum):
        return value.value
    if isinstance(value, dict):
        return {k: _avro_ready(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_avro_ready(v) for v in value]
    return value


class LifecycleState(StrEnum):
    PROVISIONING = "PROVISIONING"
    ACTIVE = "ACTIVE"
    DRAINING = "DRAINING"
    RECYCLED = "RECYCLED"


class ToolStatus(StrEnum):
    OK = "OK"
    ERROR = "ERROR"
    TIMEOUT = "TIMEOUT"


class EpisodeOutcome(StrEnum):
    TERMINAL = "TERMINAL"
    TRUNCATED = "TRUNCATED"


class DecisionKind(StrEnum):
    PLACE = "PLACE"
    QUEUE = "QUEUE"
    ADMIT = "ADMIT"
    DEMOTE = "DEMOTE"
    RECLAIM = "RECLAIM"
    DRAIN = "DRAIN"
    TERMINATE = "TERMINATE"
    RECYCLE = "RECYCLE"
    RECYCLE_WITH_LOSS = "RECYCLE_WITH_LOSS"
    ANOMALY = "ANOMALY"


class AlertKind(StrEnum):
    LOOP = "LOOP"
    LOOP_ENDED = "LOOP_ENDED"
    STALL = "STALL"


class AckOutcome(StrEnum):
    DONE = "DONE"
    FAILED = "FAILED"


# -- sandbox-side events -------------------------------------------------------------------
class SandboxLifecycle(Event):
    KIND: ClassVar[str] = "SandboxLifecycle"
    state: LifecycleState
    previous_state: LifecycleState | None = None
    node: str | None = None
    tenant: str | None = None
    reason: str = ""


class Heartbeat(Event):
    KIND: ClassVar[str] = "Heartbeat"
    lease_ttl_ms: int = 600_000


class LivenessProbe(Event):
    KIND: ClassVar[str] = "LivenessProbe"
    probe: str = "tcp"
    target: str = ""
    ok: bool
    latency_ms: int = 0
    error: str | None = None


class ToolCall(Event):
    KIND: ClassVar[str] = "ToolCall"
    call_id: str
    tool: str
    args_hash: str
    args_canonical: str | None = None
    args_summary: str = ""


class ToolResult(Event):
    KIND: ClassVar[str] = "ToolResult"
    call_id: str
    tool: str
    status: ToolStatus
    result_hash: str
    result_canonical: str | None = None
    result_summary: str = ""
    duration_ms: int = 0


class BlobRef(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    uri: str
    size: int
    sha256: str
    content_type: str = "application/octet-stream"


class TraceChunk(Event):
    KIND: ClassVar[str] = "TraceChunk"
    file_offset: int = Field(ge=0)
    length: int = Field(ge=0)
    sha256: str
    data: bytes | None = None
    blob: BlobRef | None = None
    content_type: str = "application/octet-stream"
    reset: str | None = None


class EpisodeStart(Event):
    KIND: ClassVar[str] = "EpisodeStart"
    tenant: str | None = None
    env_snapshot: str | None = None
    context: dict[str, str] = Field(default_factory=dict)


class EpisodeEnd(Event):
    KIND: ClassVar[str] = "EpisodeEnd"
    outcome: EpisodeOutcome
    reason: str = ""
    reward: float | None = None


class NodeReport(Event):
    KIND: ClassVar[str] = "NodeReport"
    node: str
    cpu_total: float
    cpu_free: float
    memory_total_mb: int
    memory_free_mb: int
    gpu_total: float = 0.0
    gpu_free: float = 0.0
    network_free_mbps: float = 0.0
    cached_datasets: list[str] = Field(default_factory=list)


class SandboxRequest(Event):
    KIND: ClassVar[str] = "SandboxRequest"
    request_id: str
    tenant: str
    cpu: float
    memory_mb: int
    gpu_share: float = 0.0
    dataset: str | None = None
    ttl_ms: int = 600_000


class TrainerRelease(Event):
    KIND: ClassVar[str] = "TrainerRelease"
    reason: str = ""


class EpisodeFinalSeq(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    episode: str
    final_seq: int


class Drained(Event):
    KIND: ClassVar[str] = "Drained"
    final_seqs: list[EpisodeFinalSeq] = Field(default_factory=list)
    complete: bool
    unflushed: int = 0
    detail: str = ""


class DecisionAck(Event):
    """The sandbox runtime's answer to a decision about it (``TERMINATE``): carried out
    (``DONE``) or not (``FAILED``, with ``detail``). Sandbox-level: ``header.episode`` is None
    and ``header.seq`` continues the sandbox's lifecycle sequence."""

    KIND: ClassVar[str] = "DecisionAck"
    decision_event_id: str
    decision: str
    outcome: AckOutcome
    detail: str = ""


class Tick(Event):
    KIND: ClassVar[str] = "Tick"


# -- derived events ------------------------------------------------------------------------
class SchedulingDecision(Event):
    KIND: ClassVar[str] = "SchedulingDecision"
    NAMESPACE: ClassVar[str] = "trajbus.derived"
    decision: DecisionKind
    reason: str
    node: str | None = None
    tenant: str | None = None
    request_id: str | None = None
    suspicious: bool = False
    scores: dict[str, float] = Field(default_factory=dict)
    details: dict[str, str] = Field(default_factory=dict)
    cause_event_ids: list[str] = Field(default_factory=list)


class WatchdogAlert(Event):
    KIND: ClassVar[str] = "WatchdogAlert"
    NAMESPACE: ClassVar[str] = "trajbus.derived"
    alert: AlertKind
    pattern: list[str] = Field(default_factory=list)
    repeat_count: int = 0
    span_ms: int = 0
    first_seq: int = -1
    last_seq: int = -1
    distinct_results: int = 0
    dry_run: bool = False
    reason: str = ""


class SeqRange(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    from_seq: int
    to_seq: int


class ReplaySegment(Event):
    KIND: ClassVar[str] = "ReplaySegment"
    NAMESPACE: ClassVar[str] = "trajbus.derived"
    first_seq: int
    last_seq: int
    events: list[bytes]
    gap: SeqRange | None = None
    is_first: bool = False
    is_last: bool = False
    is_terminal: bool = False


class DeadLetter(Event):
    KIND: ClassVar[str] = "DeadLetter"
    NAMESPACE: ClassVar[str] = "trajbus.derived"
    reason_code: str
    reason: str
    stage: str
    source_topic: str
    source_partition: int = -1
    source_offset: int = -1
    original_key: bytes | None = None
    original_value: bytes
    conflicting_value: bytes | None = None
    """``conflicting_duplicate``: the version that was kept (seen first); ``None`` otherwise."""


EVENT_MODELS: dict[str, type[Event]] = {
    m.KIND: m
    for m in (
        SandboxLifecycle, Heartbeat, LivenessProbe, ToolCall, ToolResult, TraceChunk,
        EpisodeStart, EpisodeEnd, NodeReport, SandboxRequest, TrainerRelease, Drained,
        DecisionAck, Tick,
        SchedulingDecision, WatchdogAlert, ReplaySegment, DeadLetter,
    )
}


def encode_event(event: Event, codec: Codec | None = None) -> bytes:
    return event.encode(codec)


def to_model(decoded: Decoded) -> Event:
    """Validate a decoded record into its model (raises pydantic.ValidationError)."""
    model = EVENT_MODELS.get(decoded.kind)
    if model is None:
        raise KeyError(f"no model for event kind {decoded.kind!r}")
    return model.model_validate(decoded.record)


def decode_event(data: bytes, codec: Codec | None = None) -> Event:
    return to_model((codec or default_codec()).decode(data))
