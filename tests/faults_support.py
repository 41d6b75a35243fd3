"""Helpers for the fault-injection, bad-input, security and hygiene tests (issue 9).

- :func:`own_broker`: a private LocalBroker for tests that kill or reconfigure the broker
  (the session ``kafka_broker`` is shared and must never be killed).
- :class:`PausableProxy`: a TCP proxy (asyncio, in its own thread) in front of a server, that
  can refuse connections, hold traffic (a hung endpoint) or slow it down.
- Kafka readers: committed group offsets, end offsets, "read every record of these topics",
  "wait until a group has consumed everything".
- :class:`PacedFleet`: sandboxes emitting steadily through real :class:`SandboxEmitter` s, with
  the (seq, event_id) pairs the broker acknowledged recorded per episode.
- :func:`trainer_view`: what a trainer's ReplayClient receives, per episode, with every copy
  counted (a duplicate is visible, never silently merged).
- /proc readers (fds, RSS), and a throw-away CA + broker certificate for TLS tests.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import ipaddress
import os
import threading
import time
from collections import Counter, defaultdict, deque
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from aiokafka import AIOKafkaConsumer, TopicPartition
from aiokafka.admin import AIOKafkaAdminClient

from trajbus.bus.kafka import connection_options
from trajbus.bus.settings import Settings
from trajbus.infra.broker import KafkaSetupError, LocalBroker, free_port


# -- a private broker ----------------------------------------------------------------------
@contextlib.contextmanager
def own_broker(data_dir: Path, **kwargs: Any) -> Iterator[LocalBroker]:
    """A LocalBroker of this test alone (free ports), stopped (or killed) at the end."""
    broker = LocalBroker(data_dir=data_dir, port=kwargs.pop("port", None) or free_port(),
                         controller_port=kwargs.pop("controller_port", None) or free_port(),
                         **kwargs)
    problem: KafkaSetupError | None = None
    try:
        broker.start(timeout=120)
    except KafkaSetupError as exc:  # skip locally, fail in CI (as the kafka_broker fixture)
        problem = exc
    if problem is not None:
        from support import broker_unavailable

        broker_unavailable(problem)
    try:
        yield broker
    finally:
        try:
            broker.stop(timeout=20)
        except Exception:
            broker.kill()


# -- a TCP proxy we control ------------------------------------------------------------------
class PausableProxy:
    """``127.0.0.1:<port>`` -> ``target``. Modes (switch at any time, thread-safe):

    - ``resume()``: forward normally;
    - ``refuse()``: close the listener and abort open connections: clients get
      "connection refused" (an endpoint that is down);
    - ``hold()``: accept and keep connections but forward nothing (a hung endpoint);
    - ``slow(delay_s)``: forward, sleeping ``delay_s`` before every chunk.

    ``stats`` counts connections, bytes each way and chunks that waited on ``hold()``.
    """

    def __init__(self, target_host: str, target_port: int) -> None:
        self.target = (target_host, target_port)
        self.port = free_port()
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self._server: asyncio.base_events.Server | None = None
        self._conns: set[asyncio.StreamWriter] = set()
        self._flowing: asyncio.Event | None = None
        self.delay_s = 0.0
        self.stats: Counter[str] = Counter()

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _call(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout=10)

    def start(self) -> PausableProxy:
        self._thread.start()

        async def init() -> None:
            self._flowing = asyncio.Event()
            self._flowing.set()
            await self._listen()

        self._call(init())
        return self

    async def _listen(self) -> None:
        if self._server is None:
            self._server = await asyncio.start_server(self._handle, "127.0.0.1", self.port,
                                                      reuse_address=True)

    def _accept(self, writer: asyncio.StreamWriter) -> bool:
        """Whether a new connection is forwarded (a subclass may abort it instead)."""
        return True

    def _intercept(self, data: bytes, up: bool) -> bool:
        """Whether ``data`` (``up``: client to target) ends its connection instead of being
        forwarded (a subclass's trigger)."""
        return False

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if not self._accept(writer):
            return
        self.stats["connections"] += 1
        try:
            up_r, up_w = await asyncio.open_connection(*self.target)
        except OSError:
            writer.close()
            return
        self._conns.update((writer, up_w))

        async def pipe(r: asyncio.StreamReader, w: asyncio.StreamWriter, up: bool) -> None:
            try:
                while data := await r.read(65536):
                    if self._intercept(data, up):
                        return
                    assert self._flowing is not None
                    if not self._flowing.is_set():  # hold(): a request waits on the hung end
                        self.stats["held"] += 1
                        await self._flowing.wait()
                    if self.delay_s:
                        await asyncio.sleep(self.delay_s)
                    w.write(data)
                    await w.drain()
                    self.stats["bytes_up" if up else "bytes_down"] += len(data)
            except (OSError, asyncio.CancelledError):
                pass
            finally:
                with contextlib.suppress(Exception):
                    w.close()

        await asyncio.gather(pipe(reader, up_w, True), pipe(up_r, writer, False))
        self._conns.difference_update((writer, up_w))

    def refuse(self) -> None:
        async def go() -> None:
            if self._server is not None:
                self._server.close()
                self._server = None
            for w in list(self._conns):
                w.transport.abort()
            self._conns.clear()

        self._call(go())

    def hold(self) -> None:
        async def go() -> None:
            assert self._flowing is not None
            self._flowing.clear()

        self._call(go())

    def slow(self, delay_s: float) -> None:
        self.delay_s = delay_s
        self.resume()

    def resume(self) -> None:
        async def go() -> None:
            assert self._flowing is not None
            self._flowing.set()
            await self._listen()

        self._call(go())

    def stop(self) -> None:
        with contextlib.suppress(Exception):
            self.refuse()
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=5)


