"""Typed settings. Environment variables are prefixed ``TRAJBUS_``; defaults are the reference
configuration (MISSION.md), so a deviation is an explicit override, never an edit.

Nested groups use a double underscore: ``TRAJBUS_WATCHDOG__LOOP_MIN_REPEATS=30``.
"""

from __future__ import annotations

import os
import re
from functools import lru_cache
from pathlib import Path
from typing import Any, Literal

from pydantic import (
    BaseModel,
    Field,
    SecretStr,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)
from pydantic_settings import BaseSettings, SettingsConfigDict
from pydantic_settings import SettingsError as PydanticSettingsError

from trajbus.bus.errors import UserError


class KafkaSettings(BaseModel):
    bootstrap_servers: str = "127.0.0.1:9092"
    client_id: str = "trajbus"
    security_protocol: Literal["PLAINTEXT", "SSL", "SASL_PLAINTEXT", "SASL_SSL"] = "PLAINTEXT"
    sasl_mechanism: Literal["PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512"] | None = None
    sasl_username: str | None = None
    sasl_password: SecretStr | None = None  # shown as '**********', never logged
    ssl_cafile: str | None = None
    ssl_certfile: str | None = None
    ssl_keyfile: str | None = None
    # lz4. zstd compresses faster than aiokafka's lz4 at level 9 (HC) and better, but is not
    # the default: aiokafka fetches with FetchRequest v4, which cannot read topics whose
    # broker-side compression.type is zstd (aio-libs/aiokafka#1112).
    # docs/decisions/0004-lz4-level-1.md.
    compression_type: Literal["gzip", "lz4", "zstd", "snappy"] | None = "lz4"
    # lz4 level for aiokafka's producers (its own default is 9, the slow HC mode): level 1
    # compresses several times faster for a slightly larger output
    # (docs/decisions/0004-lz4-level-1.md).
    lz4_level: int = Field(default=1, ge=0, le=16)
    linger_ms: int = 10
    max_batch_size: int = 1_048_576
    max_request_size: int = 8 * 1024 * 1024
    request_timeout_ms: int = 30_000
    connect_timeout_s: float = 10.0
    # Group members (workers, archiver, trainers): how long the coordinator waits for a member
    # that stopped heartbeating. A crashed worker restarted with the same --worker-id takes its
    # partitions back at once (static membership); one that does not come back is replaced
    # after this long.
    session_timeout_ms: int = Field(default=10_000, ge=6_000, le=1_800_000)
    # How often a worker heartbeats to its group. It learns that a rebalance started (a worker
    # joining or leaving) from a heartbeat's answer: until then a joining worker waits, and the
    # partitions of one that left are served by nobody. 500 ms instead of session / 5 (2 s)
    # bounds that wait by 0.5 s instead of 2 s (docs/decisions/0003-fast-heartbeat.md). At
    # most a third of the session timeout.
    heartbeat_interval_ms: int = Field(default=500, ge=100)
    # How long the broker may hold a fetch that finds no new data (the workers', archiver's and
    # trainers' consumers). aiokafka keeps one fetch in flight per broker, and a fetch leaves out
    # the partitions whose records the process has not taken yet; while a batch's transaction
    # runs, that can be a fetch of idle partitions only, which the broker holds this long while
    # the busy partitions' records wait behind it: with aiokafka's default, 500 ms, every
    # partition of a worker can be silent for ~0.5 s now and then. 100 ms bounds that, for a
    # few more fetches a second of idle partitions (docs/decisions/0002-short-fetch-wait.md).
    fetch_max_wait_ms: int = Field(default=100, ge=0, le=500)
    # After a failed connection to a broker, the next attempt to that address waits this long,
    # doubling per consecutive failure up to the max (+-20 %), as Kafka's own clients do
    # (reconnect.backoff.ms / .max.ms). aiokafka has none, so without it a worker retries a
    # connection to a broker that is away many times a second (trajbus.bus.reconnect;
    # docs/decisions/0001-paced-reconnects.md). A base of 0 turns it off; the max is at least
    # the base (0: the same as the base).
    reconnect_backoff_ms: int = Field(default=50, ge=0, le=10_000)
    reconnect_backoff_max_ms: int = Field(default=1_000, ge=0, le=60_000)

    @model_validator(mode="after")
    def _heartbeat_within_session(self) -> KafkaSettings:
        if self.heartbeat_interval_ms * 3 > self.session_timeout_ms:
            raise ValueError(f"heartbeat_interval_ms ({self.heartbeat_interval_ms}) must be at "
                             f"most a third of session_timeout_ms ({self.session_timeout_ms})")
        if 0 < self.reconnect_backoff_max_ms < self.reconnect_backoff_ms:
            raise ValueError(
                f"reconnect_backoff_max_ms ({self.reconnect_backoff_max_ms}) must be at least "
                f"reconnect_backoff_ms ({self.reconnect_backoff_ms}); set "
                "TRAJBUS_KAFKA__RECONNECT_BACKOFF_MS=0 to turn the backoff off")
        return self


