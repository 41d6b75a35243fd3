"""Step-time waterfall of an episode: where the time went, per tool call.

Built from an episode's timeline (:func:`trajbus.consumers.operator.tools.read_sandbox_log`):

* a **step** is a ``ToolCall`` and the ``ToolResult`` with the same ``call_id``. Its duration
  is the result's ``duration_ms`` (measured by the sidecar) when positive, else the event-time
  difference result - call. A call without a result is ``OPEN`` and lasts until the episode's
  end.
* **agent think time** is every stretch of the episode covered by no step: from the episode
  start to the first call, between a step's end and the next call, and from the last step's end
  to the episode end. Overlapping (parallel) calls count once on the time line.
* the episode runs from its ``EpisodeStart`` (else its first event) to its ``EpisodeEnd`` (else
  its last event). **Share** = time / episode duration.

Outputs: :func:`render_html` (one self-contained page, inline CSS and SVG, no script, no
network) and :func:`render_png` (matplotlib when installed, else the HTML rendered by a headless
Chromium; :class:`PngUnavailableError` says what to install when neither is there).
"""

from __future__ import annotations

import html
import os
import shutil
import subprocess
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from trajbus.consumers.operator.tools import TimelineEntry

__all__ = [
    "PngUnavailableError",
    "Step",
    "ToolShare",
    "Waterfall",
    "build_waterfall",
    "chromium_command",
    "find_chromium",
    "render_html",
    "render_png",
]

THINK = "agent think time"
_PALETTE = ("#4e79a7", "#f28e2b", "#e15759", "#76b7b2", "#59a14f", "#edc948", "#b07aa1",
            "#ff9da7", "#9c755f", "#2f4b7c", "#a05195", "#d45087")
_THINK_COLOR = "#c8c8c8"
_CHART_MAX_ROWS = 400


@dataclass(frozen=True, slots=True)
class Step:
    index: int
    call_id: str
    tool: str
    args: str
    call_seq: int
    start_ms: int  # from the episode start
    duration_ms: int
    think_before_ms: int
    status: str  # OK | ERROR | TIMEOUT | OPEN
    result: str


@dataclass(frozen=True, slots=True)
class ToolShare:
    tool: str
    calls: int
    total_ms: int
    share: float
    errors: int


@dataclass
class Waterfall:
    task: str
    sandbox: str
    episode: str
    start_ms: int
    end_ms: int
    steps: list[Step]
    think_ms: int
    per_tool: list[ToolShare] = field(default_factory=list)

    @property
    def total_ms(self) -> int:
        return max(self.end_ms - self.start_ms, 0)

    @property
    def think_share(self) -> float:
        return self.think_ms / self.total_ms if self.total_ms else 0.0

    @property
    def headline(self) -> str:
        if not self.steps:
            return "no tool calls in this episode"
        top = self.per_tool[0]
        if self.think_share > top.share:
            return (f"{self.think_share:.0%} of the episode was {THINK}; the busiest tool, "
                    f"{top.tool}, took {top.share:.0%}")
        return (f"{top.share:.0%} of the episode was spent in {top.tool} "
                f"({top.calls} calls, {_fmt(top.total_ms)})")


def _fmt(ms: int) -> str:
    if ms < 1000:
        return f"{ms} ms"
    if ms < 120_000:
        return f"{ms / 1000:.1f} s"
    return f"{ms / 60_000:.1f} min"