# -- Kafka readers ---------------------------------------------------------------------------
@dataclass(frozen=True)
class Rec:
    topic: str
    partition: int
    offset: int
    key: bytes | None
    value: bytes | None


async def committed_offsets(settings: Settings, group: str) -> dict[TopicPartition, int]:
    from aiokafka.errors import KafkaError

    admin = AIOKafkaAdminClient(**connection_options(settings.kafka))
    await admin.start()
    try:
        for attempt in range(100):  # the group coordinator is briefly unavailable at first
            try:
                got = await admin.list_consumer_group_offsets(group)
                break
            except KafkaError as exc:
                if not getattr(exc, "retriable", False) or attempt == 99:
                    raise
                await asyncio.sleep(0.3)
    finally:
        await admin.close()
    return {tp: om.offset for tp, om in got.items() if om.offset >= 0}


async def end_offsets(settings: Settings, topics: Iterable[str],
                      read_committed: bool = True) -> dict[TopicPartition, int]:
    consumer = AIOKafkaConsumer(**connection_options(settings.kafka), enable_auto_commit=False,
                                isolation_level="read_committed" if read_committed
                                else "read_uncommitted")
    await consumer.start()
    try:
        tps = []
        for t in topics:
            parts = await consumer._client._wait_on_metadata(t)
            tps += [TopicPartition(t, p) for p in sorted(parts)]
        return dict(await consumer.end_offsets(tps)) if tps else {}
    finally:
        await consumer.stop()


async def wait_caught_up(settings: Settings, group: str, topics: list[str],
                         timeout: float = 60) -> None:
    """Wait until ``group`` has committed every record of ``topics`` (end offsets taken now)."""
    ends = await end_offsets(settings, topics)
    deadline = time.monotonic() + timeout
    while True:
        done = await committed_offsets(settings, group)
        behind = {tp: end for tp, end in ends.items() if end > 0 and done.get(tp, 0) < end}
        if behind and all(done.get(tp, 0) >= end - 2 for tp, end in behind.items()):
            # transaction markers take offsets too: behind only if a record remains
            behind = {tp: end for tp, end in behind.items()
                      if await _records_between(settings, tp, done.get(tp, 0), end)}
        if not behind:
            return
        if time.monotonic() > deadline:
            raise TimeoutError(f"group {group} behind on {behind} (committed {done})")
        await asyncio.sleep(0.3)


