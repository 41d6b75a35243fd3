"""The emitter's event API: one coroutine per event kind a sandbox publishes (lifecycle,
heartbeat, liveness, decision acknowledgement, episode start and end, tool call and result,
trace chunk), and the redaction of every free-text field on the way in.

:class:`EventAPI` is the part of :class:`~trajbus.producers.emitter.SandboxEmitter` that
builds each event's fields and hands them to ``SandboxEmitter._emit`` (sequence, journal,
queue). Guarantees: every string or bytes field not listed in :data:`EXACT_FIELDS` passes the
sandbox's :class:`~trajbus.producers.redact.Redactor` before it is encoded or journaled (trace
bytes of media content types or sent with ``redact=False`` excepted); tool arguments and
results are hashed over their redacted canonical JSON without the watchdog's ignored fields,
so the watchdog compares what the emitter hashed; a trace chunk too large to travel inline
is stored once by claim-check and the event carries the reference.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING, Any

from trajbus.bus.settings import Settings
from trajbus.bus.topics import Topics, validate_name
from trajbus.consumers.watchdog.canonical import CanonicalError, Canonicalizer, canonicalizer
from trajbus.producers.claimcheck import ClaimCheck
from trajbus.producers.redact import Redactor
from trajbus.schemas.models import EpisodeOutcome, LifecycleState, ToolStatus

SUMMARY_CHARS = 256
CANONICAL_MAX_BYTES = 4096
CLEAN_TEXT_MAX_CHARS = 128  # free texts up to this long are remembered when clean ...
CLEAN_TEXT_MAX_ENTRIES = 4096  # ... this many per set of redaction rules (shared by the
# emitters whose sandboxes have the same env secrets: on a node, mostly all of them)

#: The string and bytes fields of the events this emitter writes that are NOT free text, with
#: why each must stay exact (they key, join or dedupe streams, or are hashes and references).
#: They are written as given. EVERY OTHER string or bytes field of every event kind the emitter
#: writes is free text and passes this sandbox's :class:`Redactor` before it is encoded or
#: journaled. Paths: ``<Kind>.<field>[.<field>...]``; ``[]`` = the items of an array, ``{}`` =
#: the values of a map, ``{key}`` = its keys; ``*`` = every kind (the envelope, ``header``).
#: ``tests/kafka/test_redaction_schema_fields.py`` walks ``schemas/avro/*.avsc`` and plants secrets
#: in every string/bytes field of every emitted kind that is not listed here: a field added to a
#: schema fails it until it is redacted (and planted by the test) or listed here with a reason.
EXACT_FIELDS: Mapping[str, str] = {
    "*.header.event_id": "event id: generated uuid4 hex (downstream dedup)",
    "*.header.task": "task id (validate_name alphabet): topic names, archive paths",
    "*.header.sandbox": "sandbox id (validate_name alphabet): Kafka key, archive paths",
    "*.header.episode": "episode id (validate_name alphabet): the stream of the seq",
    "*.header.producer_id": "id of the emitting process",
    "SandboxLifecycle.node": "node id: the scheduler matches it with NodeReport.node",
    "SandboxLifecycle.tenant": "tenant id: the scheduler's credit account",
    "EpisodeStart.tenant": "tenant id: the scheduler's credit account",
    "ToolCall.call_id": "call id: pairs a ToolCall with its ToolResult",
    "ToolCall.args_hash": "sha256 hex of the (redacted) canonical args",
    "ToolResult.call_id": "call id: pairs a ToolCall with its ToolResult",
    "ToolResult.result_hash": "sha256 hex of the (redacted) canonical result",
    "TraceChunk.sha256": "sha256 hex of the (redacted) chunk bytes",
    "TraceChunk.blob.uri": "claim-check reference built from settings and the content hash",
    "TraceChunk.blob.sha256": "sha256 hex of the (redacted) blob bytes",
    "Drained.final_seqs[].episode": "episode id (validate_name alphabet)",
    "DecisionAck.decision_event_id": "event id of the decision (validate_name alphabet): "
                                     "the scheduler and `alerts` join on it",
    "DecisionAck.decision": "decision kind (validate_name alphabet), e.g. TERMINATE",
}


def _summary(text: str, limit: int = SUMMARY_CHARS) -> str:
    return text if len(text) <= limit else text[: limit - 1] + "…"


def canonicalizers(ignore: Iterable[str]) -> tuple[Canonicalizer, Canonicalizer]:
    """The two canonical forms of tool arguments and results: without the members named in
    ``ignore`` (the watchdog's ignored fields: what ``args_hash`` hashes), and whole (what
    ``args_canonical`` and the summary show)."""
    return canonicalizer(ignore), canonicalizer(())


class EventAPI:
    """The event API of an emitter; see the module docstring."""

    # the emitter's state this part reads and writes (set up by SandboxEmitter.__init__)
    settings: Settings
    tenant: str | None
    topics: Topics
    redactor: Redactor
    max_inline: int
    _clean_text: set[str]
    _canon: Canonicalizer
    _canon_full: Canonicalizer
    _claim: ClaimCheck | None
    _new_id: Callable[[], str]
    _lifecycle: str | None

    if TYPE_CHECKING:  # the emitter's core (SandboxEmitter)
        async def _emit(self, kind: str, episode: str | None, fields: dict[str, Any], *,
                        topic: str | None = None, event_time_ms: int | None = None,
                        extra: dict[str, Any] | None = None,
                        force: bool = False) -> tuple[str, int]: ...

    async def lifecycle(self, state: LifecycleState | str, *, reason: str = "",
                        node: str | None = None, tenant: str | None = None,
                        event_time_ms: int | None = None) -> str:
        """Publish a lifecycle transition (previous state is tracked, also across restarts)."""
        st = LifecycleState(state).value
        eid, _ = await self._emit("SandboxLifecycle", None, {
            "state": st, "previous_state": self._lifecycle, "node": node,
            "tenant": tenant or self.tenant, "reason": self._text(reason),
        }, event_time_ms=event_time_ms, extra={"ls": st})
        return eid

    async def heartbeat(self, *, lease_ttl_ms: int | None = None,
                        event_time_ms: int | None = None) -> str:
        ttl = lease_ttl_ms if lease_ttl_ms is not None else self.settings.scheduler.lease_ttl_ms
        eid, _ = await self._emit("Heartbeat", None, {"lease_ttl_ms": ttl},
                                  event_time_ms=event_time_ms)
        return eid

    async def liveness(self, ok: bool, *, probe: str = "tcp", target: str = "",
                       latency_ms: int = 0, error: str | None = None,
                       event_time_ms: int | None = None) -> str:
        text = self._text
        eid, _ = await self._emit("LivenessProbe", None, {
            "probe": text(probe), "target": text(target), "ok": ok, "latency_ms": latency_ms,
            "error": text(error) if error else error,
        }, event_time_ms=event_time_ms)
        return eid

    async def acknowledge(self, decision_event_id: str, *, decision: str = "TERMINATE",
                          done: bool = True, detail: str = "",
                          event_time_ms: int | None = None) -> str:
        """Answer a scheduling decision about this sandbox (its ``header.event_id``): carried
        out (``done``) or not, with what happened. ``trajbus alerts`` shows a TERMINATE as
        done only once this arrives; a failed one becomes the scheduler's ANOMALY."""
        validate_name("decision event", decision_event_id)
        validate_name("decision", decision)
        eid, _ = await self._emit("DecisionAck", None, {
            "decision_event_id": decision_event_id, "decision": decision,
            "outcome": "DONE" if done else "FAILED", "detail": self._text(detail),
        }, event_time_ms=event_time_ms)
        return eid

    async def start_episode(self, episode: str, *, tenant: str | None = None,
                            env_snapshot: str | None = None,
                            context: Mapping[str, str] | None = None,
                            policy_version: int | None = None,
                            event_time_ms: int | None = None) -> str:
        """EpisodeStart (seq 0 of the episode's stream). Episode ids are never reused."""
        validate_name("episode", episode)
        text = self._text
        ctx = {text(str(k)): text(str(v)) for k, v in (context or {}).items()}
        eid, _ = await self._emit("EpisodeStart", episode, {
            "tenant": tenant or self.tenant,
            "env_snapshot": text(env_snapshot) if env_snapshot else env_snapshot, "context": ctx,
        }, event_time_ms=event_time_ms, extra={"open": True, "pv": policy_version})
        return eid

    async def end_episode(self, episode: str,
                          outcome: EpisodeOutcome | str = EpisodeOutcome.TERMINAL, *,
                          reason: str = "", reward: float | None = None,
                          cursor: tuple[str, Any] | None = None,
                          event_time_ms: int | None = None) -> str:
        """EpisodeEnd: the last seq of the episode; later events for it are refused."""
        extra: dict[str, Any] = {"close": True}
        if cursor is not None:
            extra["cur"] = list(cursor)
        eid, _ = await self._emit("EpisodeEnd", episode, {
            "outcome": EpisodeOutcome(outcome).value, "reason": self._text(reason),
            "reward": reward,
        }, event_time_ms=event_time_ms, extra=extra)
        return eid

    def _text(self, text: str) -> str:
        """A free-text field, redacted (see :data:`EXACT_FIELDS` for what is not). Short texts
        found clean are remembered -- tool names, content types and probe kinds repeat on
        every event -- which is exact: the rules never change, so a text with nothing to
        redact never has (the memory is shared by the emitters with the same rules)."""
        if not text or text in self._clean_text:
            return text
        out = self.redactor.redact_text(text)
        if out is text and len(text) <= CLEAN_TEXT_MAX_CHARS and (
                len(self._clean_text) < CLEAN_TEXT_MAX_ENTRIES):
            self._clean_text.add(text)
        return out

    def _canonical(self, value: Any) -> tuple[str, str | None, str]:
        """(hash, canonical-if-small, summary) of a redacted JSON-like value."""
        if isinstance(value, bytes | bytearray):
            value = bytes(value).decode("utf-8", "replace")
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except ValueError:
                pass  # plain text: canonicalised as a JSON string
        red = self.redactor.redact_value(value)
        try:
            full = self._canon_full.json_value(red)
            # ``full`` is canonical text: strip_canonical removes the ignored members without
            # a re-parse (it falls back to one when in doubt) -- same text as hash(full).
            hashed = self._canon.strip_canonical(full) if self._canon.ignore else full
        except CanonicalError:
            full = self._canon_full.json_value(repr(red))
            hashed = full
        data = full.encode("utf-8", "surrogatepass")
        if hashed is not full:
            h = hashlib.sha256(hashed.encode("utf-8", "surrogatepass")).hexdigest()
        else:
            h = hashlib.sha256(data).hexdigest()
        small = full if len(data) <= CANONICAL_MAX_BYTES else None
        return h, small, _summary(full)

    async def tool_call(self, episode: str, tool: str, args: Any, *, call_id: str | None = None,
                        event_time_ms: int | None = None) -> str:
        """ToolCall with redacted args: ``args_hash`` = sha256 of the canonical JSON with the
        watchdog's ignored fields removed; ``args_canonical`` (all fields) only if <= 4 KiB;
        ``args_summary`` <= 256 chars. Returns the call id."""
        h, small, summary = self._canonical(args)
        cid = call_id or self._new_id()[:16]
        await self._emit("ToolCall", episode, {
            "call_id": cid, "tool": self._text(tool), "args_hash": h, "args_canonical": small,
            "args_summary": summary,
        }, event_time_ms=event_time_ms)
        return cid

    async def tool_result(self, episode: str, call_id: str, tool: str, result: Any, *,
                          status: ToolStatus | str = ToolStatus.OK, duration_ms: int = 0,
                          event_time_ms: int | None = None) -> str:
        h, small, summary = self._canonical(result)
        eid, _ = await self._emit("ToolResult", episode, {
            "call_id": call_id, "tool": self._text(tool), "status": ToolStatus(status).value,
            "result_hash": h, "result_canonical": small, "result_summary": summary,
            "duration_ms": duration_ms,
        }, event_time_ms=event_time_ms)
        return eid

    async def trace_chunk(self, episode: str, data: bytes, *, file_offset: int,
                          content_type: str = "application/octet-stream",
                          reset: str | None = None, cursor: tuple[str, Any] | None = None,
                          redact: bool = True, event_time_ms: int | None = None) -> str:
        """A TraceChunk on ``Topics.trace_chunks``. ``data`` is redacted in place (length kept,
        so offsets stay valid); above the claim-check threshold (or the message limit) it is
        stored once in object storage and the event carries a BlobRef. ``cursor`` =
        (name, JSON value) is journaled atomically with the event (the tailer's offsets).
        ``content_type`` and ``reset`` are redacted as text; ``redact=False`` (or a media
        content type) sends ``data`` unscanned."""
        content_type = self._text(content_type)
        if reset:
            reset = self._text(reset)
        if redact and not content_type.startswith(("image/", "video/", "audio/")):
            data = self.redactor.redact_bytes(data)
        sha = hashlib.sha256(data).hexdigest()
        fields: dict[str, Any] = {"file_offset": file_offset, "length": len(data), "sha256": sha,
                                  "data": data, "blob": None, "content_type": content_type,
                                  "reset": reset}
        claim = self._claim
        threshold = claim.threshold if claim else self.settings.producer.claim_check_threshold
        if len(data) > threshold or len(data) > self.max_inline:
            if claim is None:
                claim = self._claim = ClaimCheck(settings=self.settings)
            ref = await asyncio.to_thread(claim.put, data, content_type)
            fields["data"] = None
            fields["blob"] = ref.model_dump()
        extra = {"cur": list(cursor)} if cursor is not None else None
        eid, _ = await self._emit("TraceChunk", episode, fields, topic=self.topics.trace_chunks,
                                  event_time_ms=event_time_ms, extra=extra)
        return eid
