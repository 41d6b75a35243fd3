"""Client authentication (issue 9: "TLS and SASL/SCRAM settings reach every Kafka client"):
SASL/SCRAM over a SASL_PLAINTEXT listener and mutual TLS (client certificates), on one
private broker started for this module. trajbus is configured only through ``TRAJBUS_*``
environment variables, as an operator would; each test runs the admin client
(``ensure_base_topics``), sandboxes on the shared producer (``SandboxEmitter``), a reorder
worker process (consumer, transactional producer, ticker, admin) and a trainer
(``ReplayClient``), and checks the trainer's view is exactly what was acknowledged. Wrong
credentials are refused."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from faults_support import (
    PacedFleet,
    diff_views,
    make_tls,
    own_broker,
    start_worker,
    trainer_view,
)
from pydantic import SecretStr

from trajbus.bus.admin import ensure_base_topics
from trajbus.bus.kafka import BrokerAuthenticationError, BrokerUnavailableError, check_broker
from trajbus.bus.producer import close_producer
from trajbus.bus.settings import KafkaSettings, Settings
from trajbus.infra.broker import LocalBroker, free_port

pytestmark = [pytest.mark.kafka]

USER, PASSWORD, WRONG = "alice", "alice-secret-9f3k", "not-her-password"


@dataclass
class AuthBroker:
    broker: LocalBroker
    tls: dict[str, Path]
    ssl_bootstrap: str  # SSL listener that requires a client certificate


@pytest.fixture(scope="module")
def auth_broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[AuthBroker]:
    """PLAINTEXT (inter-broker, probe), SASL_PLAINTEXT (SCRAM-SHA-256/512, user alice) and
    SSL with ``ssl.client.auth=required`` (test CA as the truststore) listeners."""
    root = tmp_path_factory.mktemp("auth")
    tls = make_tls(root / "tls")
    port, cport, sasl_port, ssl_port = free_port(), free_port(), free_port(), free_port()
    base = LocalBroker(data_dir=root / "kafka", port=port, controller_port=cport,
                       sasl_port=sasl_port).server_properties()
    ssl_listener = f"SSL://127.0.0.1:{ssl_port}"
    extra = {
        "listeners": f"{base['listeners']},{ssl_listener}",
        "advertised.listeners": f"{base['advertised.listeners']},{ssl_listener}",
        "listener.security.protocol.map": base["listener.security.protocol.map"] + ",SSL:SSL",
        "ssl.keystore.type": "PEM",
        "ssl.keystore.location": str(tls["keystore"]),
        "ssl.truststore.type": "PEM",
        "ssl.truststore.location": str(tls["ca"]),
        "listener.name.ssl.ssl.client.auth": "required",
    }
    with own_broker(root / "kafka", port=port, controller_port=cport, sasl_port=sasl_port,
                    scram_users={USER: PASSWORD}, extra_properties=extra) as broker:
        yield AuthBroker(broker, tls, f"127.0.0.1:{ssl_port}")


def _settings_from_env(monkeypatch: pytest.MonkeyPatch, env: dict[str, str]) -> Settings:
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    return Settings()


async def _pipeline(secure: Settings, env: dict[str, str], tmp_path: Path, group: str,
                    name: str) -> str:
    """Admin, emitters, a worker and a trainer over ``secure``; returns the worker's log."""
    await ensure_base_topics(secure, ["task-a"])
    fleet = PacedFleet(secure, tmp_path / "sb", n=2, step_s=0.02, steps_per_episode=5,
                       name=name).start()
    log = tmp_path / "w.log"
    worker = start_worker(secure, "reorder", "w0", log, **env)
    try:
        deadline = time.monotonic() + 60
        while len(fleet.acked) < 6:  # a few episodes acknowledged by the broker
            assert time.monotonic() < deadline, f"acknowledged: {dict(fleet.acked)}"
            await asyncio.sleep(0.2)
        await fleet.stop()
        await close_producer()
        assert all(fleet.closed_ok)
        expected = dict(fleet.acked)
        view = await trainer_view(secure, ["task-a"], group,  # a ReplayClient
                                  lambda v: v.complete(expected), timeout=90)
        assert worker.proc.poll() is None, log.read_text()[-3000:]
    finally:
        worker.stop()
    assert len(expected) >= 6
    assert diff_views(expected, view) == []
    return log.read_text()


