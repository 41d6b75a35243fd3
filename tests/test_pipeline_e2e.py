"""The whole pipeline on a simulated fleet, through a real broker and a worker process:
the trainer's view equals exactly what the emitters acknowledged, every planted loop (single
calls and cycles) is caught with one alert, look-alike non-loops are left alone, decisions
flow, and the archive answers a DuckDB query. This is `make demo`'s check, run in CI."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from support import settings_for

from trajbus.bus.settings import ArchiveSettings
from trajbus.pipeline_demo import run_pipeline

pytestmark = [pytest.mark.kafka, pytest.mark.timeout(300)]


async def test_pipeline_delivers_exactly_what_was_acknowledged_and_catches_loops(
        kafka_broker, unique_name, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    settings = settings_for(kafka_broker.bootstrap, unique_name, partitions=3,
                            archive=ArchiveSettings(url=str(tmp_path / "archive"),
                                                    spool_dir=str(tmp_path / "spool")))
    code = await run_pipeline(settings, sandboxes=16, episodes=2, seed=4242,
                              work_root=tmp_path / "work", settle_timeout_s=120)
    out = capsys.readouterr().out
    assert code == 0, out
    caught = re.search(r"watchdog: (\d+)/(\d+) planted loops caught, 0 false alarms", out)
    assert caught and caught.group(1) == caught.group(2) and int(caught.group(2)) >= 2, out
    assert "episodes exactly equal to what the emitters acknowledged" in out
    assert "sample query" in out