async def _records_between(settings: Settings, tp: TopicPartition, start: int,
                           end: int) -> bool:
    """True if committed records exist in [start, end) of ``tp`` (markers do not count)."""
    consumer = AIOKafkaConsumer(**connection_options(settings.kafka), enable_auto_commit=False,
                                isolation_level="read_committed")
    await consumer.start()
    try:
        consumer.assign([tp])
        consumer.seek(tp, start)
        deadline = time.monotonic() + 10
        while await consumer.position(tp) < end and time.monotonic() < deadline:
            batch = await consumer.getmany(tp, timeout_ms=200)
            if any(m.offset < end for msgs in batch.values() for m in msgs):
                return True
        return False
    finally:
        await consumer.stop()


async def read_all(settings: Settings, topics: Iterable[str], read_committed: bool = True,
                   timeout: float = 60) -> list[Rec]:
    """Every record of ``topics`` from the beginning up to the end offsets taken now."""
    topics = list(topics)
    consumer = AIOKafkaConsumer(**connection_options(settings.kafka), enable_auto_commit=False,
                                isolation_level="read_committed" if read_committed
                                else "read_uncommitted",
                                max_partition_fetch_bytes=16 * 1024 * 1024,
                                fetch_max_bytes=64 * 1024 * 1024)
    await consumer.start()
    out: list[Rec] = []
    try:
        tps = []
        for t in topics:
            parts = await consumer._client._wait_on_metadata(t)
            tps += [TopicPartition(t, p) for p in sorted(parts)]
        if not tps:
            return out
        consumer.assign(tps)
        await consumer.seek_to_beginning(*tps)
        ends = await consumer.end_offsets(tps)
        pending = {tp for tp in tps if ends[tp] > 0}
        deadline = time.monotonic() + timeout
        while pending:
            if time.monotonic() > deadline:
                raise TimeoutError(f"reading {topics}: still pending {pending}")
            batch = await consumer.getmany(*pending, timeout_ms=300)
            for tp, msgs in batch.items():
                out += [Rec(tp.topic, tp.partition, m.offset, m.key, m.value) for m in msgs]
            for tp in list(pending):
                if await consumer.position(tp) >= ends[tp]:
                    pending.discard(tp)
    finally:
        await consumer.stop()
    return out


async def list_topics(settings: Settings, prefix: str) -> list[str]:
    admin = AIOKafkaAdminClient(**connection_options(settings.kafka))
    await admin.start()
    try:
        return sorted(t for t in await admin.list_topics() if t.startswith(prefix + "."))
    finally:
        await admin.close()


# -- the trainer's view ----------------------------------------------------------------------
@dataclass
class TrainerView:
    """Per episode the (seq, event_id) pairs a trainer received, in arrival order; every
    delivery counted (an episode finished twice, or an event received twice, shows)."""

    events: dict[tuple[str, str], list[tuple[int, str]]] = field(
        default_factory=lambda: defaultdict(list))
    finished: Counter[tuple[str, str]] = field(default_factory=Counter)
    gaps: dict[tuple[str, str], list[tuple[int, int]]] = field(
        default_factory=lambda: defaultdict(list))
    terminal: dict[tuple[str, str], bool] = field(default_factory=dict)

    def complete(self, keys: Iterable[tuple[str, str]]) -> bool:
        return all(self.finished[k] for k in keys)


async def trainer_view(settings: Settings, tasks: list[str], group: str,
                       until: Any, timeout: float = 120, view: TrainerView | None = None,
                       settle_s: float = 1.5) -> TrainerView:
    """Run a ReplayClient until ``until(view)`` holds, then keep reading ``settle_s`` more
    seconds (a late duplicate would show), acknowledging every segment."""
    from trajbus.consumers.replay.client import ReplayClient

    view = view or TrainerView()

    async def loop(client: ReplayClient) -> None:
        done_at: float | None = None
        async for seg in client.segments(idle_timeout=0.5):
            _add(view, seg)
            await client.ack(seg)
            if done_at is None and until(view):
                done_at = time.monotonic()
            if done_at is not None and time.monotonic() - done_at > settle_s:
                return

    async with ReplayClient(tasks, group, settings) as client:
        deadline = time.monotonic() + timeout
        while True:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(loop(client), max(1.0, deadline - time.monotonic()))
            if until(view):
                # the iterator stopped on idle or after settling: one more short idle read
                async for seg in client.segments(idle_timeout=settle_s):
                    _add(view, seg)
                    await client.ack(seg)
                return view
            if time.monotonic() > deadline:
                return view  # the caller's comparison says what is missing


