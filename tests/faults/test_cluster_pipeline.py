"""The cluster's short form, in CI: one pipeline run on the 3-node cluster with the leader of
the busiest input partition SIGKILLed mid-run (and started again 10 s later), the worker
SIGKILLed too, both cores saturated. The run must pass the demo's exact check (trainer view
equal to what the emitters acknowledged, replay topics raw without duplicates or false gaps,
every planted loop caught and nothing else, DRAIN then RECYCLE per sandbox, the archive once
per event). The other node faults run in the soak: `make soak SOAK_ARGS="--nodes 3 --fault
cycle"`."""

from __future__ import annotations

import asyncio
import random
from pathlib import Path

import pytest
import soak
from cluster_faults import FAULTS

from trajbus.bus.settings import ArchiveSettings, KafkaSettings, Settings, TopicSettings
from trajbus.infra.cluster import LocalCluster

pytestmark = [pytest.mark.kafka, pytest.mark.slow, pytest.mark.timeout(600),
              pytest.mark.xdist_group("cluster")]


def test_a_run_survives_the_sigkill_of_its_busiest_partitions_leader(
        restore_cluster: LocalCluster, tmp_path: Path) -> None:
    cluster = restore_cluster
    settings = Settings(kafka=KafkaSettings(bootstrap_servers=cluster.bootstrap,
                                            connect_timeout_s=30.0),
                        topics=TopicSettings(prefix="cluster", replication_factor=3),
                        archive=ArchiveSettings(url=str(tmp_path / "archive"),
                                                spool_dir=str(tmp_path / "spool")))
    rng = random.Random(3601)

    async def run() -> soak.RunResult:
        await soak.broker_ready(settings)
        return await soak.soak_run(settings, cluster, 1, 3601, sandboxes=16, episodes=2,
                                   work_root=tmp_path / "runs", restart_mid_run=True, rng=rng,
                                   node_fault=FAULTS["leader"])

    with soak.cpu_hogs(2):
        result = asyncio.run(run())
    faults = " ".join(result.faults)
    assert "leader of the busiest input partition" in faults and "SIGKILLed" in faults, faults
    assert result.ok, result.output_tail
