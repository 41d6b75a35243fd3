"""Issue 14, finding 5: no secret leaves the sandbox through ANY free-text field of ANY event.

The fields are not listed by hand: they are enumerated from ``schemas/avro/*.avsc`` (every
record, nested records, arrays, maps -- keys too --, unions with null). Each string or bytes
field of an event kind the emitter writes is either

- an exact identifier, hash or reference, named with a reason in
  :data:`trajbus.producers.emitter.EXACT_FIELDS` (the emitter's allow-list, read here), or
- free text: the test plants secrets of every shape :mod:`trajbus.producers.redact` detects in
  it, through the emitter's public methods, and requires that the bytes handed to Kafka hold
  none of them and that the field carries the redaction marker (so the secret did reach the
  field and was redacted, not dropped).

A string field added to a schema later therefore fails here until someone decides: free text
(redact it in the emitter, plant it below) or exact (list it in ``EXACT_FIELDS``). The same
holds for a new schema (emitted by the emitter, or listed in :data:`NOT_EMITTED`), a new
public method of the emitter and a new detection rule of the redactor (it needs a sample).
"""

from __future__ import annotations

import asyncio
import inspect
import json
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from trajbus.bus import producer as producer_mod
from trajbus.bus.settings import Settings
from trajbus.bus.topics import Topics
from trajbus.producers import emitter as emitter_mod
from trajbus.producers.claimcheck import ClaimCheck
from trajbus.producers.emitter import EXACT_FIELDS, SandboxEmitter
from trajbus.producers.redact import RULES
from trajbus.producers.testing import create_topics, make_settings, read_topics
from trajbus.schemas.codec import default_codec
from trajbus.schemas.registry import ENVELOPE

SCHEMA_DIR = Path(__file__).resolve().parents[2] / "schemas" / "avro"

#: Event kinds the sandbox emitter never writes, and who does. The emitter's guarantee covers
#: what leaves a sandbox; these are written outside it: by the worker from the emitter's
#: (already redacted) events, or by the control plane and trainers.
NOT_EMITTED: dict[str, str] = {
    "DeadLetter": "the worker and the archiver: input they rejected, echoed as it was read",
    "ReplaySegment": "the worker's reorder stage: the emitter's own (redacted) event bytes",
    "SchedulingDecision": "the worker's scheduler, from (redacted) sandbox events",
    "WatchdogAlert": "the worker's watchdog, from (redacted) tool names and hashes",
    "NodeReport": "node agents (control plane)",
    "SandboxRequest": "tenants' control plane",
    "TrainerRelease": "trainers",
    "Tick": "the timer of the stream processors",
}

#: Public coroutine methods of SandboxEmitter that write no event.
NO_EVENT_METHODS = {"start", "close", "abort", "flush"}
#: The public methods the scenario below calls: every one that writes an event.
EVENT_METHODS = {"lifecycle", "heartbeat", "liveness", "start_episode", "end_episode",
                 "tool_call", "tool_result", "trace_chunk", "drain", "acknowledge"}

MARKER = "[REDACTED:"

# -- the schemas' text fields -----------------------------------------------------------------
_PRIMITIVE = {"null", "boolean", "int", "long", "float", "double"}
_TEXT = {"string", "bytes"}
_PATH_PART = re.compile(r"^(\w+)((?:\[\]|\{\}|\{key\})*)$")


def _full_name(t: dict[str, Any], ns: str) -> tuple[str, str]:
    """(full name, namespace for what it encloses) of a named type, per the Avro spec."""
    name = t["name"]
    if "." in name:
        return name, name.rsplit(".", 1)[0]
    own = t.get("namespace", ns)
    return (f"{own}.{name}" if own else name), own