def _add(view: TrainerView, seg: Any) -> None:
    key = (seg.sandbox, seg.episode)
    for ev in seg.events:
        h = ev.record["header"]
        view.events[key].append((h["seq"], h["event_id"]))
    if seg.gap:
        view.gaps[key].append(seg.gap)
    if seg.is_last:
        view.finished[key] += 1
        view.terminal[key] = seg.is_terminal


def diff_views(expected: dict[tuple[str, str], list[tuple[int, str]]],
               view: TrainerView) -> list[str]:
    """Human-readable differences between acknowledged and received (empty = exact)."""
    problems = []
    for key, want in sorted(expected.items()):
        want = sorted(want)
        got = view.events.get(key, [])
        if got != want:
            missing = sorted(set(want) - set(got))[:3]
            extra = sorted(set(got) - set(want))[:3]
            dups = [x for x, n in Counter(got).items() if n > 1][:3]
            problems.append(f"{key}: got {len(got)} events, acknowledged {len(want)}; missing "
                            f"{missing} unexpected {extra} duplicated {dups}")
        if view.finished[key] != 1:
            problems.append(f"{key}: finished {view.finished[key]} times")
    for key in set(view.events) - set(expected):
        problems.append(f"{key}: received but never acknowledged")
    return problems


class LiveTrainer:
    """A trainer that runs *through* faults: one :class:`ReplayClient` started before the
    fault and kept until :meth:`stop`, written like a plain trainer (no retry, no
    try/except around the client): every segment recorded in :attr:`view` and acknowledged at
    once (or, with ``ack_lag=n``, only once ``n`` later segments have arrived: segments are
    held unacknowledged across the fault). If the client raises, the task ends and
    :attr:`error` holds the exception."""

    def __init__(self, settings: Settings, tasks: list[str], group: str,
                 ack_lag: int = 0) -> None:
        self.settings = settings
        self.ack_lag = ack_lag
        self.tasks = tasks
        self.group = group
        self.view = TrainerView()
        self.error: BaseException | None = None
        self.client: Any = None
        self._stop = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    def start(self) -> LiveTrainer:
        self._task = asyncio.create_task(self._run())
        return self

    async def _run(self) -> None:
        from trajbus.consumers.replay.client import ReplayClient

        try:
            async with ReplayClient(self.tasks, self.group, self.settings) as client:
                self.client = client
                held: deque[Any] = deque()
                while not self._stop.is_set():
                    async for seg in client.segments(idle_timeout=0.5):
                        _add(self.view, seg)
                        held.append(seg)
                        while len(held) > self.ack_lag:
                            await client.ack(held.popleft())
                        if self._stop.is_set():
                            break
                    while held and self._stop.is_set():
                        await client.ack(held.popleft())
        except BaseException as exc:
            self.error = exc
            raise

    @property
    def alive(self) -> bool:
        return self._task is not None and not self._task.done()

    def _check(self) -> None:
        if not self.alive:
            raise AssertionError(f"the trainer task ended: {self.error!r}") from self.error

    async def wait_until(self, cond: Any, timeout: float) -> None:
        """Wait until ``cond(view)``; fail at once if the trainer task ended."""
        deadline = time.monotonic() + timeout
        while not cond(self.view):
            self._check()
            if time.monotonic() > deadline:
                return  # the caller's comparison says what is missing
            await asyncio.sleep(0.2)
        self._check()

    async def stop(self, settle_s: float = 1.5) -> None:
        """Keep reading ``settle_s`` more seconds (a late duplicate would show), then stop."""
        await asyncio.sleep(settle_s)
        self._check()
        self._stop.set()
        assert self._task is not None
        await asyncio.wait_for(self._task, 60)


