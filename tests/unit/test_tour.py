"""docs/TOUR.md, the newcomer's tour, names every module of the package: a new room (or a
renamed one) is added to the tour with its concern, or this fails."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
FOLDERS = ("schemas", "bus", "producers", "consumers", "archive", "infra", "trajbus")


def modules() -> list[Path]:
    return sorted(p for folder in FOLDERS for p in (ROOT / folder).rglob("*.py")
                  if p.name not in ("__init__.py", "__main__.py")
                  and "kafka" not in p.relative_to(ROOT).parts[1:2])


def test_the_tour_names_every_module() -> None:
    tour = (ROOT / "docs" / "TOUR.md").read_text()
    named = set(re.findall(r"`([^`]+)`", tour))
    words = {w.removesuffix(".py") for n in named for w in re.split(r"[/\s,]+", n)}
    missing = [str(p.relative_to(ROOT)) for p in modules() if p.stem not in words]
    assert not missing, f"docs/TOUR.md does not name: {missing}"


@pytest.mark.parametrize("folder", FOLDERS)
def test_the_readme_layout_names_every_folder(folder: str) -> None:
    readme = (ROOT / "README.md").read_text()
    layout = readme[readme.index("## Layout"):readme.index("## The event contract")]
    assert f"`{folder}/`" in layout