def build_waterfall(entries: Sequence[TimelineEntry], episode: str | None = None) -> Waterfall:
    """The waterfall of ``episode`` (default: the only episode among ``entries``; sandbox-level
    entries are ignored). Raises ValueError when there is no such episode or several."""
    eps = sorted({e.episode for e in entries if e.episode is not None})
    if episode is None:
        if len(eps) != 1:
            raise ValueError(f"pick one episode: the entries hold {eps or 'none'}")
        episode = eps[0]
    evs = sorted((e for e in entries if e.episode == episode), key=lambda e: (e.seq, e.time_ms))
    if not evs:
        raise ValueError(f"no events of episode {episode!r}")
    start_ev = next((e for e in evs if e.kind == "EpisodeStart"), None)
    end_ev = next((e for e in evs if e.kind == "EpisodeEnd"), None)
    start = start_ev.time_ms if start_ev else min(e.time_ms for e in evs)
    end = end_ev.time_ms if end_ev else max(e.time_ms for e in evs)
    results = {e.record.get("call_id"): e for e in evs if e.kind == "ToolResult"}
    steps: list[Step] = []
    cursor = start
    think = 0
    for call in (e for e in evs if e.kind == "ToolCall"):
        r = call.record
        res = results.get(r.get("call_id"))
        if res is None:
            dur, status, summary = max(end - call.time_ms, 0), "OPEN", "no result"
        else:
            rr = res.record
            measured = int(rr.get("duration_ms") or 0)
            dur = measured if measured > 0 else max(res.time_ms - call.time_ms, 0)
            status, summary = str(rr.get("status")), str(rr.get("result_summary") or "")
        gap = max(call.time_ms - cursor, 0)
        think += gap
        steps.append(Step(
            index=len(steps) + 1, call_id=str(r.get("call_id")), tool=str(r.get("tool")),
            args=str(r.get("args_summary") or r.get("args_canonical") or ""),
            call_seq=call.seq, start_ms=call.time_ms - start, duration_ms=dur,
            think_before_ms=gap, status=status, result=summary))
        cursor = max(cursor, call.time_ms + dur)
    think += max(end - cursor, 0)
    end = max(end, cursor)
    total = max(end - start, 0)
    agg: dict[str, list[int]] = {}
    for s in steps:
        a = agg.setdefault(s.tool, [0, 0, 0])
        a[0] += 1
        a[1] += s.duration_ms
        a[2] += s.status not in ("OK", "OPEN")
    per_tool = sorted(
        (ToolShare(tool, n, ms, ms / total if total else 0.0, err)
         for tool, (n, ms, err) in agg.items()),
        key=lambda t: (-t.total_ms, t.tool))
    return Waterfall(task=evs[0].task, sandbox=evs[0].sandbox, episode=episode, start_ms=start,
                     end_ms=end, steps=steps, think_ms=think, per_tool=per_tool)


# -- HTML ----------------------------------------------------------------------------------
_CSS = """
body{font:14px/1.4 system-ui,-apple-system,"Segoe UI",Roboto,sans-serif;margin:24px;color:#222}
h1{font-size:20px;margin:0 0 4px}
.meta{color:#555;margin-bottom:12px}
.headline{font-size:16px;font-weight:600;margin:12px 0}
table{border-collapse:collapse;margin:8px 0 20px}
th,td{border-bottom:1px solid #e4e4e4;padding:3px 10px;text-align:left;vertical-align:top}
th{background:#f6f6f6}
td.num{text-align:right;font-variant-numeric:tabular-nums}
.sw{display:inline-block;width:10px;height:10px;margin-right:6px;border-radius:2px}
.err{color:#b00}
svg text{font:12px system-ui,sans-serif}
"""


def _color_map(wf: Waterfall) -> dict[str, str]:
    return {t.tool: _PALETTE[i % len(_PALETTE)] for i, t in enumerate(wf.per_tool)}


def _share_bar(wf: Waterfall, colors: dict[str, str], width: int = 900) -> str:
    parts = [(t.tool, t.total_ms, colors[t.tool]) for t in wf.per_tool]
    parts.append((THINK, wf.think_ms, _THINK_COLOR))
    total = sum(ms for _, ms, _ in parts) or 1
    x = 0.0
    rects = []
    for name, ms, color in parts:
        w = width * ms / total
        if w <= 0:
            continue
        rects.append(f'<rect x="{x:.2f}" y="0" width="{w:.2f}" height="22" fill="{color}">'
                     f"<title>{html.escape(name)}: {_fmt(ms)} ({ms / total:.0%})</title></rect>")
        x += w
    return (f'<svg width="{width}" height="22" viewBox="0 0 {width} 22" role="img" '
            f'aria-label="time share">{"".join(rects)}</svg>')


