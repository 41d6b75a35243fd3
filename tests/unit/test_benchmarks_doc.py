"""BENCHMARKS.md is the targets and an index: every link it holds leads somewhere, and it is
what `bench/run_all.py --render` makes of bench/results/all.json and bench/ANALYSIS.md."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _anchors(markdown: str) -> set[str]:
    sys.path.insert(0, str(ROOT / "bench"))
    try:
        from run_all import _anchor
    finally:
        sys.path.pop(0)
    return {_anchor(m) for m in re.findall(r"^#+ (.+)$", markdown, flags=re.M)}


def test_every_link_in_benchmarks_md_leads_to_a_file_and_a_heading() -> None:
    text = (ROOT / "BENCHMARKS.md").read_text()
    links = re.findall(r"\]\(([^)#]+)(?:#([^)]+))?\)", text)
    assert len(links) > 20, links
    for path, anchor in links:
        target = ROOT / path
        assert target.is_file(), f"BENCHMARKS.md links to {path}, which does not exist"
        if anchor:
            assert anchor in _anchors(target.read_text()), f"no heading #{anchor} in {path}"
    analysis = (ROOT / "bench" / "ANALYSIS.md").read_text()
    headings = re.findall(r"^## (.+)$", analysis, flags=re.M)
    assert all(f"[{h}]" in text for h in headings), "a section of ANALYSIS.md is not listed"


def test_benchmarks_md_is_what_the_render_makes(tmp_path: Path) -> None:
    out = tmp_path / "BENCHMARKS.md"
    subprocess.run([sys.executable, "run_all.py", "--render", "--out", str(out)],
                   cwd=ROOT / "bench", check=True, capture_output=True)
    assert out.read_text() == (ROOT / "BENCHMARKS.md").read_text(), (
        "BENCHMARKS.md differs from its render: run `python bench/run_all.py --render`")