# -- a steadily emitting fleet -----------------------------------------------------------------
class PacedFleet:
    """``n`` sandboxes, each running episodes of tool call/result pairs, one step every
    ``step_s``, until :meth:`stop`; then each ends its episode and closes (waiting for acks).
    ``acked[(sandbox, episode)]`` = the (seq, event_id) pairs the broker acknowledged."""

    def __init__(self, settings: Settings, state_root: Path, n: int = 4, task: str = "task-a",
                 step_s: float = 0.02, steps_per_episode: int = 30, name: str = "pf",
                 env: dict[str, str] | None = None, args_extra: str = "") -> None:
        self.settings = settings
        self.state_root = state_root
        self.n = n
        self.task = task
        self.step_s = step_s
        self.steps = steps_per_episode
        self.name = name
        self.env = env or {}
        self.args_extra = args_extra
        self.acked: dict[tuple[str, str], list[tuple[int, str]]] = defaultdict(list)
        self.emitted = 0
        self._stop = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []
        self.closed_ok: list[bool] = []

    def start(self) -> PacedFleet:
        self._tasks = [asyncio.create_task(self._run(i)) for i in range(self.n)]
        return self

    async def _run(self, i: int) -> None:
        from trajbus.producers.emitter import SandboxEmitter

        sandbox = f"{self.name}-sb-{i}"

        def on_ack(info: Any) -> None:
            if info.episode is not None:
                self.acked[(sandbox, info.episode)].append((info.seq, info.event_id))

        em = SandboxEmitter(sandbox, self.task, settings=self.settings, env=self.env,
                            state_dir=self.state_root / sandbox, durability="os",
                            queue_policy="spill", on_ack=on_ack)
        await em.start()
        ep_n = 0
        try:
            while not self._stop.is_set():
                episode = f"{sandbox}-ep-{ep_n}"
                ep_n += 1
                await em.start_episode(episode)
                for s in range(self.steps):
                    cid = await em.tool_call(episode, "bash",
                                             {"cmd": f"step {s} {self.args_extra}"})
                    await em.tool_result(episode, cid, "bash", {"out": f"{s} {self.args_extra}"})
                    self.emitted += 2
                    if self._stop.is_set():
                        break
                    await asyncio.sleep(self.step_s)
                await em.end_episode(episode)
        finally:
            self.closed_ok.append(await em.close(120))

    async def stop(self) -> None:
        self._stop.set()
        await asyncio.gather(*self._tasks)