class TopicSettings(BaseModel):
    prefix: str = "trajbus"
    partitions: int = 6
    # On a cluster set 3 (TRAJBUS_TOPICS__REPLICATION_FACTOR=3): one node may die and
    # nothing acknowledged is lost, nor does writing stop.
    replication_factor: int = Field(default=1, ge=1)
    # None: RF-1 when RF >= 3 (a write is acknowledged by at least two replicas, and one node
    # may be down), else 1. Set explicitly to override on every topic trajbus creates.
    min_insync_replicas: int | None = Field(default=None, ge=1)
    max_message_bytes: int = 8 * 1024 * 1024

    @property
    def effective_min_insync_replicas(self) -> int:
        if self.min_insync_replicas is not None:
            return self.min_insync_replicas
        return self.replication_factor - 1 if self.replication_factor >= 3 else 1

    @model_validator(mode="after")
    def _min_isr_within_rf(self) -> TopicSettings:
        if self.effective_min_insync_replicas > self.replication_factor:
            raise ValueError(
                f"min_insync_replicas ({self.min_insync_replicas}) exceeds replication_factor "
                f"({self.replication_factor}): no write could ever be acknowledged; lower "
                "TRAJBUS_TOPICS__MIN_INSYNC_REPLICAS or raise TRAJBUS_TOPICS__REPLICATION_FACTOR")
        return self


class ProducerSideSettings(BaseModel):
    chunk_size: int = 256 * 1024
    claim_check_threshold: int = 1024 * 1024
    queue_max_events: int = 10_000
    queue_full_timeout_s: float = 5.0
    drain_deadline_s: float = 30.0
    # The emitters of a process send through one shared sender (trajbus.producers.sender);
    # while more than one emitter is open its rounds start at most this often, so one round's
    # journal sync and sends serve many emitters (adds at most this much to send latency,
    # not to emit: an emit returns once journaled). 0 = a round as soon as one is due.
    send_round_ms: float = 10.0
    # With many emitters open the interval grows with their number -- send_round_ms per 100
    # emitters, up to this -- so a round keeps serving ~10 emitters' events per 10 ms of
    # interval: fewer, larger rounds cost less CPU per event, for up to
    # send_round_max_ms - send_round_ms more before an event is sent
    # (docs/decisions/0005-shared-sender-rounds.md). Below 100 open emitters the interval is
    # send_round_ms.
    send_round_max_ms: float = 50.0
    # With more than 100 emitters open on one event loop, the loop's thread gets a Linux timer
    # slack of the round interval, at most this: its timed waits (the callers' sleeps, the
    # rounds' wait and the producer's linger included) may end up to that much late, so ~1,000
    # timed wake-ups a second coalesce into a few dozen (docs/decisions/0006-timer-slack.md). I/O
    # still wakes the loop at once. The thread's own slack comes back when 100 or fewer are
    # open; threads it starts meanwhile inherit it. 0 = never touch the thread's slack.
    timer_slack_max_ms: float = 50.0
    # How a round makes its emitters' journals durable before sending (durability="fsync").
    # "filesystem": one syncfs(2) per filesystem for all the round's journals on it (a group
    # commit: at 1,000 emitters a round of ~50 journals costs one call, not 50 fdatasyncs;
    # Linux only, elsewhere per file). "file": one fdatasync per journal, for a filesystem
    # where that is faster (compare with bench/bench_many_emitters.py --journal-sync;
    # docs/decisions/0007-journal-group-commit.md).
    journal_sync: Literal["filesystem", "file"] = "filesystem"
    redact_env: list[str] = Field(
        default_factory=lambda: [
            "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "OPENAI_API_KEY", "ANTHROPIC_API_KEY",
            "HF_TOKEN", "GITHUB_TOKEN", "TRAJBUS_KAFKA__SASL_PASSWORD",
        ]
    )


