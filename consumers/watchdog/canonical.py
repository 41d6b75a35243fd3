"""Canonical JSON for tool arguments and results: one spelling per value, so equal calls hash
equal.

The emitter fills ``ToolCall.args_hash`` / ``args_canonical`` (and the result fields) with
this module, and the watchdog compares calls with it, so the format below is a contract: do
not change it without a schema/hash version bump.

Canonical form (guarantees):

- Objects: keys sorted by Unicode code point (Python ``str`` order; note: RFC 8785 sorts by
  UTF-16 code units, which differs only for astral-plane keys), members joined by ``,`` and
  ``:`` with no whitespace anywhere outside strings.
- Ignored fields: every object member whose *key* is in ``ignore`` is removed, at any depth
  (objects inside arrays included). Values are never inspected for ignored names.
- Numbers: a number whose value is integral is written as an exact decimal integer, whatever
  its spelling or Python type: ``1``, ``1.0``, ``1e0``, ``int(1)`` and ``float(1)`` all give
  ``1`` (booleans stay ``true``/``false``); ``-0.0`` gives ``0``; ``1e20`` gives
  ``100000000000000000000``. Other numbers are written as the shortest repr that
  round-trips the IEEE double (``0.1``, ``1.5e-07``). JSON literals with a fraction or
  exponent are read as doubles (as Python's ``json`` does); integer literals are exact. NaN
  and infinities are rejected (they are not JSON).
- Strings: JSON escapes only where required (``"`` ``\\`` and control characters); other
  characters, non-ASCII included, are written as themselves. Hashes use UTF-8 (lone
  surrogates, which cannot come from valid JSON text, are encoded with ``surrogatepass``).
- ``true``/``false``/``null`` as such; Python tuples are arrays; ``StrEnum``/``IntEnum``
  members are their values. Object keys must be strings. Any other type is an error.
- JSON *text* input (``str``/``bytes``) is parsed first; duplicate keys keep the last value
  (Python ``json`` semantics). To canonicalise a Python ``str`` *value*, wrap it:
  ``canonical_json([s])`` -- or call :meth:`Canonicalizer.json_value`.

``canonical_hash`` is the SHA-256 hex digest of the UTF-8 canonical text. Errors raise
:class:`CanonicalError` (a ``ValueError``) with a stable ``reason_code``.

Hot path: :class:`Canonicalizer` precompiles one ignore set. Its
:meth:`~Canonicalizer.strip_canonical` removes ignored scalar members from text that is
*already canonical* without parsing it (a regex pass), falling back to a full re-parse only
when an ignored member holds an object/array or the text is not in canonical shape.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Callable, Iterable
from enum import Enum
from functools import lru_cache
from typing import Any

__all__ = [
    "CanonicalError",
    "Canonicalizer",
    "canonical_bytes",
    "canonical_digest",
    "canonical_hash",
    "canonical_json",
    "canonicalizer",
]

_EMPTY: frozenset[str] = frozenset()


class CanonicalError(ValueError):
    """The value cannot be canonicalised. ``reason_code``: ``invalid_json``, ``non_finite``,
    ``bad_key``, ``unsupported_type`` or ``too_deep``."""

    def __init__(self, reason_code: str, message: str) -> None:
        super().__init__(message)
        self.reason_code = reason_code


def _reject_constant(name: str) -> Any:
    raise CanonicalError("non_finite", f"{name} is not a JSON number")


_DECODER = json.JSONDecoder(parse_constant=_reject_constant)
_ENCODER = json.JSONEncoder(
    sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False,
    check_circular=False,
)
_encode = _ENCODER.encode

# One JSON scalar in canonical text: a string, a number, true, false or null.
_SCALAR = (
    r'(?:"(?:[^"\\]|\\.)*"'
    r"|-?(?:0|[1-9][0-9]*)(?:\.[0-9]+)?(?:[eE][+-]?[0-9]+)?"
    r"|true|false|null)"
)


class Canonicalizer:
    """Canonical JSON with one fixed set of ignored field names. Immutable and thread-safe;
    build once and reuse (module functions cache one per ignore set)."""

    __slots__ = ("_detect", "_strip_first", "_strip_rest", "ignore")

    def __init__(self, ignore: Iterable[str] = ()) -> None:
        self.ignore: frozenset[str] = frozenset(ignore)
        for name in self.ignore:
            if not isinstance(name, str):
                raise TypeError(f"ignored field names must be str, got {type(name).__name__}")
        if self.ignore:
            # Escape exactly as the encoder would write the key, then for regex.
            names = "|".join(
                re.escape(_encode(n)[1:-1]) for n in sorted(self.ignore, key=len, reverse=True)
            )
            # Any member named like an ignored field, in any spelling with whitespace.
            self._detect: re.Pattern[str] | None = re.compile(rf'"(?:{names})"\s*:')
            # Canonical text: a key starts right after "{" or "," -- a `,"` or `{"` pair never
            # occurs inside a JSON string (quotes there are escaped), so these only hit keys.
            self._strip_rest: re.Pattern[str] | None = re.compile(
                rf',"(?:{names})":{_SCALAR}(?=[,}}])'
            )
            self._strip_first: re.Pattern[str] | None = re.compile(
                rf'(?<={{)"(?:{names})":{_SCALAR}(?:,|(?=}}))'
            )
        else:
            self._detect = self._strip_rest = self._strip_first = None

    # -- full canonicalisation ------------------------------------------------------------
    def json(self, value: Any) -> str:
        """Canonical JSON text of ``value`` (JSON text if ``str``/``bytes``, else a Python
        object)."""
        if isinstance(value, (str, bytes, bytearray, memoryview)):
            value = self._parse(value)
        return self.json_value(value)

    def json_value(self, value: Any) -> str:
        """Canonical JSON text of a Python object (a ``str`` is a JSON string here)."""
        try:
            return _encode(self._norm(value))
        except RecursionError:
            raise CanonicalError("too_deep", "value nested too deeply (or circular)") from None

    def to_bytes(self, value: Any) -> bytes:
        """UTF-8 of :meth:`json`."""
        return self.json(value).encode("utf-8", "surrogatepass")

    def digest(self, value: Any) -> bytes:
        """SHA-256 (32 raw bytes) of the canonical text."""
        return hashlib.sha256(self.to_bytes(value)).digest()

    def hash(self, value: Any) -> str:
        """SHA-256 hex of the canonical text."""
        return hashlib.sha256(self.to_bytes(value)).hexdigest()

    # -- already-canonical text (hot path) --------------------------------------------------
    @property
    def detector(self) -> Callable[[str], Any] | None:
        """``search`` of the regex behind :meth:`mentions_ignored` (None: empty ignore set);
        for hot loops that want to skip a method call."""
        return None if self._detect is None else self._detect.search

    def mentions_ignored(self, text: str) -> bool:
        """True if ``text`` may contain a member with an ignored name (cheap scan; no false
        negatives for members spelled without escapes)."""
        return self._detect is not None and self._detect.search(text) is not None

    def strip_canonical(self, text: str) -> str:
        """Canonical text of ``text`` with ignored members removed, assuming ``text`` is already
        canonical (as written by this module). Scalar-valued ignored members are cut out
        textually; otherwise (nested value, whitespace, escapes) the text is fully re-parsed,
        so the result is canonical for any valid JSON text that mentions an ignored name.
        Text that mentions no ignored name is returned unchanged (not validated)."""
        detect = self._detect
        if detect is None or detect.search(text) is None:
            return text
        assert self._strip_rest is not None and self._strip_first is not None
        out = self._strip_first.sub("", self._strip_rest.sub("", text))
        if detect.search(out) is None:
            return out
        return self.json(text)

    def digest_canonical(self, text: str) -> bytes:
        """SHA-256 of :meth:`strip_canonical` (``text`` trusted to be canonical)."""
        return hashlib.sha256(self.strip_canonical(text).encode("utf-8", "surrogatepass")).digest()

    # -- internals ----------------------------------------------------------------------------
    @staticmethod
    def _parse(text: str | bytes | bytearray | memoryview) -> Any:
        try:
            if not isinstance(text, str):
                text = bytes(text).decode("utf-8")
            return _DECODER.decode(text)
        except CanonicalError:
            raise
        except RecursionError:
            raise CanonicalError("too_deep", "JSON text nested too deeply") from None
        except (ValueError, UnicodeDecodeError) as exc:
            raise CanonicalError("invalid_json", f"not JSON text: {exc}") from None

    def _norm(self, v: Any) -> Any:
        t = type(v)
        if t is str or t is int or t is bool or v is None:
            return v
        if t is float:
            if v != v or v in (_INF, _NINF):
                raise CanonicalError("non_finite", f"{v!r} is not a JSON number")
            return int(v) if v.is_integer() else v
        if t is dict:
            ignore = self.ignore
            norm = self._norm
            out = {}
            for k, x in v.items():
                if type(k) is not str:
                    if isinstance(k, str):
                        k = str(k)
                    else:
                        raise CanonicalError(
                            "bad_key", f"object keys must be str, got {type(k).__name__}"
                        )
                if k not in ignore:
                    out[k] = norm(x)
            return out
        if t is list or t is tuple:
            norm = self._norm
            return [norm(x) for x in v]
        # Subclasses and friends: enums, str/int/float subclasses, other mappings/sequences.
        if isinstance(v, Enum):
            return self._norm(v.value)
        if isinstance(v, bool):
            return bool(v)
        if isinstance(v, str):
            return str(v)
        if isinstance(v, int):
            return int(v)
        if isinstance(v, float):
            return self._norm(float(v))
        if isinstance(v, dict):
            return self._norm(dict(v))
        if isinstance(v, (list, tuple)):
            return self._norm(list(v))
        raise CanonicalError("unsupported_type", f"{t.__name__} is not a JSON value")


_INF = float("inf")
_NINF = float("-inf")


@lru_cache(maxsize=64)
def _cached(ignore: frozenset[str]) -> Canonicalizer:
    return Canonicalizer(ignore)


def canonicalizer(ignore: Iterable[str] = _EMPTY) -> Canonicalizer:
    """The (cached) :class:`Canonicalizer` for an ignore set."""
    return _cached(ignore if isinstance(ignore, frozenset) else frozenset(ignore))


def canonical_json(value: Any, ignore: Iterable[str] = _EMPTY) -> str:
    """Canonical JSON text of ``value`` (JSON text or a Python object) with the members named in
    ``ignore`` removed at any depth. Raises :class:`CanonicalError`."""
    return canonicalizer(ignore).json(value)


def canonical_bytes(value: Any, ignore: Iterable[str] = _EMPTY) -> bytes:
    """UTF-8 bytes of :func:`canonical_json`."""
    return canonicalizer(ignore).to_bytes(value)


def canonical_digest(value: Any, ignore: Iterable[str] = _EMPTY) -> bytes:
    """SHA-256 (32 raw bytes) of :func:`canonical_json`."""
    return canonicalizer(ignore).digest(value)


def canonical_hash(value: Any, ignore: Iterable[str] = _EMPTY) -> str:
    """SHA-256 hex digest of the UTF-8 :func:`canonical_json` (the ``args_hash`` /
    ``result_hash`` format). Raises :class:`CanonicalError`."""
    return canonicalizer(ignore).hash(value)
