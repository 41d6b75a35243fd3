"""Functions of the C library that Python's ``os`` does not offer (Linux only).

One place loads them, so the emitters' journal (``syncfs``) and the shared sender (``prctl``
for the loop thread's timer slack) agree on how: by name from the process's own C library,
with ``errno`` kept, and None where there is none (not Linux, or an old libc)."""

from __future__ import annotations

import ctypes
import sys
from typing import Any

__all__ = ["libc_function"]


def libc_function(name: str) -> Any | None:
    """The C library's function ``name`` (a ``ctypes`` function pointer whose failures set
    ``ctypes.get_errno()``), or None where it is missing."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        return getattr(ctypes.CDLL(None, use_errno=True), name)
    except (OSError, AttributeError):
        return None
