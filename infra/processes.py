"""OS processes as a launcher sees them: is a pid alive, what it runs, the end of its log;
freezing one (SIGSTOP) and knowing it is frozen.

Linux reads ``/proc``; elsewhere :func:`pid_alive` trusts ``kill(pid, 0)`` and
:func:`pid_cmdline` knows nothing (None).
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from pathlib import Path


def file_tail(path: Path, lines: int = 30) -> str:
    """The last ``lines`` lines of a log file (of its last 64 KiB), "(no log)" when it cannot be
    read, "(empty)" when it holds none."""
    try:
        with open(path, "rb") as fh:
            fh.seek(0, os.SEEK_END)
            fh.seek(max(0, fh.tell() - 64 * 1024))
            text = fh.read().decode("utf-8", errors="replace")
    except OSError:
        return "(no log)"
    return "\n".join(text.splitlines()[-lines:]) or "(empty)"


def pid_alive(pid: int) -> bool:
    """True if ``pid`` exists and is not a zombie."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return _state(f"/proc/{pid}/stat") != "Z"  # None without /proc (macOS): trust kill(0)


def _state(stat_file: str) -> str | None:
    """The state letter (R, S, D, T, Z, ...) of a process's or thread's ``/proc`` stat file,
    None when it cannot be read. The name before it may hold any character but ")"."""
    try:
        return Path(stat_file).read_text().rsplit(")", 1)[-1].split()[0]
    except (OSError, IndexError):
        return None


def pid_cmdline(pid: int) -> str | None:
    """The command line of ``pid``, arguments joined by spaces; None without ``/proc``."""
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return None


def freeze(pid: int, timeout: float = 10.0) -> None:
    """SIGSTOP ``pid`` and return once every thread of it has stopped. The kernel stops the
    threads one by one after the signal is sent: on a loaded machine a thread of a broker was
    seen running 21 ms later, long enough to answer a request sent after ``kill`` returned.
    If a thread still runs after ``timeout`` seconds, resumes the process and raises
    ``TimeoutError``. Without ``/proc`` (macOS), returns once the signal is sent."""
    os.kill(pid, signal.SIGSTOP)
    deadline = time.monotonic() + timeout
    while not _all_threads_stopped(pid):
        if time.monotonic() >= deadline:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)  # never leave it half frozen
            raise TimeoutError(f"process {pid} still had running threads {timeout:g} s "
                               "after SIGSTOP (resumed)")
        time.sleep(0.001)


def _all_threads_stopped(pid: int) -> bool:
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except FileNotFoundError:
        return True  # no /proc here (macOS), or the process is gone: nothing of it runs
    # a thread that exited meanwhile (no state) runs no more either
    return all(_state(f"/proc/{pid}/task/{tid}/stat") in (None, "T", "t", "Z", "X")
               for tid in tasks)