class SchemaSet:
    """The ``.avsc`` files of a directory: named types and each record's text fields."""

    def __init__(self, directory: Path) -> None:
        self.docs = [json.loads(p.read_text(encoding="utf-8"))
                     for p in sorted(directory.glob("*.avsc"))]
        assert self.docs, f"no schemas in {directory}"
        self.named: dict[str, tuple[dict[str, Any], str]] = {}
        for d in self.docs:
            self._register(d, "")

    def _register(self, t: Any, ns: str) -> None:
        if isinstance(t, list):
            for branch in t:
                self._register(branch, ns)
        elif isinstance(t, dict):
            kind = t["type"]
            if kind in ("record", "error", "enum", "fixed"):
                full, inner = _full_name(t, ns)
                self.named[full] = (t, ns)
                for f in t.get("fields", []) if kind != "enum" else []:
                    self._register(f["type"], inner)
            elif kind == "array":
                self._register(t["items"], ns)
            elif kind == "map":
                self._register(t["values"], ns)

    @property
    def kinds(self) -> dict[str, dict[str, Any]]:
        """Top-level records by short name (the codec's kind), the envelope excepted."""
        out = {}
        for d in self.docs:
            full, _ = _full_name(d, "")
            if full != ENVELOPE:
                out[d["name"]] = d
        return out

    def text_fields(self, kind: str) -> dict[str, str]:
        """Every string/bytes field of ``kind``, nested anywhere: path -> Avro type."""
        out: dict[str, str] = {}
        for path, typ in self._walk(self.kinds[kind], "", "", frozenset()):
            out.setdefault(path, typ)
        return out

    def _walk(self, t: Any, ns: str, path: str, stack: frozenset[str]
              ) -> Iterator[tuple[str, str]]:
        if isinstance(t, list):  # a union: every branch, at the same path
            for branch in t:
                yield from self._walk(branch, ns, path, stack)
        elif isinstance(t, str):
            if t in _TEXT:
                yield path, t
            elif t not in _PRIMITIVE:  # a reference to a named type
                full = t if "." in t else (f"{ns}.{t}" if f"{ns}.{t}" in self.named else t)
                assert full in self.named, f"{path}: unknown type {t!r}"
                definition, def_ns = self.named[full]
                yield from self._walk(definition, def_ns, path, stack)
        else:
            kind = t["type"]
            if kind in ("record", "error"):
                full, inner = _full_name(t, ns)
                if full in stack:  # recursive type: its fields are walked already
                    return
                for f in t["fields"]:
                    sub = f"{path}.{f['name']}" if path else f["name"]
                    yield from self._walk(f["type"], inner, sub, stack | {full})
            elif kind == "enum":
                return  # symbols only: cannot carry text
            elif kind == "fixed":
                yield path, "bytes"
            elif kind == "array":
                yield from self._walk(t["items"], ns, path + "[]", stack)
            elif kind == "map":
                yield path + "{key}", "string"
                yield from self._walk(t["values"], ns, path + "{}", stack)
            elif isinstance(kind, str):  # {"type": "string", "logicalType": ...}
                yield from self._walk(kind, ns, path, stack)
            else:
                raise AssertionError(f"{path}: unhandled schema {t!r}")


SCHEMAS = SchemaSet(SCHEMA_DIR)
EMITTED = sorted(set(SCHEMAS.kinds) - set(NOT_EMITTED))


def is_exact(kind: str, path: str) -> bool:
    return f"{kind}.{path}" in EXACT_FIELDS or f"*.{path}" in EXACT_FIELDS


def free_text_fields() -> list[tuple[str, str, str]]:
    """(kind, path, avro type) of every field of an emitted kind that must be redacted."""
    return [(k, p, t) for k in EMITTED for p, t in SCHEMAS.text_fields(k).items()
            if not is_exact(k, p)]


def values_at(record: Any, path: str) -> list[Any]:
    """The values at ``path`` in a decoded record (nulls skipped)."""
    values = [record]
    for part in path.split("."):
        m = _PATH_PART.match(part)
        assert m, path
        values = [v[m.group(1)] for v in values if v is not None]
        for step in re.findall(r"\[\]|\{\}|\{key\}", m.group(2)):
            if step == "[]":
                values = [x for v in values if v is not None for x in v]
            elif step == "{}":
                values = [x for v in values if v is not None for x in v.values()]
            else:
                values = [x for v in values if v is not None for x in v]
    return [v for v in values if v is not None]


# -- what the redactor must catch -------------------------------------------------------------
ENV = {"OPENAI_API_KEY": "zz-env-secret-0d6f1c9b", "MY_DB_PASSWORD": "pw-env-secret-8a1b2c"}