MAX_CYCLE_LENGTH_LIMIT = 8  # the watchdog's longest repeated cycle of calls


class WatchdogSettings(BaseModel):
    loop_min_repeats: int = 20
    loop_min_span_ms: int = 120_000
    loop_max_distinct_results: int = 0
    max_cycle_length: int = 3
    ignore_fields: list[str] = Field(
        default_factory=lambda: ["timestamp", "ts", "request_id", "nonce", "trace_id"]
    )
    stall_after_ms: int = 600_000
    dry_run: bool = False
    # Per-task overrides of the fields above, e.g. {"browser": {"loop_min_repeats": 40}}.
    per_task: dict[str, dict[str, Any]] = Field(default_factory=dict)

    def rule_values(self, overrides: dict[str, Any] | None = None) -> dict[str, Any]:
        """The loop rule's values for one task: these settings with ``overrides`` (a
        ``per_task`` entry) applied, checked. Raises ``ValueError`` naming what is wrong. The
        watchdog builds its rules from these (``LoopRules.build``)."""
        values: dict[str, Any] = self.model_dump(exclude={"per_task"})
        if overrides:
            unknown = set(overrides) - set(values)
            if unknown:
                raise ValueError(f"unknown watchdog setting(s): {sorted(unknown)}")
            values.update(overrides)
        for name in ("loop_min_repeats", "loop_min_span_ms", "loop_max_distinct_results",
                     "max_cycle_length", "stall_after_ms"):
            v = values[name]
            if type(v) is not int or v < 0:
                raise ValueError(f"{name} must be a non-negative int, got {v!r}")
        if values["loop_min_repeats"] < 2:
            raise ValueError("loop_min_repeats must be >= 2")
        if not 1 <= values["max_cycle_length"] <= MAX_CYCLE_LENGTH_LIMIT:
            raise ValueError(f"max_cycle_length must be in 1..{MAX_CYCLE_LENGTH_LIMIT}")
        return values

    @field_validator("per_task")
    @classmethod
    def _per_task_rules_check(cls, per_task: dict[str, dict[str, Any]],
                              info: ValidationInfo) -> dict[str, dict[str, Any]]:
        """Each task's rules are checked now, so a typo in TRAJBUS_WATCHDOG__PER_TASK is
        refused when the settings are read (``trajbus config`` too), naming the variable,
        not when a worker starts."""
        if not per_task:
            return per_task
        base = cls.model_construct(**info.data)
        for task, overrides in per_task.items():
            try:
                base.rule_values(overrides)
            except ValueError as exc:
                raise ValueError(f"task {task!r}: {exc}") from None
        return per_task


