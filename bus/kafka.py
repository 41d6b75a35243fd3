"""The fail-fast broker check and the classification of Kafka errors.

- :func:`check_broker` / :func:`prefer_answering_hosts`: at start-up, which bootstrap hosts
  answer (fastest first; the clients built next try them first), and a message that says
  what to set when none does (unreachable, TLS or SASL refused).
- :func:`lasting_delivery_error`, :func:`broker_went_away`, :func:`sender_crash`,
  :func:`retry_while_broker_restarts`: which errors a restart of the broker explains and
  which are lasting.

Clients are built in ``bus/clients.py`` (re-exported here: ``connection_options``,
``admin_client``, ``ClusterAdminClient``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from trajbus.bus.clients import (
    _BOOTSTRAP_ORDER,
    ClusterAdminClient,
    admin_client,
    ask_last,
    connection_options,
    new_admin,
)
from trajbus.bus.closing import close_client
from trajbus.bus.settings import KafkaSettings

log = logging.getLogger("trajbus.kafka")
T = TypeVar("T")
_BOOTSTRAP_GRACE_S = 0.5

__all__ = [
    "BrokerAuthenticationError", "BrokerUnavailableError", "ClusterAdminClient", "admin_client",
    "broker_went_away", "check_broker", "connection_options", "lasting_delivery_error",
    "order_bootstrap", "prefer_answering_hosts", "retry_while_broker_restarts", "sender_crash",
]


class BrokerUnavailableError(RuntimeError):
    """The configured Kafka bootstrap servers did not answer."""


class BrokerAuthenticationError(BrokerUnavailableError):
    """The broker answered but refused the configured SASL credentials (or the TLS
    handshake: an untrusted server certificate, a missing or refused client certificate)."""


async def order_bootstrap(k: KafkaSettings) -> list[str]:
    """Of several bootstrap hosts, those that answer (each asked on its own, at once; the
    first answer and those within 0.5 s after it), fastest first. The process's clients then
    bootstrap from them first (``connection_options``). Returns [] if none answered within
    ``connect_timeout_s``; one host is returned as is, unasked. The hosts that did not answer
    are asked last by :class:`ClusterAdminClient` for the next minute."""
    hosts = [h.strip() for h in k.bootstrap_servers.split(",") if h.strip()]
    if len(hosts) < 2:
        return hosts

    async def ask(host: str) -> str:
        admin = new_admin(k, "check", bootstrap_servers=host)
        try:
            await admin.start()
            return host
        finally:
            await close_client(admin, f"bootstrap check of {host}", timeout=2)

    tasks = {asyncio.ensure_future(ask(h)): h for h in hosts}
    answered: list[str] = []
    deadline = time.monotonic() + k.connect_timeout_s
    try:
        pending = set(tasks)
        while pending and time.monotonic() < deadline:
            wait = (deadline - time.monotonic() if not answered
                    else min(_BOOTSTRAP_GRACE_S, deadline - time.monotonic()))
            done, pending = await asyncio.wait(pending, timeout=max(0.0, wait),
                                               return_when=asyncio.FIRST_COMPLETED)
            if not done:
                break
            answered += [tasks[t] for t in done if not t.cancelled() and t.exception() is None]
    finally:
        for t in tasks:
            if not t.done():
                t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    for host in hosts:
        if host not in answered:
            ask_last(host)  # a frozen node accepts connections: the admin asks it last
    if answered:
        _BOOTSTRAP_ORDER[k.bootstrap_servers] = ",".join(
            answered + [h for h in hosts if h not in answered])
    return answered


async def prefer_answering_hosts(k: KafkaSettings) -> None:
    """Once per process and bootstrap list: :func:`order_bootstrap`, so the clients built
    next bootstrap from hosts that answer. Never raises (the client's start says what is
    wrong)."""
    if "," in k.bootstrap_servers and k.bootstrap_servers not in _BOOTSTRAP_ORDER:
        with contextlib.suppress(Exception):
            await order_bootstrap(k)


async def check_broker(k: KafkaSettings) -> list[str]:
    """Fail fast: connect once and list topics, or raise an error that says what to set. With
    several bootstrap hosts, those that answer go first for every later client of the process
    (:func:`order_bootstrap`): one dead or paused node of a cluster is no reason to fail."""
    started = time.monotonic()
    if "," in k.bootstrap_servers:
        with contextlib.suppress(Exception):  # the check below says what is wrong
            await order_bootstrap(k)
    admin = new_admin(k, "check")
    budget = max(1.0, k.connect_timeout_s - (time.monotonic() - started))
    try:
        await asyncio.wait_for(admin.start(), timeout=budget)
        topics = await asyncio.wait_for(admin.list_topics(), timeout=k.connect_timeout_s)
    except Exception as exc:
        refused = await _sasl_refusal(k) if k.security_protocol.startswith("SASL") else None
        if refused is not None:
            raise BrokerAuthenticationError(
                f"Kafka at {k.bootstrap_servers} refused the SASL credentials of user "
                f"{k.sasl_username!r} ({k.sasl_mechanism}): {refused}. Check "
                "TRAJBUS_KAFKA__SASL_USERNAME, TRAJBUS_KAFKA__SASL_PASSWORD and "
                "TRAJBUS_KAFKA__SASL_MECHANISM."
            ) from exc
        tls_failure = await _tls_refusal(k) if k.security_protocol.endswith("SSL") else None
        if tls_failure is not None:
            raise BrokerAuthenticationError(
                f"the TLS handshake with Kafka at {k.bootstrap_servers} failed: {tls_failure}. "
                "Check TRAJBUS_KAFKA__SSL_CAFILE (the CA that signed the broker's certificate) "
                "and, if the broker requires client certificates, TRAJBUS_KAFKA__SSL_CERTFILE "
                "and TRAJBUS_KAFKA__SSL_KEYFILE (a certificate its CA trusts)."
            ) from exc
        waited = time.monotonic() - started
        listening = [a for a in k.bootstrap_servers.split(",") if await _accepts_tcp(a)]
        if listening and len(listening) == len(k.bootstrap_servers.split(",")) \
                and waited < 0.9 * k.connect_timeout_s:
            raise BrokerUnavailableError(
                f"{', '.join(a.strip() for a in listening)} accepted a connection but did not "
                f"answer as a Kafka broker ({_plain(exc)}): is it a KRaft controller port "
                "(controller.listener.names) or another service? Point "
                "TRAJBUS_KAFKA__BOOTSTRAP_SERVERS at the brokers' client listener (9092 for "
                "`trajbus kafka up`)."
            ) from exc
        how = (f"within {k.connect_timeout_s:.0f}s" if waited >= 0.9 * k.connect_timeout_s
               else f"(refused after {waited:.1f}s)")
        raise BrokerUnavailableError(
            f"Kafka at {k.bootstrap_servers} did not answer {how}: {_plain(exc)}. Start the "
            "local broker with `trajbus kafka up`, or point TRAJBUS_KAFKA__BOOTSTRAP_SERVERS at "
            "a running cluster."
        ) from exc
    finally:
        await admin.close()
    return sorted(topics)


async def _accepts_tcp(address: str, timeout: float = 2.0) -> bool:
    """Whether ``host:port`` accepts a TCP connection (something listens there)."""
    host, _, port = address.strip().rpartition(":")
    try:
        _, writer = await asyncio.wait_for(asyncio.open_connection(host, int(port)), timeout)
    except (TimeoutError, OSError, ValueError):
        return False
    writer.close()
    with contextlib.suppress(Exception):
        await writer.wait_closed()
    return True


async def _tls_refusal(k: KafkaSettings) -> str | None:
    """Why a TLS connection to the first bootstrap server fails, or None. With TLS 1.3 a
    refused client certificate shows only as an alert on the first read after the handshake,
    so read briefly: a healthy broker sends nothing unasked (the read times out: no problem)."""
    import ssl

    opts = connection_options(k)
    ctx = opts.get("ssl_context")
    if ctx is None:
        return None
    host, _, port = k.bootstrap_servers.split(",")[0].strip().rpartition(":")
    writer = None
    try:
        reader, writer = await asyncio.wait_for(
            asyncio.open_connection(host, int(port), ssl=ctx), timeout=k.connect_timeout_s)
        await asyncio.wait_for(reader.read(1), timeout=2.0)
    except ssl.SSLError as exc:
        return getattr(exc, "verify_message", None) or exc.reason or str(exc)
    except (OSError, TimeoutError):
        return None  # not a TLS problem: the generic error says what to do
    finally:
        if writer is not None:
            writer.close()
    return None


async def _sasl_refusal(k: KafkaSettings) -> str | None:
    """Why the first bootstrap server refused our SASL authentication, or None. (aiokafka's
    bootstrap error says only "Unable to bootstrap"; the broker's reason is in a log line.)"""
    from aiokafka.conn import create_conn
    from aiokafka.errors import SaslAuthenticationFailed, UnsupportedSaslMechanismError

    opts = connection_options(k)
    host, _, port = k.bootstrap_servers.split(",")[0].strip().rpartition(":")
    try:
        conn = await asyncio.wait_for(
            create_conn(
                host, int(port), client_id=f"{k.client_id}-check",
                request_timeout_ms=k.request_timeout_ms,
                ssl_context=opts.get("ssl_context"), security_protocol=k.security_protocol,
                sasl_mechanism=opts["sasl_mechanism"],
                sasl_plain_username=opts["sasl_plain_username"],
                sasl_plain_password=opts["sasl_plain_password"],
            ),
            timeout=k.connect_timeout_s,
        )
    except (SaslAuthenticationFailed, UnsupportedSaslMechanismError) as exc:
        return str(exc)
    except Exception:
        return None  # not an authentication problem: the generic error says what to do
    conn.close()
    return None


def _plain(exc: BaseException) -> str:
    """An error as one readable clause: aiokafka's errors repeat their class name in their
    text ("KafkaConnectionError: KafkaConnectionError: Unable to bootstrap from [(...)]")."""
    text = str(exc) or type(exc).__name__
    prefix = f"{type(exc).__name__}: "
    while text.startswith(prefix):
        text = text[len(prefix):]
    text = re.sub(r"\('([^']+)', (\d+), <AddressFamily\.\w+: \d+>\)", r"\1:\2", text)
    return f"{type(exc).__name__}: {text}"


def lasting_delivery_error(exc: BaseException) -> bool:
    """True for a delivery error no retry of the same producer cures: not ``retriable`` (e.g.
    ``OutOfOrderSequenceNumber``: an idempotent producer that lost a sequence -- aiokafka fails
    a batch whose partition had no leader for longer than its request timeout even when the
    batch already carried a sequence -- has every later batch of that partition refused). A
    timed-out batch is not, by itself: if it left a gap, the next batches' errors say so."""
    from aiokafka.errors import KafkaTimeoutError

    return not getattr(exc, "retriable", False) and not isinstance(exc, KafkaTimeoutError)


def sender_crash(producer: Any) -> BaseException | None:
    """The error that ended an aiokafka producer's sender routine, if it ended with one.

    When that routine meets an error it does not handle (e.g. a connection lost during a
    coordinator look-up), every pending send and the transaction fail with
    ``KafkaError: Unexpected error during batch delivery``; the sends get copies without the
    cause, so only the routine's own error tells that the broker went away."""
    sender = getattr(producer, "_sender", None)
    task = getattr(sender, "sender_task", None)
    if task is None or not task.done() or task.cancelled():
        return None
    exc: BaseException | None = task.exception()
    if exc is not None:
        _retrieve_failed_futures(producer)
    return exc


def _retrieve_failed_futures(producer: Any) -> None:
    """Mark as retrieved the errors aiokafka set on a crashed producer's internal futures
    (its transaction waiter, its batches' futures and drain waiters), which nobody awaits once
    the producer is given up. Left alone, each logs "Future exception was never retrieved"
    with a traceback when collected; on Python 3.11.7, formatting that traceback from inside a
    garbage collection that an ``ast.parse`` triggered made the outer parse fail with
    "SystemError: AST constructor recursion depth mismatch" (cpython#106905): a test run that
    had passed exited 1 at its summary."""
    futures: list[Any] = []
    txn = getattr(producer, "_txn_manager", None)
    futures.append(getattr(txn, "_transaction_waiter", None))
    futures.extend(f for *_, f in getattr(txn, "_pending_txn_offsets", ()) or ())
    acc = getattr(producer, "_message_accumulator", None)
    batches = [b for queue in (getattr(acc, "_batches", None) or {}).values() for b in queue]
    batches += list(getattr(acc, "_pending_batches", None) or ())
    for batch in batches:
        futures += [getattr(batch, "future", None), getattr(batch, "_drain_waiter", None)]
    for fut in futures:
        if isinstance(fut, asyncio.Future) and fut.done() and not fut.cancelled():
            fut.exception()


def broker_went_away(exc: BaseException) -> bool:
    """True for a client error that says the broker is unreachable or restarting (the
    connection refused, closed or timed out, the node or coordinator not ready) -- also when
    aiokafka wrapped it in a plain ``KafkaError`` (its producer's coordinator look-up does)."""
    from aiokafka.errors import (
        CoordinatorNotAvailableError,
        KafkaConnectionError,
        KafkaTimeoutError,
        LeaderNotAvailableError,
        NodeNotReadyError,
        NotCoordinatorError,
        NotLeaderForPartitionError,
        RequestTimedOutError,
    )

    # A partition without a leader is a broker that is away too: aiokafka fails a batch whose
    # partition had no leader for longer than its request timeout (a long restart).
    away = (KafkaConnectionError, KafkaTimeoutError, NodeNotReadyError, RequestTimedOutError,
            CoordinatorNotAvailableError, NotCoordinatorError, LeaderNotAvailableError,
            NotLeaderForPartitionError, ConnectionError, TimeoutError)
    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, away):
            return True
        seen = seen.__cause__
    return False


async def retry_while_broker_restarts(
        attempt: Callable[[], Awaitable[T]], *, transient: tuple[type[BaseException], ...],
        patience_s: Callable[[], float], what: str) -> T:
    """Run ``attempt`` until it succeeds, retrying its ``transient`` errors (a broker that is
    restarting) with a backoff from 0.25 s doubling to 2 s, until ``patience_s()`` seconds
    have passed since the first try (the last wait is cut short so that one more try lands
    at the deadline); then the last error is raised."""
    loop = asyncio.get_running_loop()
    started = loop.time()
    delay = 0.25
    while True:
        try:
            return await attempt()
        except transient as exc:
            remaining = patience_s() - (loop.time() - started)
            if remaining <= 0:
                raise
            wait = min(delay, remaining)
            log.warning("%s: broker not ready (%s: %s); retrying in %.1fs",
                        what, type(exc).__name__, exc, wait)
            await asyncio.sleep(wait)
            delay = min(2.0, delay * 2)