@dataclass(frozen=True)
class Sample:
    rule: str  # the Redactor rule that must catch it
    text: str  # what is planted
    needle: str  # the secret part: must appear in no byte handed to Kafka


SAMPLES = [
    Sample("env:OPENAI_API_KEY", f"key {ENV['OPENAI_API_KEY']}", ENV["OPENAI_API_KEY"]),
    Sample("env:MY_DB_PASSWORD", f"db {ENV['MY_DB_PASSWORD']}", ENV["MY_DB_PASSWORD"]),
    Sample("private_key", "-----BEGIN RSA PRIVATE KEY-----\nMIIEpAIBAAKCAQEAplantedPEMbody\n"
           "-----END RSA PRIVATE KEY-----", "MIIEpAIBAAKCAQEAplantedPEMbody"),
    Sample("anthropic_key", "sk-ant-api03-plantedAnthropic0123456789",
           "plantedAnthropic0123456789"),
    Sample("openai_key", "sk-proj-plantedOpenAI0123456789abcdef", "plantedOpenAI0123456789"),
    Sample("aws_access_key", "AKIAPLANTED012345678", "PLANTED012345678"),
    Sample("github_token", "ghp_plantedGithub0123456789abcdefghijkl", "plantedGithub0123456789"),
    Sample("github_token", "github_pat_plantedGithubPat0123456789abcdef",
           "plantedGithubPat0123456789"),
    Sample("hf_token", "hf_plantedHuggingFace0123456789abcdef", "plantedHuggingFace0123456789"),
    Sample("slack_token", "xoxb-1234567890-plantedSlack", "plantedSlack"),
    Sample("jwt", "eyJhbGciOiJIUzI1NiJ9.eyJzdWIiOiJwbGFudGVkIn0.plantedJwtSignature",
           "plantedJwtSignature"),
    Sample("bearer_token", "Authorization: Bearer plantedBearer0123456789", "plantedBearer01234"),
    Sample("url_password", "postgres://admin:plantedUrlPassword@db:5432/x", "plantedUrlPassword"),
    Sample("password_assignment", "password=plantedPasswordAssign", "plantedPasswordAssign"),
    Sample("password_assignment", "api_key: 'plantedApiKeyAssign'", "plantedApiKeyAssign"),
]
#: Redacted whole by its dict key in structured tool args/results.
SENSITIVE_VALUE = "plantedSensitiveKeyValue"
NEEDLES = [s.needle for s in SAMPLES] + [SENSITIVE_VALUE]
BUNDLE = " | ".join(s.text for s in SAMPLES)

# identifiers that must come through exactly
NODE, TENANT, CALL_ID = "node-7", "acme", "call-0001"


def planted(where: str) -> str:
    return f"{where}: {BUNDLE}"


async def drive(em: SandboxEmitter) -> None:
    """Every event kind the emitter writes, every free-text argument carrying every secret."""
    await em.lifecycle("PROVISIONING", reason=planted("reason"), node=NODE, tenant=TENANT)
    await em.lifecycle("ACTIVE", reason=planted("reason"), node=NODE)
    await em.heartbeat()
    await em.liveness(False, probe=planted("probe"), target=planted("target"),
                      error=planted("error"))
    await em.start_episode("ep-1", tenant=TENANT, env_snapshot=planted("snapshot"),
                           context={planted("context key"): planted("context value")})
    cid = await em.tool_call("ep-1", planted("tool"),
                             {"cmd": BUNDLE, "password": SENSITIVE_VALUE}, call_id=CALL_ID)
    await em.tool_result("ep-1", cid, planted("tool"),
                         {"stdout": BUNDLE, "token": SENSITIVE_VALUE}, status="ERROR")
    content_type = "text/plain; note=" + planted("content type")
    inline = planted("trace").encode()
    await em.trace_chunk("ep-1", inline, file_offset=0, content_type=content_type,
                         reset=planted("reset"))
    claimed = (planted("blob") + "\n").encode() * 20  # above the claim-check threshold
    await em.trace_chunk("ep-1", claimed, file_offset=len(inline), content_type=content_type)
    await em.end_episode("ep-1", "TRUNCATED", reason=planted("end"))
    await em.acknowledge("0123456789abcdef0123456789abcdef", decision="TERMINATE", done=False,
                         detail=planted("ack detail"))
    await em.start_episode("ep-2")  # left open: Drained lists its final seq
    report = await em.drain(20, detail=planted("detail"))
    assert report.complete, report


