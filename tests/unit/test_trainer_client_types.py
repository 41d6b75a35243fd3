"""A trainer's type checker sees trajbus's types (issue 41, item 6).

trajbus shipped no ``py.typed`` (mypy treated every import as ``Any`` or refused it),
``SyncReplayClient.__init__`` took ``*args, **kwargs``, and a ToolCall's arguments (a
ToolResult's result) were a JSON string in a dict. Now the wheel carries ``py.typed``,
``SyncReplayClient`` has ``ReplayClient``'s own signature, and ``Decoded.args_json()`` /
``result_json()`` parse them. The mypy test builds the wheel, installs it into a directory
of its own and type-checks a small trainer script against it in a subprocess, as a trainer's
CI would: a correct script passes ``--strict``, and mistakes are reported.
"""

from __future__ import annotations

import inspect
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from trajbus.consumers.replay.client import ReplayClient, SyncReplayClient
from trajbus.schemas import models as m
from trajbus.schemas.codec import default_codec

ROOT = Path(__file__).resolve().parents[2]


def test_the_sync_client_takes_exactly_the_async_clients_parameters() -> None:
    sync = inspect.signature(SyncReplayClient.__init__).parameters
    async_ = inspect.signature(ReplayClient.__init__).parameters
    assert [(p.name, p.kind, p.default, str(p.annotation)) for p in sync.values()] == \
        [(p.name, p.kind, p.default, str(p.annotation)) for p in async_.values()]
    for name in ("ack", "commit", "list_tasks", "missing_tasks", "segments", "episodes",
                 "close"):
        hints = inspect.get_annotations(getattr(SyncReplayClient, name))
        assert "return" in hints, name


def _decode(event: m.Event) -> object:
    return default_codec().decode(event.encode())


def test_tool_arguments_and_results_have_typed_accessors() -> None:
    hdr = m.Envelope(task="t", sandbox="s", episode="e", seq=3, producer_id="p")
    call = default_codec().decode(m.ToolCall(
        header=hdr, call_id="c1", tool="exec", args_hash="0" * 64,
        args_canonical='{"cmd":"ls","timeout":5}').encode())
    assert call.args_json() == {"cmd": "ls", "timeout": 5}
    assert call.seq == 3
    big = default_codec().decode(m.ToolCall(header=hdr, call_id="c2", tool="exec",
                                            args_hash="0" * 64).encode())
    assert big.args_json() is None  # over 4 KiB: only the hash and the summary were sent
    result = default_codec().decode(m.ToolResult(
        header=hdr, call_id="c1", tool="exec", status=m.ToolStatus.OK, result_hash="0" * 64,
        result_canonical='["a.txt","b.txt"]').encode())
    assert result.result_json() == ["a.txt", "b.txt"]
    with pytest.raises(TypeError, match="ToolCall"):
        result.args_json()
    with pytest.raises(TypeError, match="ToolResult"):
        call.result_json()


_GOOD = '''
from trajbus.consumers.replay.client import Episode, SyncReplayClient


def step(batch: list[Episode]) -> int:
    calls = 0
    for ep in batch:
        for ev in ep.events:
            if ev.kind == "ToolCall":
                args = ev.args_json()
                if args is not None and "cmd" in args:
                    calls += 1
    return calls


with SyncReplayClient(["web-shop"], group_id="trainer-typed", commit_every_ms=100,
                      max_in_flight=64) as client:
    batch: list[Episode] = []
    for ep in client.episodes(idle_timeout=1.0):
        batch.append(ep)
    step(batch)
    for ep in batch:
        client.ack(ep)
    client.commit()
    segments: int = client.stats["segments"]
    tasks: list[str] = client.list_tasks()
'''

_BAD = '''
from trajbus import SyncReplayClient  # the public API's path: typed too

client = SyncReplayClient(["web-shop"], group_id=7)
client.ack("episode")
client.commit(True)
for ep in client.episodes(idle_timeout="soon"):
    text: str = ep.events[0].args_json()
'''


def _install_wheel(tmp: Path) -> Path:
    """Build trajbus's wheel from a copy of the tree and unpack it: an installed trajbus."""
    src = tmp / "src"
    shutil.copytree(ROOT, src, ignore=shutil.ignore_patterns(
        ".venv", ".git", "infra/kafka/lib", "lib", "*.egg-info", "build", "__pycache__",
        ".mypy_cache", ".pytest_cache", ".ruff_cache", "bench", "tests", ".trajbus"))
    wheels = tmp / "wheels"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps",
                    "--no-build-isolation", "-w", str(wheels), str(src)], check=True,
                   capture_output=True, timeout=240)
    site = tmp / "site"
    (wheel,) = wheels.glob("trajbus-*.whl")
    with zipfile.ZipFile(wheel) as zf:
        zf.extractall(site)
        assert "trajbus/py.typed" in zf.namelist()
    return site


def _mypy(site: Path, tmp: Path, code: str, name: str) -> subprocess.CompletedProcess[str]:
    script = tmp / f"{name}.py"
    script.write_text(code)
    env = dict(os.environ)
    # the installed copy is on the interpreter's path, as a site-packages directory; the
    # editable install of this checkout is not (mypy cannot follow its import hook anyway)
    env["PYTHONPATH"] = str(site)
    env.pop("MYPYPATH", None)
    return subprocess.run(
        [sys.executable, "-m", "mypy", "--strict", "--no-incremental",
         "--cache-dir", str(tmp / "mypy-cache"), "--python-executable", sys.executable,
         str(script)],
        cwd=tmp, env=env, capture_output=True, text=True, timeout=300)


@pytest.mark.timeout(600)
def test_a_trainer_script_type_checks_strictly_against_the_installed_wheel(
        tmp_path: Path) -> None:
    site = _install_wheel(tmp_path)
    good = _mypy(site, tmp_path, _GOOD, "trainer_good")
    assert good.returncode == 0, good.stdout + good.stderr
    bad = _mypy(site, tmp_path, _BAD, "trainer_bad")
    out = bad.stdout
    assert bad.returncode == 1, out + bad.stderr
    for line, what in ((4, "group_id"), (5, "ack"), (6, "commit"), (7, "idle_timeout"),
                       (8, "dict[str, Any] | None")):
        assert any(f"trainer_bad.py:{line}:" in row and what in row
                   for row in out.splitlines()), f"line {line} ({what}) not flagged:\n{out}"