def _chart(wf: Waterfall, colors: dict[str, str], width: int = 900) -> str:
    steps = wf.steps[:_CHART_MAX_ROWS]
    label_w, row_h = 220, 18
    plot_w = width - label_w - 10
    total = wf.total_ms or 1
    h = row_h * len(steps) + 24
    out = [f'<svg width="{width}" height="{h}" viewBox="0 0 {width} {h}" role="img" '
           f'aria-label="step waterfall">']
    for i in range(5):  # time axis
        x = label_w + plot_w * i / 4
        out.append(f'<line x1="{x:.1f}" y1="0" x2="{x:.1f}" y2="{h - 18}" stroke="#eee"/>'
                   f'<text x="{x:.1f}" y="{h - 4}" text-anchor="middle">'
                   f"{_fmt(total * i // 4)}</text>")
    for row, s in enumerate(steps):
        y = row * row_h + 2
        x_call = label_w + plot_w * s.start_ms / total
        if s.think_before_ms:
            x_think = label_w + plot_w * (s.start_ms - s.think_before_ms) / total
            out.append(f'<rect x="{x_think:.2f}" y="{y + 6}" width="{x_call - x_think:.2f}" '
                       f'height="4" fill="{_THINK_COLOR}"><title>{THINK}: '
                       f"{_fmt(s.think_before_ms)}</title></rect>")
        w = max(plot_w * s.duration_ms / total, 1.0)
        label = html.escape(f"#{s.index} {s.tool}")
        tip = html.escape(f"#{s.index} {s.tool}({s.args}) {s.status} {_fmt(s.duration_ms)}")
        stroke = "" if s.status == "OK" else ' stroke="#b00"'
        out.append(f'<text x="{label_w - 6}" y="{y + 12}" text-anchor="end">{label}</text>'
                   f'<rect x="{x_call:.2f}" y="{y}" width="{w:.2f}" height="{row_h - 4}" '
                   f'fill="{colors.get(s.tool, "#888")}"{stroke}>'
                   f"<title>{tip}</title></rect>")
    out.append("</svg>")
    return "".join(out)


