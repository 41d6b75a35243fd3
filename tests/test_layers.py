"""The layers depend one way: ``bus`` (Kafka, settings, topics) and ``schemas`` (the contract)
are the base every role builds on, so they import no role -- no producer, consumer or archive
module, not even inside a function (a lazy import is still a cycle in the design)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
ROLES = ("trajbus.producers", "trajbus.consumers", "trajbus.archive")


def _imports(path: Path) -> list[tuple[int, str]]:
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            found.append((node.lineno, node.module))
    return found


@pytest.mark.parametrize("layer", ["bus", "schemas"])
def test_base_layers_import_no_role(layer: str) -> None:
    wrong = [f"{path.relative_to(ROOT)}:{line}: {name}"
             for path in sorted((ROOT / layer).rglob("*.py"))
             for line, name in _imports(path)
             if name.startswith(ROLES)]
    assert not wrong, "base layer imports a role:\n" + "\n".join(wrong)
