"""What /proc says about a process or the machine: CPU seconds, busy cores, resident memory."""

from __future__ import annotations

import os
from pathlib import Path

CLK_TCK = os.sysconf("SC_CLK_TCK")


def proc_cpu_s(pid: int, children: bool = False) -> float | None:
    """User + system CPU seconds of a live process (all its threads), from /proc/<pid>/stat;
    with ``children``, its reaped children's too. None once the process is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return sum(int(x) for x in fields[11:15 if children else 13]) / CLK_TCK


def box_cpu() -> tuple[float, float]:
    """(busy, total) CPU seconds of the whole machine since boot, from /proc/stat."""
    vals = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    idle = vals[3] + (vals[4] if len(vals) > 4 else 0)
    total = sum(vals[:8])
    return (total - idle) / CLK_TCK, total / CLK_TCK


def rss_mb(pid: int) -> dict[str, float] | None:
    """VmRSS and VmHWM (peak) of a live process in MB, from /proc/<pid>/status."""
    out: dict[str, float] = {}
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(("VmRSS:", "VmHWM:")):
                key, val = line.split(":", 1)
                out[key] = int(val.split()[0]) / 1024
    except OSError:
        return None
    return {"rss_mb": round(out.get("VmRSS", 0.0), 1),
            "peak_rss_mb": round(out.get("VmHWM", 0.0), 1)}
