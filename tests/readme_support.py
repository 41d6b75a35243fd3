"""README snippets as tests: the fenced code blocks of one README section, each with the
output block shown right after it (a ```text block), if any."""

from __future__ import annotations

import re
from dataclasses import dataclass

from support import REPO

_FENCE = re.compile(r"^```(\w*)\n(.*?)^```\n", re.S | re.M)


@dataclass(frozen=True)
class Snippet:
    lang: str
    code: str
    output: str | None  # the ```text block that follows it, when there is one
    line: int  # where the block starts in README.md (1-based)


def readme_section(heading: str) -> tuple[str, int]:
    """The text of the ``## heading`` section of README.md and its first line number."""
    text = (REPO / "README.md").read_text(encoding="utf-8")
    start = text.index(f"\n## {heading}") + 1
    end = text.find("\n## ", start + 3)
    return text[start:end if end >= 0 else len(text)], text[:start].count("\n") + 1


def snippets(heading: str, lang: str) -> list[Snippet]:
    """The ``lang`` blocks of the section, each with its following text block."""
    section, first_line = readme_section(heading)
    blocks = [(m.group(1), m.group(2), m.start(), m.end()) for m in _FENCE.finditer(section)]
    out = []
    for i, (kind, code, start, end) in enumerate(blocks):
        if kind != lang:
            continue
        output = None
        if i + 1 < len(blocks):
            nkind, ncode, nstart, _ = blocks[i + 1]
            if nkind == "text" and section[end:nstart].strip() == "":
                output = ncode
        out.append(Snippet(kind, code, output, first_line + section[:start].count("\n")))
    return out
