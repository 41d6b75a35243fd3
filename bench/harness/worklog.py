"""Reading a trajbus worker's log: line times, its restore lines and start-up milestones
(``parse_log``), and its per-10 s stats lines (``worker_log_stats``)."""

from __future__ import annotations

import re
import statistics
from datetime import datetime
from pathlib import Path
from typing import Any

# the runner's restore line: records, partitions, seconds
RESTORED_RE = re.compile(r"restored (\d+) state records for partitions \[([^\]]*)\] in "
                         r"([\d.]+)s")
_LOG_TIME_RE = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) ")
# worker log milestones: (name, text of the first line that marks it)
_MILESTONES = (("subscribed", "Subscribed to topic(s)"),
               ("joined_group", "Joined group"),
               ("assigned", "Setting newly assigned partitions"),
               ("restored", "state records for partitions"))


def log_time(line: str) -> float | None:
    """Epoch seconds of a worker log line (logging's asctime: local time, milliseconds)."""
    m = _LOG_TIME_RE.match(line)
    if m is None:
        return None
    return datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp()


def parse_log(path: Path, t0_wall: float) -> dict[str, Any]:
    """The restore line(s) and the start-up milestones of one worker incarnation, the times in
    seconds after ``t0_wall`` (the SIGKILL of its predecessor, or its own spawn)."""
    text = path.read_text(errors="replace") if path.exists() else ""
    res: dict[str, Any] = {"restore_lines": [], "restored_records": 0, "restore_s": 0.0}
    marks: dict[str, float] = {}
    first: float | None = None
    for line in text.splitlines():
        t = log_time(line)
        if t is None:
            continue
        if first is None:
            first = t
        for name, needle in _MILESTONES:
            if name not in marks and needle in line:
                marks[name] = t
        m = RESTORED_RE.search(line)
        if m is not None:
            res["restore_lines"].append(line.split(" INFO ", 1)[-1].strip())
            res["restored_records"] += int(m.group(1))
            res["restore_s"] = round(res["restore_s"] + float(m.group(3)), 3)
    timeline = {"first_log_line": first, **marks}
    res["timeline_s"] = {k: round(v - t0_wall, 3) for k, v in timeline.items() if v is not None}
    return res


def worker_log_stats(log_path: Path) -> dict[str, Any]:
    """The worker's own per-10 s lines (runner._log_stats): per batch polling / processing /
    transaction ms, and the input's age when the worker's poll returned it."""
    pat = re.compile(r"(\d+) batches, ([\d.]+) records/batch.*?per batch ([\d.]+) ms polling, "
                     r"([\d.]+) ms processing, (?:([\d.]+) ms waiting for the previous "
                     r"transaction, )?([\d.]+) ms transaction(?: \(max ([\d.]+) ms\))?; input "
                     r"age at poll mean (\d+) ms(?:, p99 (\d+) ms)?, max (\d+) ms")
    text = log_path.read_text(errors="replace")
    rows = [m.groups() for m in pat.finditer(text)]
    rows = [r for r in rows if int(r[0]) >= 50]  # windows with traffic
    if not rows:
        return {}

    def col(i: int) -> list[float]:
        return [float(r[i]) for r in rows if r[i] is not None]

    out: dict[str, Any] = {"windows": len(rows),
                           "records_per_batch": round(statistics.fmean(col(1)), 1),
                           "processing_ms_mean": round(statistics.fmean(col(3)), 1),
                           "txn_ms_mean": round(statistics.fmean(col(5)), 1),
                           "input_age_at_poll_ms_mean": round(statistics.fmean(col(7)), 1),
                           "input_age_at_poll_ms_max": max(col(9))}
    if col(4):
        out["wait_previous_txn_ms_mean"] = round(statistics.fmean(col(4)), 1)
    if col(6):
        out["txn_ms_max"] = max(col(6))
    if col(8):
        out["input_age_at_poll_ms_p99_per_window"] = col(8)
    diag = [ln for ln in text.splitlines() if ln.startswith("DIAG ")]
    if diag:
        out["diag"] = diag
    return out
