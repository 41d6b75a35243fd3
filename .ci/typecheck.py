"""Type-check trajbus as one package, with every import between its modules resolved.

The distribution maps top-level folders into `trajbus` (pyproject's [tool.setuptools]
package-dir: `trajbus.bus` is `bus/`, ...), which mypy cannot follow from the checkout. This
keeps `build/mypy/trajbus/`, a tree of symlinks laid out as the installed package (each entry
of `trajbus/`, and `trajbus/<role>` -> `<role>/` for every other package-dir entry), runs mypy
on it with pyproject's [tool.mypy] settings (`mypy_path` names the tree), and prints mypy's
report with paths of the checked-out files (`bus/topics.py`, not the symlinked path).

Usage: `python .ci/typecheck.py [extra mypy arguments or files]`; exits with mypy's status.
`make lint` runs it with no arguments.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import sys
import tomllib
from pathlib import Path

from mypy import api

ROOT = Path(__file__).resolve().parent.parent
TREE = ROOT / "build" / "mypy"


def build_tree() -> Path:
    """Bring `build/mypy/trajbus` in line with pyproject's package-dir; return the tree's root.

    Only the links that differ are changed, so runs at the same time (pytest workers, an
    editor's mypy) never see the tree half built."""
    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    package_dir: dict[str, str] = setuptools["package-dir"]
    top = TREE / "trajbus"
    links = {entry.name: entry for entry in (ROOT / package_dir["trajbus"]).iterdir()
             if entry.name != "__pycache__"}
    for package, folder in package_dir.items():
        parent, _, name = package.rpartition(".")
        if package == "trajbus":
            continue
        if parent != "trajbus":
            raise SystemExit(f"typecheck: nested package-dir entry {package!r} is not handled")
        links[name] = ROOT / folder
    top.mkdir(parents=True, exist_ok=True)
    for link in top.iterdir():
        if link.name not in links:
            _remove(link)
    for name, source in links.items():
        link, target = top / name, os.path.relpath(source, top)
        if link.is_symlink() and os.readlink(link) == target:
            continue
        _remove(link)
        with contextlib.suppress(FileExistsError):  # made by a run at the same time
            link.symlink_to(target)
    return TREE


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


_PATH = re.compile(r"^(build/mypy/trajbus/\S+?\.pyi?)(?=:)", re.MULTILINE)


def real_paths(report: str) -> str:
    """Replace the symlinked paths at the start of mypy's lines by the checked-out files'."""
    return _PATH.sub(
        lambda m: os.path.relpath(os.path.realpath(ROOT / m.group(1)), ROOT), report)


def main(argv: list[str]) -> int:
    build_tree()
    os.chdir(ROOT)
    out, err, status = api.run(["--config-file", "pyproject.toml", *argv])
    sys.stdout.write(real_paths(out))
    sys.stderr.write(err)
    return status


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
