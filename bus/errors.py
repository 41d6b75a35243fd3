"""Errors that mean "the user asked for something that is not there or not allowed".

Library code raises them with a message that says what exists or what to do instead; the
``trajbus`` command line prints that message (and the hint) without a Python traceback and
exits with :attr:`UserError.exit_code`. Programs using the library catch them like any
exception (``NotFoundError`` is also a ``LookupError``)."""

from __future__ import annotations

from collections.abc import Iterable


class UserError(Exception):
    """A mistake in the request (an unknown id, a wrong task, a refused operation)."""

    exit_code = 1

    def __init__(self, message: str, hint: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.hint = hint

    def __str__(self) -> str:
        return self.message + (f"\n  hint: {self.hint}" if self.hint else "")


class NotFoundError(UserError, LookupError):
    """The sandbox, episode, task, topic or record asked for does not exist."""


def existing(what: str, names: Iterable[str], limit: int = 12) -> str:
    """``"existing tasks: a, b, c (and 4 more)"`` or ``"no tasks exist"``: the part of an error
    message that tells the user what they could have asked for."""
    items = sorted(set(names))
    if not items:
        return f"no {what} exist"
    shown = ", ".join(items[:limit])
    more = f" (and {len(items) - limit} more)" if len(items) > limit else ""
    return f"existing {what}: {shown}{more}"


class InvalidValueError(UserError, ValueError):
    """A value that cannot be read as what it should be (a time, a start position)."""
