"""Structure of infra/docker-compose.yml (3 KRaft brokers + an S3 server); no Docker needed."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest

COMPOSE = Path(__file__).resolve().parents[2] / "infra" / "docker-compose.yml"


def _load() -> dict[str, Any]:
    yaml = pytest.importorskip("yaml")
    data = yaml.safe_load(COMPOSE.read_text())
    assert isinstance(data, dict)
    return data


def _kafka_services(doc: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {
        name: svc
        for name, svc in doc["services"].items()
        if "apache/kafka" in str(svc.get("image", ""))
    }


def _host_ports(svc: dict[str, Any]) -> list[int]:
    # "127.0.0.1:19092:19092" / "19092:19092" / "9000" -> the published host port
    out = []
    for spec in svc.get("ports", []):
        parts = str(spec).split("/")[0].split(":")
        out.append(int(parts[-2] if len(parts) >= 2 else parts[-1]))
    return out


def test_three_kraft_brokers_with_unique_ids_and_full_quorum() -> None:
    doc = _load()
    kafka = _kafka_services(doc)
    assert len(kafka) == 3
    envs = {name: svc["environment"] for name, svc in kafka.items()}
    node_ids = {str(env["KAFKA_NODE_ID"]) for env in envs.values()}
    assert len(node_ids) == 3

    for name, env in envs.items():
        assert "controller" in env["KAFKA_PROCESS_ROLES"], name
        voters = dict(v.split("@", 1) for v in env["KAFKA_CONTROLLER_QUORUM_VOTERS"].split(","))
        assert set(voters) == node_ids, name
        # every voter endpoint names one of the kafka services
        assert {hp.split(":")[0] for hp in voters.values()} == set(kafka), name
        assert env["CLUSTER_ID"] == envs[next(iter(envs))]["CLUSTER_ID"]
        assert re.fullmatch(r"[A-Za-z0-9_-]{22}", env["CLUSTER_ID"])
        advertised = env["KAFKA_ADVERTISED_LISTENERS"]
        assert f"//{name}:" in advertised, name
        assert int(env["KAFKA_OFFSETS_TOPIC_REPLICATION_FACTOR"]) <= 3


def test_s3_service_and_distinct_host_ports() -> None:
    doc = _load()
    services = doc["services"]
    s3 = [
        name
        for name, svc in services.items()
        if re.search(r"minio/minio|s3mock|localstack|moto", str(svc.get("image", "")))
    ]
    assert s3, "no S3-compatible service"
    ports = [p for svc in services.values() for p in _host_ports(svc)]
    assert len(ports) == len(set(ports)), f"host ports collide: {sorted(ports)}"
    for name in _kafka_services(doc):
        assert len(_host_ports(services[name])) == 1, name


def test_named_volumes_are_declared() -> None:
    doc = _load()
    declared = set(doc.get("volumes") or {})
    for name, svc in doc["services"].items():
        for vol in svc.get("volumes", []):
            source = str(vol).split(":")[0]
            if not source.startswith((".", "/")):
                assert source in declared, f"{name}: volume {source} not declared"
