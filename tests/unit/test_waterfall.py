"""The step-time waterfall: durations per call, agent think time, share per tool; the HTML
report rendered by a real headless Chromium."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

from trajbus.consumers.operator.tools import TimelineEntry, entry_from_decoded
from trajbus.consumers.operator.waterfall import (
    THINK,
    build_waterfall,
    chromium_command,
    find_chromium,
    render_html,
    render_png,
)
from trajbus.schemas import models as m
from trajbus.schemas.codec import default_codec

pytestmark = pytest.mark.timeout(120)
T0 = 1_700_000_000_000


def _entries() -> list[TimelineEntry]:
    """A 12 s episode: think 1 s, exec 7 s, think 1 s, http_get 2 s (ERROR), think 1 s."""

    def h(seq: int, dt: int) -> m.Envelope:
        return m.Envelope(event_id=f"e{seq}", task="web", sandbox="sb-9", episode="ep-1",
                          seq=seq, event_time_ms=T0 + dt, producer_id="test")

    events: list[m.Event] = [
        m.EpisodeStart(header=h(0, 0)),
        m.ToolCall(header=h(1, 1000), call_id="c1", tool="exec", args_hash="a" * 64,
                   args_summary="pytest -x"),
        m.ToolResult(header=h(2, 8050), call_id="c1", tool="exec", status=m.ToolStatus.OK,
                     result_hash="b" * 64, result_summary="3 failed", duration_ms=7000),
        m.ToolCall(header=h(3, 9000), call_id="c2", tool="http_get", args_hash="c" * 64,
                   args_summary="GET http://10.0.0.9/ <probe>"),
        m.ToolResult(header=h(4, 11000), call_id="c2", tool="http_get",
                     status=m.ToolStatus.ERROR, result_hash="d" * 64,
                     result_summary="connection refused"),
        m.EpisodeEnd(header=h(5, 12000), outcome=m.EpisodeOutcome.TRUNCATED),
    ]
    codec = default_codec()
    return [entry_from_decoded(codec.decode(e.encode())) for e in events]


def test_durations_think_time_and_shares() -> None:
    wf = build_waterfall(_entries())
    assert wf.total_ms == 12_000
    assert [(s.tool, s.start_ms, s.duration_ms, s.think_before_ms, s.status)
            for s in wf.steps] == [
        ("exec", 1000, 7000, 1000, "OK"),  # the sidecar's measured duration wins
        ("http_get", 9000, 2000, 1000, "ERROR"),  # no duration_ms: result - call event time
    ]
    assert wf.think_ms == 3000  # head 1 s + gap 1 s + tail 1 s
    assert [(t.tool, t.calls, t.total_ms, round(t.share, 4), t.errors) for t in wf.per_tool] \
        == [("exec", 1, 7000, 0.5833, 0), ("http_get", 1, 2000, 0.1667, 1)]
    assert wf.headline == "58% of the episode was spent in exec (1 calls, 7.0 s)"


def test_open_call_lasts_until_the_episode_end() -> None:
    entries = [e for e in _entries() if e.seq != 4]  # http_get never returned
    wf = build_waterfall(entries)
    assert (wf.steps[1].status, wf.steps[1].duration_ms) == ("OPEN", 3000)
    assert wf.think_ms == 2000


def test_html_is_self_contained_and_escaped() -> None:
    page = render_html(_entries())
    assert "<script" not in page.lower()
    assert not re.search(r"(src|href)\s*=\s*[\"']?(https?:)?//", page)  # nothing fetched
    assert "&lt;probe&gt;" in page and "<probe>" not in page
    assert THINK in page and "<svg" in page


def test_html_rendered_in_headless_chromium(tmp_path: Path) -> None:
    binary = find_chromium()
    if binary is None:
        pytest.skip("no headless Chromium on PATH (CI: apt-get install -y "
                    "chromium-headless-shell, or set TRAJBUS_CHROMIUM)")
    page = tmp_path / "report.html"
    page.write_text(render_html(_entries()), encoding="utf-8")
    proc = subprocess.run(
        chromium_command(binary, tmp_path / "profile", "--dump-dom", page.as_uri()),
        capture_output=True, timeout=90, check=False)
    assert proc.returncode == 0, proc.stderr.decode(errors="replace")[-2000:]
    dom = proc.stdout.decode()
    text = re.sub(r"<[^>]+>", " ", dom)
    for expected in ("exec", "http_get", "7.0 s", "2.0 s", "58.3%", "16.7%", "25.0%",
                     "58% of the episode was spent in exec", "connection refused", THINK):
        assert expected in text, expected
    assert dom.count("<rect") >= 5  # share bar segments and step bars survived parsing

    png = render_png(_entries(), tmp_path / "report.png")
    data = png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 2000