class SchedulerSettings(BaseModel):
    lease_ttl_ms: int = 600_000
    heartbeat_interval_ms: int = 300_000
    missed_heartbeats_to_reclaim: int = 2
    liveness_failures_to_drain: int = 3
    drain_grace_ms: int = 30_000
    tick_interval_ms: int = 1_000
    affinity_cached_bonus: float = 50.0
    affinity_remote_penalty: float = -30.0
    gpu_cooldown_per_s: float = 0.5
    tenant_default_credit_cpu: float = 64.0
    tenant_burst_factor: float = 1.5
    tenant_burst_max_ms: int = 60_000
    node_stale_ms: int = 10_000
    lease_warning_ms: int = 60_000


class ReplaySettings(BaseModel):
    # How long (log time, silences taken out) a missing seq may hold its episode back before
    # it is declared a gap. Longer than a cluster failover as one producer sees it: a
    # sandbox's producer can reach a partition seconds after a node died while other
    # producers write to it all along, and a shorter timeout declares false gaps
    # (docs/decisions/0009-gap-timeout-30s.md). It delays only the declaration of a real loss:
    # in-order delivery waits for nothing.
    gap_timeout_ms: int = 30_000
    max_buffered_per_episode: int = 10_000
    max_buffered_total: int = 2_000_000
    # Bytes one episode may hold back while it waits for a missing seq; beyond it the oldest
    # gap is declared. None: the input topics' max.message.bytes + 512 KiB, so one valid
    # record of the largest size never forces a false gap, and the state record (raw bytes)
    # stays under the derived topics' limit (input limit + 1 MiB).
    max_buffered_bytes_per_episode: int | None = None
    # A sandbox runs one episode at a time; more open at once than this is a broken or
    # hostile sandbox: its further episodes are dead-lettered (0: no limit).
    max_open_episodes_per_sandbox: int = 64
    max_segment_events: int = 1024
    max_segment_bytes: int = 4 * 1024 * 1024
    dedupe_window: int = 64  # recent seqs per episode whose content is compared
    tombstone_ttl_ms: int = 300_000  # closed episodes remembered for late duplicates
    idle_timeout_ms: int | None = 1_800_000  # an episode silent this long ends truncated
    recycle_grace_ms: int | None = None  # default: gap_timeout_ms


class ArchiveSettings(BaseModel):
    url: str = ".trajbus/archive"  # a local directory, or s3://bucket/prefix
    s3_endpoint_url: str | None = None
    target_object_bytes: int = 64 * 1024 * 1024
    row_group_rows: int = 50_000
    max_open_ms: int = 6 * 3600 * 1000  # rotation by event time: archival every 6 hours
    # Freshness: a batch is written once its first row is this old in the log's time (the
    # Kafka timestamps of later records and ticks, or the archiver's timer on a quiet fleet):
    # an acknowledged event is queryable about this long (plus one write) after it was sent.
    flush_after_ms: int = Field(default=30_000, ge=1_000)
    spool_dir: str = ".trajbus/spool"
    retention_days: int = 90
    # How long the archiver (and compaction/retention) wait out an S3 outage, retrying with
    # backoff, before giving up (nothing is committed meanwhile; a restart resumes).
    store_retry_s: float = 600.0
    # Objects of one batch (one per hour and task) written at once: Parquet encoding, zstd
    # and uploads release the GIL, so the second thread uses a second core (BENCHMARKS.md).
    write_threads: int = Field(default=2, ge=1, le=32)


class Settings(BaseSettings):
    """All of trajbus's configuration. ``Settings()`` reads the environment."""

    model_config = SettingsConfigDict(
        env_prefix="TRAJBUS_", env_nested_delimiter="__", extra="ignore"
    )

    kafka: KafkaSettings = Field(default_factory=KafkaSettings)
    topics: TopicSettings = Field(default_factory=TopicSettings)
    producer: ProducerSideSettings = Field(default_factory=ProducerSideSettings)
    watchdog: WatchdogSettings = Field(default_factory=WatchdogSettings)
    scheduler: SchedulerSettings = Field(default_factory=SchedulerSettings)
    replay: ReplaySettings = Field(default_factory=ReplaySettings)
    archive: ArchiveSettings = Field(default_factory=ArchiveSettings)
    state_dir: Path = Path(".trajbus/state")
    # The log of the long-running processes (worker, archive run): text lines, or one JSON
    # object per line for log shippers (TRAJBUS_LOG_FORMAT=json, or --log-format json).
    log_format: Literal["text", "json"] = "text"


