"""What the codec's two code generators share: the source writer, the two control-flow errors
and the Avro integer ranges.

The compiled encoder (:mod:`trajbus.schemas.fast_encoder`) and the head reader
(:mod:`trajbus.schemas.head_reader`) each write Python source from one of this package's own
schemas and compile it once. Both signal "not this value, let fastavro decide" with
:class:`Fallback` (at run time) and "not this schema, no generated code" with
:class:`Unsupported` (at generation time); neither ever reaches a caller of the codec.
"""

from __future__ import annotations

from typing import Any

LONG_MIN, LONG_MAX = -(1 << 63), (1 << 63) - 1
INT_MIN, INT_MAX = -(1 << 31), (1 << 31) - 1


class Fallback(Exception):
    """The value (or the bytes) is not in the generated code's plainly typed domain: the
    codec's general path (fastavro) decides, and raises what it always raised."""


class Unsupported(Exception):
    """The schema uses something the generator does not cover: no code is generated for it."""


class GeneratedSource:
    """Lines of generated Python source, fresh local names and the constants it refers to."""

    def __init__(self) -> None:
        self.lines: list[str] = []
        self.consts: dict[str, Any] = {}
        self._n = 0

    def var(self, stem: str = "v") -> str:
        self._n += 1
        return f"{stem}{self._n}"

    def const(self, value: Any) -> str:
        name = self.var("_c")
        self.consts[name] = value
        return name

    def line(self, depth: int, text: str) -> None:
        self.lines.append("    " * depth + text)
