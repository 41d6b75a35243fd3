"""The code under test from other git refs: a ref exported and laid out as the installed
package (``export_ref``), its description, whether the working tree has changes, and the
``LABEL=REF[;ENV=VALUE...]`` variants the A/B benchmarks take (``parse_variant``,
``Variant``)."""

from __future__ import annotations

import io
import os
import subprocess
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def export_ref(ref: str) -> Path:
    """``git archive`` of ``ref`` laid out as the installed package (pyproject's package-dir:
    ``bus/`` -> ``trajbus/bus`` ...), in a temporary directory to put first on PYTHONPATH."""
    import shutil
    import tarfile
    import tomllib

    out = Path(tempfile.mkdtemp(prefix="bench-worker-ref-"))
    src, pkg = out / "src", out / "pkg"
    blob = subprocess.run(["git", "archive", "--format=tar", ref], cwd=ROOT, check=True,
                          capture_output=True).stdout
    with tarfile.open(fileobj=io.BytesIO(blob)) as tar:
        tar.extractall(src, filter="data")
    dirs = tomllib.loads((src / "pyproject.toml").read_text())["tool"]["setuptools"][
        "package-dir"]
    for name, folder in sorted(dirs.items()):
        shutil.copytree(src / folder, pkg / name.replace(".", "/"), dirs_exist_ok=True)
    return pkg


def git_describe(ref: str) -> str:
    got = subprocess.run(["git", "log", "-1", "--format=%h %cd", "--date=iso", ref], cwd=ROOT,
                         capture_output=True, text=True)
    return got.stdout.strip() or ref


def git_dirty() -> bool:
    got = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no", "--",
                          "consumers", "bus", "schemas", "trajbus"], cwd=ROOT,
                         capture_output=True, text=True)
    return bool(got.stdout.strip())


def parse_variant(spec: str) -> tuple[str, str, dict[str, str]]:
    """``LABEL=REF[;ENV=VALUE...]`` -> (label, ref, env)."""
    label, _, rest = spec.partition("=")
    ref, *envs = (rest or ".").split(";")
    if not label or not ref or any("=" not in e for e in envs if e):
        raise SystemExit(f"--variant {spec!r}: expected LABEL=REF[;ENV=VALUE...]")
    return label, ref, dict(e.split("=", 1) for e in envs if e)


@dataclass
class Variant:
    """``--variant LABEL=REF[;ENV=VALUE...]``: the worker and the emitters' process run the
    code of git REF ('.' = this tree) with these extra environment variables (settings such
    as ``TRAJBUS_PRODUCER__SEND_ROUND_MS``). The trainer side is this process's code."""

    label: str
    ref: str = "."
    env: dict[str, str] = field(default_factory=dict)
    tree: Path | None = None  # the exported ref (export_ref), None for '.'

    @classmethod
    def parse(cls, spec: str) -> Variant:
        """REF may also be a directory laid out as the installed package (as export_ref
        makes it: <dir>/trajbus/bus, ...), used as it is."""
        label, ref, env = parse_variant(spec)
        tree = Path(ref) if ref != "." and (Path(ref) / "trajbus").is_dir() else None
        return cls(label, ref, env, tree)

    def process_env(self) -> tuple[dict[str, str], Path]:
        """Environment and working directory of a subprocess running this variant."""
        env = {**os.environ, **self.env}
        if self.tree is None:
            return env, ROOT
        env["PYTHONPATH"] = os.pathsep.join([str(self.tree)] + (
            [self.env["PYTHONPATH"]] if "PYTHONPATH" in self.env else []))
        env["BENCH_E2E_TREE"] = "1"
        return env, self.tree
