"""faust-streaming shell: the same processor adapters as ``runner.py``, run as faust agents.

``trajbus worker --engine faust`` runs a processor as a ``faust.App`` (app id
``<prefix>.<processor>.faust``, also its consumer group) with one agent per processor. The
agent iterates ``stream.events()`` over the spec's input topics, turns each message into an
:class:`~trajbus.consumers.runner.InRecord`, feeds the partition's adapter (one adapter per input
partition, like the runner: partition ``p`` of every input topic shares one adapter) and

1. sends the adapter's :class:`OutRecord` outputs and **waits until the broker acknowledged
   them**, then
2. writes the adapter's ``take_dirty()`` state into a faust Table (``<app-id>-state-changelog``,
   compacted; key ``f"{partition}/{state key}"``, value bytes, a ``None`` deletes the key), in the
   changelog partition of the event,
3. and lets faust commit the input offset (faust flushes the producer before committing).

Guarantee: **at-least-once**. Outputs are durable before the state that remembers them, and that
state before the input offset, so a crash can only cause reprocessing: outputs produced after
the last committed offset may be published again (with the same deterministic event ids);
downstream dedupes by (episode, seq) — the ReplayClient does. A crash between a state write and
the offset commit replays inputs into a core that has seen them; the cores drop such exact
duplicates. Nothing is lost.

Why aiokafka (``runner.py``) is the default: it writes outputs, state and offsets in one Kafka
transaction, so a SIGKILLed worker produces nothing twice. faust's ``exactly_once`` mode logs and
swallows transaction errors (STACK-NOTES.md, faust #517/#177), so this shell does not claim it.

Time: a faust timer publishes :class:`Tick` events into every partition of the input topics,
exactly like the runner's ticker, so ticks are in the log and replays see them.

State recovery: faust rebuilds the Table from its changelog (``memory://`` store: from the start
of the changelog at every assignment) and pauses the assigned partitions until that is done; the
adapter of a partition is rebuilt from the Table entries with its prefix when that partition's
first event arrives, and dropped when the partition is revoked.

Limitations:
- Only processors whose inputs are plain topics and whose state is per partition: ``reorder``.
  faust-streaming 0.15.3 accepts ``app.topic(pattern=...)`` but its conductor subscribes by
  topic *names* only (``Topic.topics``; the aiokafka driver's ``subscribe`` carries the comment
  "XXX pattern does not work"), so pattern inputs (watchdog, scheduler: ``trajbus.replay.*``)
  never receive anything; the scheduler also needs one global core and a timestamp-ordered
  merge of all partitions. Use the aiokafka engine for those.
- Its consumer group (the app id) differs from the runner's: never run both engines for the
  same processor and prefix at once, or outputs are produced twice.
- ``memory://`` store (rocksdict is not installed here): every assignment re-reads the
  partition's changelog.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import faust
from faust.types import TP

from trajbus.bus.admin import ensure_topics
from trajbus.bus.kafka import check_broker, connection_options
from trajbus.bus.settings import Settings
from trajbus.bus.topics import Topics, TopicSpec
from trajbus.consumers import metrics
from trajbus.consumers.runner import TICK_KEY, InRecord, OutRecord, Processor, ProcessorSpec
from trajbus.schemas.models import Envelope, Tick

log = logging.getLogger("trajbus.faust")
SUPPORTED = ("reorder",)
TABLE = "state"


class UnsupportedProcessor(ValueError):
    """The processor cannot run on the faust engine (see the module docstring)."""


def check_supported(spec: ProcessorSpec) -> None:
    if spec.input_pattern or spec.global_state or spec.ordered:
        raise UnsupportedProcessor(
            f"processor {spec.name!r} cannot run on the faust engine: it needs "
            + ("pattern-subscribed inputs (faust-streaming subscribes by topic names only)"
               if spec.input_pattern else "one global core over a timestamp-ordered merge")
            + f"; faust supports {', '.join(SUPPORTED)}. Use --engine aiokafka.")


def _credentials(settings: Settings) -> Any:
    k = settings.kafka
    if k.security_protocol == "PLAINTEXT":
        return None
    opts = connection_options(k)  # validates SASL settings, builds the SSL context
    if k.security_protocol.startswith("SASL"):
        password = k.sasl_password.get_secret_value() if k.sasl_password else None
        return faust.SASLCredentials(username=k.sasl_username, password=password,
                                     mechanism=k.sasl_mechanism,
                                     ssl_context=opts.get("ssl_context"))
    return faust.SSLCredentials(opts["ssl_context"])


class FaustEngine:
    """One processor as a faust app: ``engine.app`` (run it with :meth:`run`),
    ``engine.agent``, ``engine.table``; ``engine.adapters`` maps input partition -> adapter."""

    def __init__(self, settings: Settings, spec: ProcessorSpec, worker_id: str = "w0", *,
                 store: str = "memory://", datadir: Path | None = None) -> None:
        check_supported(spec)
        self.settings = settings
        self.spec = spec
        self.worker_id = worker_id
        self.topics = Topics(settings)
        self.app_id = f"{settings.topics.prefix}.{spec.name}.faust"
        self.adapters: dict[int, Processor] = {}
        self.processed = 0
        self._known_topics: set[str] = set()
        self._out_topics: dict[str, Any] = {}
        self._tick_seq = 0
        k, t = settings.kafka, settings.topics
        self.datadir = datadir or (settings.state_dir / "faust" / self.app_id / worker_id)
        self.app = faust.App(
            self.app_id,
            broker=[f"kafka://{h.strip()}" for h in k.bootstrap_servers.split(",") if h.strip()],
            broker_credentials=_credentials(settings),
            store=store,
            datadir=str(self.datadir),
            web_enabled=False,
            autodiscover=False,
            key_serializer="raw",
            value_serializer="raw",
            processing_guarantee="at_least_once",
            topic_partitions=t.partitions,
            topic_replication_factor=t.replication_factor,
            topic_disable_leader=True,
            consumer_auto_offset_reset="earliest",
            consumer_max_fetch_size=4 * k.max_request_size,
            producer_max_request_size=k.max_request_size,
            producer_compression_type=k.compression_type,
            producer_linger=k.linger_ms / 1000,
            producer_acks=-1,
            broker_commit_interval=1.0,
            # A SIGKILLed member must leave the group quickly (aiokafka's defaults, not 60s).
            broker_session_timeout=10.0,
            broker_heartbeat_interval=3.0,
            broker_max_poll_records=500,
            stream_wait_empty=False,  # faust "wait_empty hangs" after rebalances (STACK-NOTES)
        )
        self.table = self.app.Table(
            TABLE, partitions=t.partitions, key_type=bytes, value_type=bytes,
            extra_topic_configs={"max.message.bytes": str(t.max_message_bytes)})
        self.inputs = self.app.topic(*spec.input_topics, key_type=bytes, value_type=bytes,
                                     key_serializer="raw", value_serializer="raw")
        self.agent = self.app.agent(self.inputs, name=f"{spec.name}")(self._agent)
        self.app.timer(settings.scheduler.tick_interval_ms / 1000)(self._tick)
        self.app.on_partitions_revoked.connect(self._on_revoked)

    # -- topics ---------------------------------------------------------------------------
    async def prepare(self) -> None:
        """Fail fast if the broker is down; create the shared and output topics (faust
        creates its own changelog topic)."""
        await check_broker(self.settings.kafka)
        self.datadir.mkdir(parents=True, exist_ok=True)
        specs = self.topics.specs + list(self.spec.output_topics()) + self.spec.extra_topics
        await ensure_topics(self.settings, specs)
        self._known_topics.update(s.name for s in specs)

    async def _ensure_output_topic(self, topic: str) -> None:
        if topic in self._known_topics:
            return
        await ensure_topics(self.settings, [TopicSpec(
            topic, self.settings.topics.partitions, "derived output", "episode",
            max_message_bytes=self.topics.derived_max_bytes)])
        self._known_topics.add(topic)

    # -- state ----------------------------------------------------------------------------
    def adapter(self, partition: int) -> Processor:
        """The partition's adapter, restored from the Table on first use after assignment
        (faust keeps assigned partitions paused until the Table has recovered them)."""
        core = self.adapters.get(partition)
        if core is None:
            core = self.spec.factory()
            prefix = f"{partition}/".encode()
            restored = 0
            for key, blob in list(self.table.items()):
                if key.startswith(prefix) and blob is not None:
                    core.restore(key[len(prefix):].decode(), blob)
                    restored += 1
            self.adapters[partition] = core
            log.info("%s: restored %d state records for partition %d",
                     self.spec.name, restored, partition)
        return core

    async def _on_revoked(self, sender: Any, /, *args: Any, signal: Any,
                          **kwargs: Any) -> None:
        """``app.on_partitions_revoked`` receiver: ``(app, revoked, signal=...)``."""
        revoked: set[TP] = args[0] if args else kwargs.get("revoked", set())
        for tp in revoked:
            self.adapters.pop(tp.partition, None)

    def _persist(self, partition: int, dirty: dict[str, bytes | None]) -> None:
        for key, blob in dirty.items():
            k = f"{partition}/{key}".encode()
            if blob is None:
                if k in self.table:
                    del self.table[k]  # a tombstone in the changelog
            else:
                self.table[k] = blob

    # -- processing -----------------------------------------------------------------------
    async def _agent(self, stream: Any) -> AsyncIterator[list[OutRecord]]:
        async for event in stream.events():
            yield await self.handle(event.message)

    async def handle(self, message: Any) -> list[OutRecord]:
        """One input message: adapter -> outputs (acknowledged) -> state -> (offset)."""
        rec = InRecord(message.topic, message.partition, message.offset, message.key,
                       message.value or b"", round(message.timestamp * 1000))
        core = self.adapter(rec.partition)
        outs = core.handle(rec)
        metrics.EVENTS_IN.labels(self.spec.name, rec.topic).inc()
        pending = [await self.send(out) for out in outs]
        for fut in pending:
            await fut  # outputs are durable before the state that remembers them
        self._persist(rec.partition, core.take_dirty())
        for out in outs:
            metrics.EVENTS_OUT.labels(self.spec.name, out.topic).inc()
        self.processed += 1
        return outs

    async def send(self, out: OutRecord) -> Any:
        """Publish one output now (not attached to the offset commit); returns an awaitable
        that completes when the broker acknowledged it. Tests replace this seam."""
        await self._ensure_output_topic(out.topic)
        topic = self._out_topics.get(out.topic)
        if topic is None:
            topic = self._out_topics[out.topic] = self.app.topic(
                out.topic, key_type=bytes, value_type=bytes,
                key_serializer="raw", value_serializer="raw")
        return await topic.send(key=out.key, value=out.value, partition=out.partition,
                                force=True)

    async def _tick(self) -> None:
        """Like the runner's ticker: a Tick into every partition of the input topics."""
        now = int(time.time() * 1000)
        tick = Tick(header=Envelope(task="_tick", sandbox="_tick", seq=self._tick_seq,
                                    event_time_ms=now,
                                    producer_id=f"{self.app_id}.{self.worker_id}")).encode()
        self._tick_seq += 1
        pending = []
        for name in self.spec.tick_topics or self.spec.input_topics:
            topic = self.app.topic(name, key_type=bytes, value_type=bytes,
                                   key_serializer="raw", value_serializer="raw")
            parts = self.app.consumer.topic_partitions(name) or self.settings.topics.partitions
            for p in range(parts):
                pending.append(await topic.send(key=TICK_KEY, value=tick, partition=p))
        await asyncio.gather(*pending)

    # -- running --------------------------------------------------------------------------
    def run(self, *, verbose: bool = False) -> int:
        """Prepare topics, then run a faust Worker until SIGTERM/SIGINT. Returns its exit code."""
        loop = asyncio.new_event_loop()
        asyncio.set_event_loop(loop)
        loop.run_until_complete(self.prepare())
        worker = faust.Worker(self.app, loop=loop, loglevel="INFO" if verbose else "WARNING",
                              override_logging=False, quiet=True)
        try:
            worker.execute_from_commandline()
        except SystemExit as exc:
            return int(exc.code or 0)
        return 0


def build_engine(settings: Settings, names: list[str], worker_id: str = "w0",
                 **options: Any) -> FaustEngine:
    """The faust engine for ``trajbus worker --engine faust --processors NAME``."""
    from trajbus.consumers.cli import build_specs

    if len(names) != 1:
        raise UnsupportedProcessor(
            f"the faust engine runs one processor per worker (got {', '.join(names) or 'none'});"
            f" supported: {', '.join(SUPPORTED)}")
    return FaustEngine(settings, build_specs(settings, names)[0], worker_id, **options)
