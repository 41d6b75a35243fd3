"""`trajbus demo`: each run is isolated from earlier runs on the same broker, and the broker
settings (``--bootstrap``, ``TRAJBUS_KAFKA__BOOTSTRAP_SERVERS``) are honoured."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from support import REPO

from trajbus.bus.settings import ArchiveSettings, Settings, TopicSettings
from trajbus.bus.topics import Topics
from trajbus.demo import isolated_run


def test_two_runs_with_the_same_seed_share_no_topic_group_or_archive() -> None:
    base = Settings(topics=TopicSettings(prefix="acme"),
                    archive=ArchiveSettings(url="s3://bucket/trajbus"))
    a, b = isolated_run(base, 7), isolated_run(base, 7)
    assert a.topics.prefix != b.topics.prefix
    assert a.topics.prefix.startswith("acme.demo-7-")
    assert a.archive.url.startswith("s3://bucket/trajbus/demo-7-")
    assert a.archive.url != b.archive.url and a.archive.spool_dir != b.archive.spool_dir
    # consumer groups, state changelogs and transactional ids derive from the prefix
    assert not set(Topics(a).input_topics) & set(Topics(b).input_topics)
    assert base.topics.prefix == "acme"  # the base settings are left alone


@pytest.mark.kafka
@pytest.mark.timeout(120)
def test_demo_uses_the_broker_named_in_the_environment(kafka_broker, unique_name) -> None:
    env = dict(os.environ, TRAJBUS_KAFKA__BOOTSTRAP_SERVERS=kafka_broker.bootstrap,
               TRAJBUS_TOPICS__PREFIX=unique_name)
    proc = subprocess.run([sys.executable, "-m", "trajbus", "demo", "--smoke",
                           "--events-per-kind", "5"], env=env, capture_output=True, text=True,
                          timeout=100, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "local Kafka broker" not in proc.stderr  # no broker of its own was started


@pytest.mark.kafka
@pytest.mark.timeout(300)
def test_the_same_seed_can_be_run_twice(kafka_broker, unique_name, tmp_path) -> None:
    """The help says a seed lets a run be repeated. The second run used to find the first
    run's emitter journals under .trajbus/demo/<seed> and end in an EpisodeStateError
    traceback; each run now has its own work directory."""
    env = dict(os.environ, TRAJBUS_KAFKA__BOOTSTRAP_SERVERS=kafka_broker.bootstrap,
               TRAJBUS_TOPICS__PREFIX=unique_name, TRAJBUS_TOPICS__PARTITIONS="2")
    for attempt in (1, 2):
        proc = subprocess.run([sys.executable, "-m", "trajbus", "demo", "--seed", "4242",
                               "--sandboxes", "4", "--episodes", "1"], env=env,
                              capture_output=True, text=True, timeout=280, cwd=tmp_path)
        out = proc.stdout + proc.stderr
        assert "Traceback" not in out, (attempt, out[-3000:])
        assert proc.returncode == 0, (attempt, out[-3000:])
    runs = sorted(p.name for p in (tmp_path / ".trajbus" / "demo").iterdir())
    assert len(runs) == 2 and all(r.startswith("demo-4242-") for r in runs), runs