def render_html(entries: Sequence[TimelineEntry], episode: str | None = None) -> str:
    """A self-contained HTML page (inline CSS and SVG; no script, no external resource)."""
    wf = build_waterfall(entries, episode)
    colors = _color_map(wf)
    e = html.escape
    share_rows = [
        f'<tr><td><span class="sw" style="background:{colors[t.tool]}"></span>{e(t.tool)}</td>'
        f'<td class="num">{t.calls}</td><td class="num">{_fmt(t.total_ms)}</td>'
        f'<td class="num">{t.share:.1%}</td><td class="num">{t.errors}</td></tr>'
        for t in wf.per_tool]
    share_rows.append(
        f'<tr><td><span class="sw" style="background:{_THINK_COLOR}"></span>{THINK}</td>'
        f'<td class="num"></td><td class="num">{_fmt(wf.think_ms)}</td>'
        f'<td class="num">{wf.think_share:.1%}</td><td class="num"></td></tr>')
    step_rows = [
        f'<tr><td class="num">{s.index}</td><td>{e(s.call_id)}</td><td>{e(s.tool)}</td>'
        f"<td>{e(s.args[:200])}</td><td class=\"num\">+{_fmt(s.start_ms)}</td>"
        f'<td class="num">{_fmt(s.duration_ms)}</td><td class="num">{_fmt(s.think_before_ms)}'
        f'</td><td class="{"" if s.status == "OK" else "err"}">{e(s.status)}</td>'
        f"<td>{e(s.result[:200])}</td></tr>"
        for s in wf.steps]
    more = (f"<p>chart shows the first {_CHART_MAX_ROWS} of {len(wf.steps)} steps; the table "
            "lists all.</p>" if len(wf.steps) > _CHART_MAX_ROWS else "")
    title = f"step-time waterfall: {wf.sandbox}/{wf.episode}"
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>{e(title)}</title>
<style>{_CSS}</style></head><body>
<h1>{e(title)}</h1>
<div class="meta">task {e(wf.task)} &middot; sandbox {e(wf.sandbox)} &middot; episode \
{e(wf.episode)} &middot; {len(wf.steps)} tool calls &middot; duration {_fmt(wf.total_ms)}</div>
<div class="headline" id="headline">{e(wf.headline)}</div>
<h2>Where the time went</h2>
{_share_bar(wf, colors)}
<table id="per-tool"><tr><th>tool</th><th>calls</th><th>time</th><th>share</th><th>errors</th>
</tr>{"".join(share_rows)}</table>
<h2>Steps</h2>
{more}{_chart(wf, colors)}
<table id="steps"><tr><th>#</th><th>call</th><th>tool</th><th>args</th><th>start</th>
<th>duration</th><th>think before</th><th>status</th><th>result</th></tr>
{"".join(step_rows)}</table>
</body></html>
"""


# -- PNG -----------------------------------------------------------------------------------
class PngUnavailableError(RuntimeError):
    """Neither matplotlib nor a headless Chromium is installed."""


_CHROMIUM_NAMES = ("chromium", "chromium-headless-shell", "chromium-browser", "google-chrome",
                   "headless_shell")


def find_chromium() -> str | None:
    """A Chromium binary: ``$TRAJBUS_CHROMIUM``, else the first of chromium,
    chromium-headless-shell, chromium-browser, google-chrome, headless_shell on PATH."""
    env = os.environ.get("TRAJBUS_CHROMIUM")
    if env:
        return shutil.which(env) or (env if Path(env).is_file() else None)
    for name in _CHROMIUM_NAMES:
        found = shutil.which(name)
        if found:
            return found
    return None


def chromium_command(binary: str, user_data_dir: str | Path, *args: str) -> list[str]:
    """A headless, offline Chromium invocation (no sandbox, GPU, sync, first-run, updates or
    background networking) with its own profile directory."""
    return [binary, "--headless", "--no-sandbox", "--disable-gpu",
            "--disable-background-networking", "--no-first-run", "--disable-sync",
            "--disable-component-update", "--hide-scrollbars",
            f"--user-data-dir={user_data_dir}", *args]


def render_png(entries: Sequence[TimelineEntry], path: str | Path,
               episode: str | None = None) -> Path:
    """Write the waterfall as a PNG: with matplotlib if installed, else by screenshotting
    :func:`render_html` in headless Chromium. Raises :class:`PngUnavailableError` otherwise."""
    out = Path(path)
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return _png_chromium(entries, out, episode)
    return _png_matplotlib(build_waterfall(entries, episode), out)


def _png_matplotlib(wf: Waterfall, out: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = _color_map(wf)
    steps = wf.steps[:_CHART_MAX_ROWS]
    fig, ax = plt.subplots(figsize=(12, 1.5 + 0.25 * max(len(steps), 1)))
    for row, s in enumerate(steps):
        if s.think_before_ms:
            ax.barh(row, s.think_before_ms / 1000, left=(s.start_ms - s.think_before_ms) / 1000,
                    height=0.2, color=_THINK_COLOR)
        ax.barh(row, max(s.duration_ms, 1) / 1000, left=s.start_ms / 1000, height=0.7,
                color=colors.get(s.tool, "#888"))
    ax.set_yticks(range(len(steps)), [f"#{s.index} {s.tool}" for s in steps])
    ax.invert_yaxis()
    ax.set_xlabel("seconds since episode start")
    ax.set_title(f"{wf.sandbox}/{wf.episode}: {wf.headline}")
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out


def _png_chromium(entries: Sequence[TimelineEntry], out: Path, episode: str | None) -> Path:
    binary = find_chromium()
    if binary is None:
        raise PngUnavailableError(
            "PNG output needs matplotlib (pip install matplotlib) or a headless Chromium "
            "(apt-get install -y chromium-headless-shell, or set TRAJBUS_CHROMIUM); the HTML "
            "report needs neither")
    wf = build_waterfall(entries, episode)
    page = render_html(entries, episode)
    height = min(400 + 18 * min(len(wf.steps), _CHART_MAX_ROWS) + 26 * len(wf.steps)
                 + 26 * len(wf.per_tool), 16_000)
    with tempfile.TemporaryDirectory(prefix="trajbus-waterfall-") as tmp:
        src = Path(tmp) / "waterfall.html"
        src.write_text(page, encoding="utf-8")
        target = out.resolve()
        cmd = chromium_command(binary, Path(tmp) / "profile", f"--screenshot={target}",
                               f"--window-size=1000,{height}", src.as_uri())
        proc = subprocess.run(cmd, capture_output=True, timeout=120, check=False)
        if proc.returncode != 0 or not target.exists():
            raise PngUnavailableError(
                f"{binary} did not write {target} (exit {proc.returncode}): "
                f"{proc.stderr.decode(errors='replace')[-500:]}")
    return out