class SettingsError(UserError, ValueError):
    """The environment's ``TRAJBUS_*`` settings do not validate. The message names each
    variable and what is wrong with it, never a secret's value."""


OTHER_VARIABLES = frozenset({
    "TRAJBUS_DEBUG",  # --debug for every command (trajbus/cli.py)
    "TRAJBUS_WORKER_ID",  # the default of `trajbus worker --worker-id`
    "TRAJBUS_KAFKA_PORT", "TRAJBUS_KAFKA_DATA_DIR", "TRAJBUS_KAFKA_LIB_DIR",  # `trajbus kafka`
    "TRAJBUS_KAFKA_JVM_OPTIONS",
    "TRAJBUS_CHROMIUM",  # the browser of `replay waterfall` (consumers/operator/waterfall.py)
    # the test suite's and `make soak`'s knobs (tests/)
    "TRAJBUS_TEST_BOOTSTRAP", "TRAJBUS_SCALE_TEST", "TRAJBUS_SCALE_EPISODES",
    "TRAJBUS_CLUSTER_FAULTS",
})
"""``TRAJBUS_*`` variables that are not settings but are read elsewhere: known, so not refused
by :func:`check_unknown_variables`."""


def setting_variables(model: type[BaseModel] = Settings, prefix: str = "TRAJBUS_"
                      ) -> tuple[set[str], set[str]]:
    """(every variable naming a setting or a group of settings, the prefixes under which any
    deeper name is a key of a mapping setting such as ``TRAJBUS_WATCHDOG__PER_TASK__``)."""
    names: set[str] = set()
    open_prefixes: set[str] = set()
    for field_name, info in model.model_fields.items():
        name = prefix + field_name.upper()
        names.add(name)
        sub = info.annotation
        if isinstance(sub, type) and issubclass(sub, BaseModel):
            deeper, more = setting_variables(sub, name + "__")
            names |= deeper
            open_prefixes |= more
        elif "dict" in str(sub).lower():
            open_prefixes.add(name + "__")
    return names, open_prefixes


def check_unknown_variables(environ: dict[str, str] | None = None) -> None:
    """Refuse a ``TRAJBUS_*`` variable that names no setting (a typo would otherwise be
    ignored silently, and the default used), naming the nearest valid one."""
    import difflib

    env = os.environ if environ is None else environ
    names, open_prefixes = setting_variables()
    known = names | OTHER_VARIABLES
    unknown = sorted(k for k in env if k.upper().startswith("TRAJBUS_")
                     and k.upper() not in known
                     and not any(k.upper().startswith(p) for p in open_prefixes))
    if not unknown:
        return
    parts = []
    for k in unknown:
        near = difflib.get_close_matches(k.upper(), sorted(known), n=1, cutoff=0.6)
        parts.append(f"{k}: no such setting" + (f"; did you mean {near[0]}?" if near else ""))
    raise SettingsError("unknown settings: " + "; ".join(parts),
                        "the README's settings table describes every TRAJBUS_* variable "
                        "(`trajbus config` prints them all)")


def read_settings() -> Settings:
    """``Settings()`` from the environment, or :class:`SettingsError` saying which variable is
    wrong: one that does not validate, or one that names no setting
    (:func:`check_unknown_variables`). pydantic's own message quotes the inputs, and for a
    rule over several fields the whole group (``TRAJBUS_KAFKA__SASL_PASSWORD`` included); it
    is not chained, so a traceback does not print it either."""
    check_unknown_variables()
    try:
        return Settings()
    except ValidationError as exc:
        message = settings_error_message(exc, Settings)
    except PydanticSettingsError as exc:  # a variable holding JSON that does not parse
        message = _unparsable_message(str(exc))
    raise SettingsError(message, "the README's settings table describes every TRAJBUS_* "
                                 "variable")


