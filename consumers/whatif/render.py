"""A :class:`~trajbus.consumers.whatif.diff.Diff` for people: a text table, JSON, and a
self-contained HTML report (inline style, no script, nothing fetched).

Every form starts with the self-check, then the changed rules, then per sandbox the decisions
and alerts added (``+``), removed (``-``) and moved (``~``), then the totals.
"""

from __future__ import annotations

import html
import json
from typing import Any

from trajbus.bus.positions import duration, iso
from trajbus.consumers.operator.tools import humanize
from trajbus.consumers.whatif.diff import Change, Diff

__all__ = ["render_html", "render_json", "render_table"]

_MARK = {"added": "+", "removed": "-", "moved": "~"}


def _shift(ms: int | None) -> str:
    if ms is None:
        return ""
    if ms == 0:
        return "same time"
    return f"{duration(abs(ms))} {'sooner' if ms < 0 else 'later'}"


def _where(c: Change) -> str:
    return c.episode if c.episode is not None else "(sandbox)"


def _when(c: Change) -> str:
    if c.change == "moved":
        assert c.before is not None and c.after is not None
        return f"{iso(c.before.time_ms)} -> {iso(c.after.time_ms)}"
    return iso(c.time_ms)


def _seq(c: Change) -> str:
    a, b = c.seq_before, c.seq_after
    if c.change == "moved" and a is not None and b is not None and a != b:
        return f"seq {a} -> {b}"
    v = b if b is not None else a
    return "" if v is None else f"seq {v}"


def _detect(c: Change) -> str:
    a, b = c.detect_before_ms, c.detect_after_ms
    if a is not None and b is not None:
        return (f"caught after {duration(b)} of looping instead of {duration(a)} "
                f"({_shift(b - a)})")
    if b is not None:
        return f"caught after {duration(b)} of looping (missed by the recorded rules)"
    if a is not None:
        return f"missed (the recorded rules caught it after {duration(a)})"
    return ""


def _line(c: Change) -> str:
    parts = [f"  {_MARK[c.change]} {c.label:<17} {c.processor:<9} {_where(c):<12}",
             _when(c)]
    extra = [x for x in (_seq(c), _shift(c.shift_ms) if c.change == "moved" else "",
                         _detect(c)) if x]
    if extra:
        parts.append(f"({'; '.join(extra)})")
    text = "  ".join(parts)
    reason = humanize(c.ref.reason)
    return f"{text}\n      {reason}" if reason else text


def _rules(diff: Diff) -> list[str]:
    if not diff.rules:
        return ["rules: the recorded rules (nothing changed: the diff is empty by definition)"]
    return ["rules changed: " + ", ".join(f"{n} {a!r} -> {b!r}" for n, a, b in diff.rules)]


def _totals_line(diff: Diff) -> str:
    t = diff.totals()
    text = (f"totals: {t['added']} added, {t['removed']} removed, {t['moved']} moved, "
            f"{t['unchanged']} unchanged, in {t['sandboxes_changed']} of "
            f"{t['sandboxes_compared']} sandboxes with decisions/alerts")
    if t["mean_shift_ms"] is not None:
        text += f"; moved ones on average {_shift(t['mean_shift_ms'])}"
    if t["mean_detect_delta_ms"] is not None:
        text += f"; loops caught on average {_shift(t['mean_detect_delta_ms'])}"
    return text


def _by_label(diff: Diff) -> list[str]:
    out = []
    for kind, labels in diff.totals()["by_label"].items():
        out.append(f"  {kind}: " + ", ".join(f"{n} {label}" for label, n in labels.items()))
    return out


def render_table(diff: Diff) -> str:
    """The text report (the CLI's default output)."""
    lines = [diff.self_check.headline()]
    for m in diff.self_check.mismatches:
        lines.append(f"  ! {m.kind}: {m.label} of {m.sandbox} at {iso(m.time_ms)} "
                     f"(id {m.event_id[:8]}) {humanize(m.detail)}")
    lines += _rules(diff)
    lines.append(f"question: {diff.where.describe()}; re-ran the watchdog and the scheduler "
                 f"over {sum(diff.inputs.values())} input records ({diff.events} events "
                 "fed to the cores in both runs)")
    for sb in diff.sandboxes:
        c = sb.counts()
        lines.append("")
        lines.append(f"sandbox {sb.sandbox} (task {sb.task}): {c['added']} added, "
                     f"{c['removed']} removed, {c['moved']} moved")
        lines.extend(_line(ch) for ch in sb.changes)
    lines.append("")
    if diff.empty:
        lines.append("no difference: the changed rules decide exactly what the recorded "
                     "rules decided")
    lines.append(_totals_line(diff))
    lines.extend(_by_label(diff))
    return "\n".join(lines)


def render_json(diff: Diff) -> str:
    """The whole diff as one JSON document (times in epoch ms)."""
    return json.dumps(diff.to_dict(), indent=2, default=str)