# -- the contract between schemas, allow-list, scenario and redactor --------------------------
def test_kinds_written_elsewhere_are_real_schemas() -> None:
    """Every schema not in NOT_EMITTED counts as emitted: the scenario must produce it (checked
    below), so a new schema fails until it is driven or listed here with its writer."""
    assert set(NOT_EMITTED) <= set(SCHEMAS.kinds), set(NOT_EMITTED) - set(SCHEMAS.kinds)
    assert "SandboxLifecycle" in EMITTED and "LivenessProbe" in EMITTED


def test_walker_finds_nested_records_arrays_maps_and_nullable_strings() -> None:
    """The enumeration reaches every construct the schemas use (checked on known fields)."""
    assert SCHEMAS.text_fields("Drained")["final_seqs[].episode"] == "string"
    assert SCHEMAS.text_fields("TraceChunk")["blob.content_type"] == "string"
    assert SCHEMAS.text_fields("TraceChunk")["data"] == "bytes"
    start = SCHEMAS.text_fields("EpisodeStart")
    assert start["context{key}"] == start["context{}"] == start["env_snapshot"] == "string"
    assert "header.episode" in start and "header.seq" not in start
    assert "state" not in SCHEMAS.text_fields("SandboxLifecycle")  # an enum
    assert SCHEMAS.text_fields("NodeReport")["cached_datasets[]"] == "string"
    assert SCHEMAS.text_fields("SchedulingDecision")["details{}"] == "string"
    assert SCHEMAS.text_fields("ReplaySegment")["events[]"] == "bytes"
    assert SCHEMAS.text_fields("DeadLetter")["original_key"] == "bytes"  # ["null", "bytes"]


def test_allow_list_names_real_fields_of_emitted_kinds_with_a_reason() -> None:
    fields = {(k, p) for k in EMITTED for p in SCHEMAS.text_fields(k)}
    for name, why in EXACT_FIELDS.items():
        kind, _, path = name.partition(".")
        kinds = EMITTED if kind == "*" else [kind]
        assert kind == "*" or kind in EMITTED, f"{name}: {kind} is not an emitted kind"
        assert all((k, path) in fields for k in kinds), f"{name}: no such string/bytes field"
        assert len(why) > 10, f"{name}: say why it must stay exact"


def test_every_public_event_method_is_driven() -> None:
    public = {n for n, _ in inspect.getmembers(SandboxEmitter, inspect.iscoroutinefunction)
              if not n.startswith("_")}
    assert public == EVENT_METHODS | NO_EVENT_METHODS, public ^ (EVENT_METHODS | NO_EVENT_METHODS)


def test_every_redaction_rule_has_a_planted_sample() -> None:
    assert {r.name for r in RULES} <= {s.rule for s in SAMPLES}


# -- the emitter, against everything planted --------------------------------------------------
class RecordingProducer:
    """Stands in for the shared Kafka producer: keeps every (topic, key, value) the emitter
    hands to Kafka, and acknowledges it at once."""

    def __init__(self) -> None:
        self.sent: list[tuple[str, bytes | None, bytes]] = []

    async def send(self, topic: str, value: bytes, key: bytes | None = None
                   ) -> asyncio.Future[Any]:
        self.sent.append((topic, key, value))
        fut: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        fut.set_result(SimpleNamespace(topic=topic, partition=0, offset=len(self.sent) - 1))
        return fut


@dataclass
class Outcome:
    values: list[bytes]  # as handed to (or read back from) Kafka
    keys: list[bytes]
    counts: dict[str, int]  # the emitter's redaction counts by rule


async def _run(settings: Settings, tmp_path: Path) -> Outcome:
    claim = ClaimCheck(url=str(tmp_path / "blobs"), threshold=4096, settings=settings)
    async with SandboxEmitter("sb-planted", "task-a", env=ENV, settings=settings,
                              state_dir=tmp_path / "state", producer_id="producer-1",
                              claim_check=claim) as em:
        await drive(em)
        counts = dict(em.redactor.counts)
    return Outcome([], [], counts)