def settings_error_message(exc: ValidationError, model: type[BaseModel] | None = None) -> str:
    """One line per error: the environment variable, its value when it is the plain value of
    one field of ``model`` (not a group) not named like a secret, and pydantic's reason."""
    lines = []
    for err in exc.errors(include_url=False):
        loc = err.get("loc", ())
        fields = [part for part in loc if isinstance(part, str)]
        items = [part for part in loc if isinstance(part, int)]
        name = "TRAJBUS_" + "__".join(f.upper() for f in fields) if fields else "TRAJBUS_*"
        value = err.get("input")
        if (err.get("type") == "value_error" and isinstance(value, dict)
                and _is_group(model, fields)):
            name += "__*"  # a rule over several of the group's fields
        if items:
            name += " (item " + ", ".join(str(i) for i in items) + ")"
        shown = ""
        if (isinstance(value, str | int | float | bool) and fields
                and not any(_is_secret(f) for f in fields) and _is_leaf(model, fields)):
            shown = f"={value!r}"
        reason = str(err.get("msg", "")).removeprefix("Value error, ")
        lines.append(f"{name}{shown}: {reason}")
    return "invalid settings: " + "; ".join(lines)


def _is_leaf(model: type[BaseModel] | None, fields: list[str]) -> bool:
    """Whether ``fields`` names one plain field of ``model`` (not a group of fields, whose
    value given as one string is not shown). Without a model, any location is a field."""
    for i, name in enumerate(fields):
        if model is None:
            return True
        info = model.model_fields.get(name)
        if info is None:
            return False
        sub = info.annotation
        if isinstance(sub, type) and issubclass(sub, BaseModel):
            model = sub
            continue
        return i == len(fields) - 1
    return False


def _is_group(model: type[BaseModel] | None, fields: list[str]) -> bool:
    """Whether ``fields`` names a group of settings (a sub-model, or the model itself), not one
    field that holds a mapping (``TRAJBUS_WATCHDOG__PER_TASK``). Without a model: a group."""
    for name in fields:
        if model is None:
            return True
        info = model.model_fields.get(name)
        sub = info.annotation if info is not None else None
        if not (isinstance(sub, type) and issubclass(sub, BaseModel)):
            return False
        model = sub
    return True


def _unparsable_message(text: str) -> str:
    """pydantic-settings names the group whose JSON did not parse; name its variables set."""
    match = re.search(r'field "(\w+)"', text)
    group = match.group(1).upper() if match else ""
    names = sorted(k for k in os.environ
                   if group and (k.upper() == f"TRAJBUS_{group}"
                                 or k.upper().startswith(f"TRAJBUS_{group}__")))
    where = ", ".join(names) or f"a TRAJBUS_{group or '*'} variable"
    return f"invalid settings: {where}: a value that must be JSON (a list or an object) does " \
           "not parse"


_URL_USERINFO = re.compile(r"(?<=://)[^/@\s]*@")


def mask_url_credentials(text: str) -> str:
    """``text`` with the user-info of every URL in it (``scheme://user:password@host``)
    replaced by ``***@``: what ``trajbus config`` and error messages print of a URL."""
    return _URL_USERINFO.sub("***@", text) if "@" in text else text


def _is_secret(field: str) -> bool:
    field = field.lower()
    return any(word in field for word in ("password", "secret", "token", "credential"))


@lru_cache(maxsize=1)
def get_settings() -> Settings:
    """The process's settings, read once from the environment (:class:`SettingsError` if they
    do not validate)."""
    return read_settings()