_CSS = """
body{font:14px/1.4 system-ui,sans-serif;margin:24px;color:#222;max-width:1200px}
h1{font-size:20px}h2{font-size:16px;margin-top:28px}
.ok{background:#e6f4ea;border-left:4px solid #2e7d32;padding:8px 12px}
.fail{background:#fdecea;border-left:4px solid #c62828;padding:8px 12px;font-weight:600}
table{border-collapse:collapse;width:100%;margin:8px 0}
th,td{border-bottom:1px solid #ddd;padding:4px 8px;text-align:left;vertical-align:top}
th{background:#f5f5f5}
tr.added td:first-child{color:#2e7d32;font-weight:700}
tr.removed td:first-child{color:#c62828;font-weight:700}
tr.moved td:first-child{color:#ef6c00;font-weight:700}
.reason{color:#555;font-size:12px}
.totals td{font-variant-numeric:tabular-nums}
"""


def _e(value: Any) -> str:
    return html.escape(str(value), quote=True)


def render_html(diff: Diff) -> str:
    """A self-contained HTML page: the self-check, the changed rules, the totals, then one
    table per changed sandbox."""
    t = diff.totals()
    sc = diff.self_check
    out = ["<!DOCTYPE html>", '<html lang="en"><head><meta charset="utf-8">',
           "<title>trajbus what-if report</title>", f"<style>{_CSS}</style></head><body>",
           "<h1>What-if replay</h1>",
           f'<p id="self-check" class="{"ok" if sc.passed else "fail"}">{_e(sc.headline())}'
           "</p>"]
    if sc.mismatches:
        out.append('<table id="mismatches"><tr><th>mismatch</th><th>what</th><th>sandbox</th>'
                   "<th>event time</th><th>detail</th></tr>")
        for m in sc.mismatches:
            out.append(f"<tr><td>{_e(m.kind)}</td><td>{_e(m.label)}</td><td>{_e(m.sandbox)}"
                       f"</td><td>{_e(iso(m.time_ms))}</td><td>{_e(humanize(m.detail))}</td>"
                       "</tr>")
        out.append("</table>")
    out.append('<h2>Rules</h2><table id="rules"><tr><th>rule</th><th>recorded</th>'
               "<th>what-if</th></tr>")
    for name, a, b in diff.rules:
        out.append(f"<tr><td>{_e(name)}</td><td>{_e(a)}</td><td>{_e(b)}</td></tr>")
    if not diff.rules:
        out.append('<tr><td colspan="3">none changed: the recorded rules</td></tr>')
    out.append("</table>")
    out.append(f"<p>Question: {_e(diff.where.describe())}; {sum(diff.inputs.values())} input "
               f"records re-run, {diff.events} events fed to the cores.</p>")
    out.append('<h2>Totals</h2><table id="totals" class="totals"><tr><th>added</th>'
               "<th>removed</th><th>moved</th><th>unchanged</th><th>sandboxes changed</th>"
               "<th>mean shift</th><th>mean time-to-detect delta</th></tr>"
               f"<tr><td>{t['added']}</td><td>{t['removed']}</td><td>{t['moved']}</td>"
               f"<td>{t['unchanged']}</td><td>{t['sandboxes_changed']} of "
               f"{t['sandboxes_compared']}</td><td>{_e(_shift(t['mean_shift_ms']))}</td>"
               f"<td>{_e(_shift(t['mean_detect_delta_ms']))}</td></tr></table>")
    for kind, labels in t["by_label"].items():
        out.append(f"<p>{_e(kind)}: " + ", ".join(f"{n} {_e(label)}"
                                                   for label, n in labels.items()) + "</p>")
    if diff.empty:
        out.append('<p id="no-difference">No difference: the changed rules decide exactly '
                   "what the recorded rules decided.</p>")
    for sb in diff.sandboxes:
        c = sb.counts()
        out.append(f'<h2 id="sandbox-{_e(sb.sandbox)}">Sandbox {_e(sb.sandbox)} '
                   f"<small>(task {_e(sb.task)}): {c['added']} added, {c['removed']} "
                   f"removed, {c['moved']} moved</small></h2>")
        out.append("<table><tr><th></th><th>decision / alert</th><th>by</th><th>episode</th>"
                   "<th>event time</th><th>seq</th><th>shift</th><th>time to detect</th>"
                   "</tr>")
        for ch in sb.changes:
            out.append(
                f'<tr class="{ch.change}"><td>{_MARK[ch.change]}</td><td>{_e(ch.label)}'
                f'<div class="reason">{_e(humanize(ch.ref.reason))}</div></td>'
                f"<td>{_e(ch.processor)}</td><td>{_e(_where(ch))}</td><td>{_e(_when(ch))}</td>"
                f"<td>{_e(_seq(ch))}</td>"
                f"<td>{_e(_shift(ch.shift_ms) if ch.change == 'moved' else '')}</td>"
                f"<td>{_e(_detect(ch))}</td></tr>")
        out.append("</table>")
    out.append("</body></html>")
    return "\n".join(out)