@pytest.mark.timeout(240)
async def test_sasl_scram_settings_reach_producer_consumer_admin_and_worker(
        auth_broker: AuthBroker, tmp_path: Path, unique_name: str,
        monkeypatch: pytest.MonkeyPatch) -> None:
    sasl_bootstrap = auth_broker.broker.sasl_bootstrap
    env = {
        "TRAJBUS_KAFKA__BOOTSTRAP_SERVERS": sasl_bootstrap,  # the SASL listener only
        "TRAJBUS_KAFKA__SECURITY_PROTOCOL": "SASL_PLAINTEXT",
        "TRAJBUS_KAFKA__SASL_MECHANISM": "SCRAM-SHA-256",
        "TRAJBUS_KAFKA__SASL_USERNAME": USER,
        "TRAJBUS_KAFKA__SASL_PASSWORD": PASSWORD,
        "TRAJBUS_KAFKA__CONNECT_TIMEOUT_S": "20",
        "TRAJBUS_TOPICS__PREFIX": unique_name,
        "TRAJBUS_TOPICS__PARTITIONS": "2",
    }
    secure = _settings_from_env(monkeypatch, env)
    assert isinstance(secure.kafka.sasl_password, SecretStr)
    assert PASSWORD not in repr(secure) and PASSWORD not in secure.model_dump_json()

    # refused: a client without SASL on the SASL port; a wrong password, with a clear error
    with pytest.raises(BrokerUnavailableError):
        await check_broker(KafkaSettings(bootstrap_servers=sasl_bootstrap, connect_timeout_s=3))
    wrong = secure.kafka.model_copy(update={"sasl_password": SecretStr(WRONG)})
    with pytest.raises(BrokerAuthenticationError) as refused:
        await check_broker(wrong)
    message = str(refused.value)
    print(f"wrong password: {message}")
    assert f"refused the SASL credentials of user '{USER}' (SCRAM-SHA-256)" in message
    assert "Authentication failed" in message and WRONG not in message
    # a worker started with the wrong password exits at once, saying why
    bad_log = tmp_path / "w-bad.log"
    bad = start_worker(secure, "reorder", "w-bad", bad_log,
                       **(env | {"TRAJBUS_KAFKA__SASL_PASSWORD": WRONG}))
    assert bad.wait(timeout=60) != 0
    assert "refused the SASL credentials" in bad_log.read_text()
    assert WRONG not in bad_log.read_text()
    # the other SCRAM mechanism authenticates too (check_broker raises otherwise)
    await check_broker(secure.kafka.model_copy(update={"sasl_mechanism": "SCRAM-SHA-512"}))

    worker_log = await _pipeline(secure, env, tmp_path, f"{unique_name}-trainer", "sasl")
    assert PASSWORD not in worker_log