# -- /proc -----------------------------------------------------------------------------------
def proc_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def proc_rss_kb(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise RuntimeError("no VmRSS")


# -- TLS material ----------------------------------------------------------------------------
def make_tls(directory: Path) -> dict[str, Path]:
    """A CA and a broker certificate for 127.0.0.1/localhost (PEM). Returns paths:
    ``ca`` (CA certificate) and ``keystore`` (broker key + certificate chain, for Kafka's
    ``ssl.keystore.type=PEM``); for mutual TLS also ``client_cert`` / ``client_key`` (a
    client certificate, CN ``trajbus-client``, signed by the same CA) and ``rogue_cert`` /
    ``rogue_key`` (a client certificate signed by another CA, which the broker must refuse)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    now = dt.datetime.now(dt.UTC)
    pem = serialization.Encoding.PEM

    def name(cn: str) -> x509.Name:
        return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])

    def make_ca(cn: str) -> tuple[Any, Any]:
        key = ec.generate_private_key(ec.SECP256R1())
        cert = (x509.CertificateBuilder().subject_name(name(cn))
                .issuer_name(name(cn)).public_key(key.public_key())
                .serial_number(x509.random_serial_number())
                .not_valid_before(now - dt.timedelta(minutes=5))
                .not_valid_after(now + dt.timedelta(days=1))
                .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
                .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True,
                                             crl_sign=True, content_commitment=False,
                                             key_encipherment=False, data_encipherment=False,
                                             key_agreement=False, encipher_only=False,
                                             decipher_only=False), critical=True)
                .sign(key, hashes.SHA256()))
        return key, cert

    def leaf(ca_key: Any, ca: Any, cn: str, usage: Any, san: list[Any]) -> tuple[Any, Any]:
        key = ec.generate_private_key(ec.SECP256R1())
        builder = (x509.CertificateBuilder().subject_name(name(cn))
                   .issuer_name(ca.subject).public_key(key.public_key())
                   .serial_number(x509.random_serial_number())
                   .not_valid_before(now - dt.timedelta(minutes=5))
                   .not_valid_after(now + dt.timedelta(days=1))
                   .add_extension(x509.ExtendedKeyUsage([usage]), critical=False))
        if san:
            builder = builder.add_extension(x509.SubjectAlternativeName(san), critical=False)
        return key, builder.sign(ca_key, hashes.SHA256())

    def key_pem(key: Any) -> bytes:
        return bytes(key.private_bytes(pem, serialization.PrivateFormat.PKCS8,
                                       serialization.NoEncryption()))

    ca_key, ca = make_ca("trajbus test CA")
    key, cert = leaf(ca_key, ca, "localhost", ExtendedKeyUsageOID.SERVER_AUTH,
                     [x509.DNSName("localhost"),
                      x509.IPAddress(ipaddress.ip_address("127.0.0.1"))])
    directory.mkdir(parents=True, exist_ok=True)
    out = {name_: directory / f"{name_.replace('_', '-')}.pem" for name_ in (
        "ca", "client_cert", "client_key", "rogue_cert", "rogue_key")}
    out["keystore"] = directory / "broker-keystore.pem"
    out["ca"].write_bytes(ca.public_bytes(pem))
    out["keystore"].write_bytes(key_pem(key) + cert.public_bytes(pem) + ca.public_bytes(pem))
    c_key, c_cert = leaf(ca_key, ca, "trajbus-client", ExtendedKeyUsageOID.CLIENT_AUTH, [])
    out["client_cert"].write_bytes(c_cert.public_bytes(pem))
    out["client_key"].write_bytes(key_pem(c_key))
    rogue_ca_key, rogue_ca = make_ca("some other CA")
    r_key, r_cert = leaf(rogue_ca_key, rogue_ca, "trajbus-client",
                         ExtendedKeyUsageOID.CLIENT_AUTH, [])
    out["rogue_cert"].write_bytes(r_cert.public_bytes(pem))
    out["rogue_key"].write_bytes(key_pem(r_key))
    return out


# -- a worker with a metrics endpoint ---------------------------------------------------------
def start_worker(settings: Settings, processors: str, worker_id: str, log_path: Path,
                 metrics_port: int | None = None, **extra_env: str) -> Any:
    """Like support.Worker(...).start(), optionally with ``--metrics-port``."""
    import subprocess
    import sys

    from support import REPO, Worker, env_for

    w = Worker(settings, processors, worker_id, log_path=log_path, extra_env=dict(extra_env))
    cmd = [sys.executable, "-m", "trajbus", "worker", "--processors", processors,
           "--worker-id", worker_id, "-v"]
    if metrics_port is not None:
        cmd += ["--metrics-port", str(metrics_port)]
    out = open(log_path, "ab")
    w.proc = subprocess.Popen(cmd, env=env_for(settings, **extra_env), stdout=out, stderr=out,
                              cwd=REPO)
    return w


def scrape(port: int, name: str, timeout: float = 20) -> dict[str, float]:
    """Samples of metric ``name`` from http://127.0.0.1:port/metrics: labels text -> value."""
    import urllib.request

    deadline = time.monotonic() + timeout
    while True:
        try:
            text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read()
            break
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.3)
    out: dict[str, float] = {}
    for line in text.decode().splitlines():
        if line.startswith(name + "{"):
            labels, value = line[len(name):].rsplit(" ", 1)
            out[labels] = float(value)
    return out
