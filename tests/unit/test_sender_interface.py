"""The shared sender reaches an emitter only through the named interface
:class:`~trajbus.producers.sending.SenderMember`, which the emitter implements. Pure: no
broker."""

from __future__ import annotations

import ast
from pathlib import Path

from trajbus.producers.emitter import SandboxEmitter
from trajbus.producers.sending import SenderMember

ROOT = Path(__file__).resolve().parents[2]


def _members(protocol: type) -> set[str]:
    names = set(getattr(protocol, "__annotations__", {}))
    names |= {n for n in vars(protocol) if not n.startswith("_")}
    return names


def test_the_sender_touches_no_private_attribute_of_another_object() -> None:
    tree = ast.parse((ROOT / "producers" / "sender.py").read_text())
    reach_ins = [
        f"line {node.lineno}: .{node.attr}" for node in ast.walk(tree)
        if isinstance(node, ast.Attribute) and node.attr.startswith("_")
        and not node.attr.startswith("__")
        and not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"))
    ]
    assert not reach_ins, reach_ins


def test_the_emitter_implements_every_member_of_the_interface() -> None:
    members = _members(SenderMember)
    assert {"sender_take", "sender_acked", "sender_producer", "settings"} <= members
    missing = {n for n in members if not hasattr(SandboxEmitter, n)
               and n not in SandboxEmitter.__init__.__code__.co_names
               and n not in ("settings", "last_error")}
    assert not missing, missing


def test_the_interface_is_documented() -> None:
    undocumented = [n for n, v in vars(SenderMember).items()
                    if not n.startswith("_") and callable(getattr(v, "fget", v))
                    and not (getattr(v, "__doc__", None) or "").strip()]
    assert not undocumented, undocumented
