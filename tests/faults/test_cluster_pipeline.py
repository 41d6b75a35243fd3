"""The cluster's short form, in CI: one pipeline run on the 3-node cluster with the leader of
the busiest input partition SIGKILLed mid-run (and started again 10 s later), the worker
SIGKILLed too, both cores saturated (two hogs; beside other pytest-xdist workers they only fill
idle CPU). The run must pass the demo's exact check (trainer view
equal to what the emitters acknowledged, replay topics raw without duplicates or false gaps,
every planted loop caught and nothing else, DRAIN then RECYCLE per sandbox, the archive once
per event); and `trajbus demo --nodes 3` started while a node is down. These long runs share a
pytest-xdist worker and its cluster, apart from tests/faults/test_cluster.py's shorter ones, so
the cluster tests do not all wait on one worker. The other node faults run in the soak:
`make soak SOAK_ARGS="--nodes 3 --fault cycle"`."""

from __future__ import annotations

import asyncio
import os
import random
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import soak
from cluster_faults import FAULTS

from trajbus.bus.settings import ArchiveSettings, KafkaSettings, Settings, TopicSettings
from trajbus.infra.cluster import LocalCluster

pytestmark = [pytest.mark.kafka, pytest.mark.slow, pytest.mark.timeout(600),
              pytest.mark.xdist_group("cluster-pipeline")]


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

    with soak.cpu_hogs(2, soak.hog_niceness_beside_other_tests()):
        result = asyncio.run(run())
    faults = " ".join(result.faults)
    assert "leader of the busiest input partition" in faults and "SIGKILLed" in faults, faults
    assert result.ok, result.output_tail


@pytest.mark.timeout(300)
def test_the_demo_runs_on_a_cluster_with_a_node_down(restore_cluster: LocalCluster,
                                                      tmp_path) -> None:
    """`trajbus demo --nodes 3` started while a node is down (a drill, a rolling restart):
    it uses the cluster as it is, creates its topics once the brokers allow, and passes its
    check. Before: the demo tried to start the cluster and ended in a BrokerError traceback
    (cluster drill, run 13), or the worker stopped on the replication-factor check (run 6)."""
    cluster = restore_cluster
    (tmp_path / ".trajbus").mkdir()
    (tmp_path / ".trajbus" / "kafka-cluster").symlink_to(cluster.data_dir)
    cluster.kill_node(2)
    env = {k: v for k, v in os.environ.items() if not k.startswith("TRAJBUS_")}

    def start_later() -> None:
        time.sleep(8)
        cluster.start_node(2, 120)

    later = threading.Thread(target=start_later)
    later.start()
    proc = subprocess.run([sys.executable, "-m", "trajbus", "demo", "--nodes", "3",
                           "--sandboxes", "6", "--episodes", "1", "--seed", "3613"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=280,
                          check=False)
    later.join()
    out = proc.stdout + proc.stderr
    assert "Traceback" not in out, out[-3000:]
    assert "2 of 3 nodes running, using it" in proc.stderr, proc.stderr[-2000:]
    assert proc.returncode == 0, proc.stdout[-3000:]
