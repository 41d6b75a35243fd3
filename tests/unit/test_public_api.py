"""The public API: every name in ``trajbus.__all__`` imports from the top, is the same object
as at its deep path, and ``import trajbus`` alone loads none of it (the CLI starts fast)."""

from __future__ import annotations

import subprocess
import sys

import pytest

import trajbus


@pytest.mark.parametrize("name", [n for n in trajbus.__all__ if n != "__version__"])
def test_every_public_name_imports_from_the_top_and_is_the_deep_object(name: str) -> None:
    import importlib

    top = getattr(trajbus, name)
    deep = getattr(importlib.import_module(trajbus._EXPORTS[name]), name)
    assert top is deep
    assert name in dir(trajbus)


def test_all_lists_exactly_the_exports() -> None:
    assert set(trajbus.__all__) == {"__version__", *trajbus._EXPORTS}


def test_from_trajbus_import_names_a_trainer_uses() -> None:
    from trajbus import ReplayClient, SandboxEmitter, SyncReplayClient  # noqa: F401


def test_an_unknown_name_is_an_attribute_error() -> None:
    with pytest.raises(AttributeError, match="no attribute 'ReplayClinet'"):
        trajbus.ReplayClinet  # noqa: B018


def test_import_trajbus_loads_no_kafka_client() -> None:
    code = ("import sys, trajbus; "
            "print(sorted(m for m in sys.modules if m.startswith(('aiokafka', 'pyarrow', "
            "'trajbus.consumers'))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout.strip()
    assert out == "[]"