@pytest.mark.timeout(240)
async def test_mutual_tls_client_certificate_reaches_producer_consumer_admin_and_worker(
        auth_broker: AuthBroker, tmp_path: Path, unique_name: str,
        monkeypatch: pytest.MonkeyPatch) -> None:
    tls = auth_broker.tls
    env = {
        "TRAJBUS_KAFKA__BOOTSTRAP_SERVERS": auth_broker.ssl_bootstrap,
        "TRAJBUS_KAFKA__SECURITY_PROTOCOL": "SSL",
        "TRAJBUS_KAFKA__SSL_CAFILE": str(tls["ca"]),
        "TRAJBUS_KAFKA__SSL_CERTFILE": str(tls["client_cert"]),
        "TRAJBUS_KAFKA__SSL_KEYFILE": str(tls["client_key"]),
        "TRAJBUS_KAFKA__CONNECT_TIMEOUT_S": "20",
        "TRAJBUS_TOPICS__PREFIX": unique_name,
        "TRAJBUS_TOPICS__PARTITIONS": "2",
    }
    secure = _settings_from_env(monkeypatch, env)
    # refused: no client certificate; a client certificate signed by another CA
    # refused with an error naming the TLS failure and the settings to check
    for cert, key in ((None, None), (tls["rogue_cert"], tls["rogue_key"])):
        with pytest.raises(BrokerAuthenticationError) as refused:
            await check_broker(secure.kafka.model_copy(update={
                "ssl_certfile": cert and str(cert), "ssl_keyfile": key and str(key),
                "connect_timeout_s": 5}))
        message = str(refused.value)
        assert "TLS handshake" in message and "TRAJBUS_KAFKA__SSL_CERTFILE" in message, message
        assert "CERTIFICATE" in message.upper(), message  # the broker's alert, e.g. "bad cert"
    # a client that does not trust the broker's CA: the verification failure is named
    with pytest.raises(BrokerAuthenticationError, match=r"certificate verify failed|self.signed|"
                       r"unable to get local issuer"):
        await check_broker(secure.kafka.model_copy(update={
            "ssl_cafile": str(tls["rogue_cert"]), "connect_timeout_s": 5}))
    await _pipeline(secure, env, tmp_path, f"{unique_name}-trainer", "mtls")


def test_local_broker_sasl_listener_properties_and_no_password_in_the_format_command(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """LocalBroker's SASL options, without starting a JVM: the listener and SCRAM properties,
    one ``--add-scram`` per (user, mechanism) carrying a salted password, never the password."""
    import subprocess

    from trajbus.infra import broker as broker_mod
    from trajbus.infra import kafka_runtime

    b = LocalBroker(data_dir=tmp_path, port=19001, controller_port=19002, sasl_port=19003,
                    scram_users={USER: PASSWORD})
    props = b.server_properties()
    assert "SASL_PLAINTEXT://127.0.0.1:19003" in props["listeners"]
    assert "SASL_PLAINTEXT://127.0.0.1:19003" in props["advertised.listeners"]
    assert "SASL_PLAINTEXT:SASL_PLAINTEXT" in props["listener.security.protocol.map"]
    assert props["sasl.enabled.mechanisms"] == "SCRAM-SHA-256,SCRAM-SHA-512"
    assert props["inter.broker.listener.name"] == "PLAINTEXT"
    assert "ScramLoginModule" in props[
        "listener.name.sasl_plaintext.scram-sha-512.sasl.jaas.config"]
    assert b.sasl_bootstrap == "127.0.0.1:19003" and PASSWORD not in repr(b)

    seen: list[list[str]] = []

    def fake_run(cmd: list[str], **kwargs: object) -> subprocess.CompletedProcess[str]:
        seen.append(cmd)
        return subprocess.CompletedProcess(cmd, 1, "", "not really formatting")

    monkeypatch.setattr(broker_mod.subprocess, "run", fake_run)
    monkeypatch.setattr(kafka_runtime, "require_java", lambda: "java")
    with pytest.raises(broker_mod.BrokerError) as failed:
        b._format(tmp_path, "cluster-id")
    cmd = seen[0]
    scram = [cmd[i + 1] for i, a in enumerate(cmd) if a == "--add-scram"]
    assert [s.split("=[")[0] for s in scram] == ["SCRAM-SHA-256", "SCRAM-SHA-512"]
    assert all(f"name={USER},iterations=8192,salt=" in s and "saltedpassword=" in s
               for s in scram)
    assert PASSWORD not in " ".join(cmd) and PASSWORD not in str(failed.value)

    with pytest.raises(ValueError, match="sasl_port"):
        LocalBroker(data_dir=tmp_path, port=1, controller_port=2, scram_users={USER: "x"})
    with pytest.raises(ValueError, match="user name"):
        LocalBroker(data_dir=tmp_path, port=1, controller_port=2, sasl_port=3,
                    scram_users={"a,b=[x]": "x"})
    with pytest.raises(ValueError, match="scram_mechanisms"):
        LocalBroker(data_dir=tmp_path, port=1, controller_port=2, sasl_port=3,
                    scram_mechanisms=("PLAIN",))
