"""A location that holds no archive is an error, never zero rows (issue 38 item 4).

`trajbus archive sql|episode|episodes|compact|retention` and ``ArchiveReader`` pointed at a
misspelled directory or a wrong S3 prefix: exit 2 (``NoArchiveError``), a message that says
what was expected there and how to point at the archive, and nothing created by the read.
An archive the archiver has started on but not yet written to (a quiet fleet) is an archive:
the archiver marks its location when it starts, and it reads as empty.
"""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from pathlib import Path

import boto3
import pytest
from support import REPO
from test_archive_store import archive_all, fleet, shell_for

from trajbus.archive.query import ArchiveReader
from trajbus.archive.storage import LocalStore, NoArchiveError, open_store


def _cli(*argv: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "trajbus", "archive", *argv], cwd=REPO,
                          env={**os.environ, **(env or {})}, capture_output=True, text=True,
                          timeout=120, check=False)


READS = [["sql", "SELECT count(*) FROM events"], ["episodes"],
         ["episode", "--task", "web", "--sandbox", "sb-0", "--episode", "ep-0"],
         ["compact", "--dry-run"], ["retention", "--days", "1", "--dry-run"]]


@pytest.mark.parametrize("argv", READS, ids=[a[0] for a in READS])
def test_a_missing_local_directory_is_an_error_and_is_not_created(
        tmp_path: Path, argv: list[str]) -> None:
    where = tmp_path / "no" / "such"
    proc = _cli("--url", str(where), *argv)
    assert proc.returncode == 2, (proc.stdout, proc.stderr)
    assert f"no trajbus archive at {where}" in proc.stderr
    assert "expected events/ and index/" in proc.stderr
    assert "TRAJBUS_ARCHIVE__URL or --url" in proc.stderr
    assert "Traceback" not in proc.stderr and proc.stdout == ""
    assert not (tmp_path / "no").exists(), "a read created the directory"


def test_a_misspelled_path_next_to_an_archive_is_an_error(tmp_path: Path) -> None:
    archive_all(LocalStore(tmp_path / "archive"), tmp_path, fleet())
    (tmp_path / "archiv").mkdir()  # an existing, wrong directory
    for url in (tmp_path / "archiv", tmp_path / "archive" / "events"):
        proc = _cli("--url", str(url), "episodes")
        assert proc.returncode == 2 and "no trajbus archive at" in proc.stderr, proc.stderr
    proc = _cli("episodes", env={"TRAJBUS_ARCHIVE__URL": str(tmp_path / "archive")})
    assert proc.returncode == 0 and proc.stdout.count("\n") > 0, proc.stderr


def test_archive_reader_raises_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(NoArchiveError, match=r"no trajbus archive at .*expected events/"):
        ArchiveReader(open_store(str(tmp_path / "nope"), create=False))
    assert not (tmp_path / "nope").exists()
    # an archive whose archiver has started but written nothing yet is empty, not an error
    store = LocalStore(tmp_path / "fresh")
    shell_for(store, tmp_path).close()
    con = ArchiveReader(store).connect()
    assert con.execute("SELECT count(*) FROM events").fetchall() == [(0,)]
    assert ArchiveReader(LocalStore(tmp_path / "other"), require=False).index().num_rows == 0


def test_a_wrong_s3_prefix_is_an_error(s3_server: str, tmp_path: Path) -> None:
    bucket = f"loc-{uuid.uuid4().hex[:8]}"
    boto3.client("s3", endpoint_url=s3_server).create_bucket(Bucket=bucket)
    good = open_store(f"s3://{bucket}/team/archive", s3_server)
    archive_all(good, tmp_path, fleet())
    env = {"TRAJBUS_ARCHIVE__S3_ENDPOINT_URL": s3_server}
    ok = _cli("--url", f"s3://{bucket}/team/archive", "sql", "SELECT count(*) FROM events",
              env=env)
    assert ok.returncode == 0 and ok.stdout.splitlines()[1] == str(len(fleet())), ok.stderr
    for url in (f"s3://{bucket}/team/archiv", f"s3://{bucket}/team"):
        proc = _cli("--url", url, "sql", "SELECT count(*) FROM events", env=env)
        assert proc.returncode == 2, (url, proc.stdout, proc.stderr)
        assert f"no trajbus archive at {url}" in proc.stderr
        assert "expected events/ and index/" in proc.stderr
    with pytest.raises(NoArchiveError, match="no object under this prefix"):
        ArchiveReader(open_store(f"s3://{bucket}/elsewhere", s3_server))
    keys = {o["Key"] for o in boto3.client("s3", endpoint_url=s3_server).list_objects_v2(
        Bucket=bucket).get("Contents", [])}
    assert keys and all(k.startswith("team/archive/") for k in keys), "a read wrote objects"