async def _recorded(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Outcome:
    fake = RecordingProducer()

    async def get_fake(_settings: Any = None) -> RecordingProducer:
        return fake

    monkeypatch.setattr(emitter_mod, "get_producer", get_fake)
    out = await _run(make_settings("127.0.0.1:1", "t-recorded", tmp_path), tmp_path)
    out.values = [v for _, _, v in fake.sent]
    out.keys = [k for _, k, _ in fake.sent if k is not None]
    return out


async def _kafka(tmp_path: Path, request: pytest.FixtureRequest) -> Outcome:
    broker = request.getfixturevalue("kafka_broker")
    settings = make_settings(broker.bootstrap, request.getfixturevalue("unique_name"), tmp_path)
    await create_topics(settings)
    try:
        out = await _run(settings, tmp_path)
        t = Topics(settings)
        seen = await read_topics(settings, [t.sandbox_events, t.trace_chunks],
                                 lambda xs: any(x.kind == "Drained" for x in xs))
    finally:
        if producer_mod._loop is asyncio.get_running_loop():
            await producer_mod.close_producer()
    out.values = [x.value for x in seen]
    return out


@pytest.mark.timeout(120)
@pytest.mark.parametrize("transport", ["recorded", pytest.param("kafka", marks=pytest.mark.kafka)])
async def test_secrets_planted_in_every_free_text_field_never_reach_kafka(
        transport: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        request: pytest.FixtureRequest) -> None:
    """Through the public methods, every secret shape in every free-text field of every
    emitted kind: none reaches the bytes sent to Kafka (nor the journal, nor the claim-check
    store), each free-text field shows the redaction marker, identifiers come through exact."""
    if transport == "recorded":
        out = await _recorded(tmp_path, monkeypatch)
    else:
        out = await _kafka(tmp_path, request)
    codec = default_codec()
    decoded = [codec.decode(v) for v in out.values]
    by_kind: dict[str, list[dict[str, Any]]] = {}
    for d in decoded:
        by_kind.setdefault(d.kind, []).append(d.record)
    assert sorted(by_kind) == EMITTED, "the scenario must produce every emitted kind"

    # 1. no secret in any byte handed to Kafka, kept in the journal or stored as a blob
    on_disk = [p for p in tmp_path.rglob("*") if p.is_file()]
    assert any(p.is_relative_to(tmp_path / "blobs") for p in on_disk), "no blob was stored"
    for needle in NEEDLES:
        raw = needle.encode()
        for v in out.values + out.keys:
            assert raw not in v, f"{needle!r} reached Kafka: {codec.decode(v).kind}"
        for p in on_disk:
            assert raw not in p.read_bytes(), f"{needle!r} is in {p}"

    # 2. every free-text field of every emitted kind was planted (the scenario fills each one
    #    it sets with secrets) and came out redacted: every non-empty value has the marker
    unplanted = []
    for kind, path, typ in free_text_fields():
        vals = [x for r in by_kind[kind] for x in values_at(r, path) if x]
        marker: str | bytes = MARKER.encode() if typ == "bytes" else MARKER
        if not vals or not all(marker in x for x in vals):
            unplanted.append(f"{kind}.{path} = {[str(x)[:60] for x in vals]}")
    assert not unplanted, ("free-text fields without a redaction marker (plant a secret in "
                           "each, redact it in the emitter, or list it in EXACT_FIELDS): "
                           + "; ".join(unplanted))

    # 3. every rule fired; identifiers are untouched
    missing = {s.rule for s in SAMPLES} - set(out.counts)
    assert not missing and out.counts.get("sensitive_key", 0) >= 2, out.counts
    life = by_kind["SandboxLifecycle"][0]
    assert (life["node"], life["tenant"]) == (NODE, TENANT)
    assert [r["call_id"] for r in by_kind["ToolCall"] + by_kind["ToolResult"]] == [CALL_ID] * 2
    assert {r["header"]["producer_id"] for rs in by_kind.values() for r in rs} == {"producer-1"}
    assert [f["episode"] for f in by_kind["Drained"][0]["final_seqs"]] == ["ep-2"]
