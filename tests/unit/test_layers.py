"""The package's import graph is declared here and held by these tests.

Layers depend one way: ``schemas`` (the contract) <- ``bus`` (Kafka, settings, topics) <- the
roles (``producers``, ``consumers``, ``archive``) <- ``trajbus`` (the public API, the CLI and
the demos, which compose the roles). A role imports no other role: in particular producers
never import consumers. The pure cores import only the contract, the settings and other pure
modules: never a Kafka client (not even through what they import), the wall clock or a
random source. Every import counts, at module level or inside a function (a lazy import is
still an arrow in the design), absolute or relative. The arrows that break these rules today
are listed in :data:`ALLOWED_EXCEPTIONS`, each with its reason; an exception no longer needed
fails the test until it is removed from the list.
"""

from __future__ import annotations

import ast
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

#: Where each top-level folder is installed (pyproject's package-dir).
FOLDERS = {
    "trajbus": "trajbus",
    "schemas": "trajbus.schemas",
    "bus": "trajbus.bus",
    "infra": "trajbus.infra",
    "producers": "trajbus.producers",
    "consumers": "trajbus.consumers",
    "archive": "trajbus.archive",
}

#: The declared graph: each layer, and the other layers its modules may import (a module may
#: always import its own layer). A module belongs to the longest layer name that prefixes it.
ALLOWED: dict[str, frozenset[str]] = {
    "trajbus.schemas": frozenset(),
    "trajbus.bus": frozenset({"trajbus.schemas"}),
    "trajbus.infra": frozenset({"trajbus.bus", "trajbus.schemas"}),
    "trajbus.producers": frozenset({"trajbus.bus", "trajbus.schemas"}),
    "trajbus.consumers": frozenset({"trajbus.bus", "trajbus.schemas"}),
    "trajbus.archive": frozenset({"trajbus.bus", "trajbus.schemas"}),
    # the top: the public API, the CLI and the demos compose the roles
    "trajbus": frozenset({"trajbus.schemas", "trajbus.bus", "trajbus.infra",
                          "trajbus.producers", "trajbus.consumers", "trajbus.archive"}),
}

#: The pure cores: deterministic state machines ``(state, event) -> (state, outputs)``.
PURE = (
    "trajbus.consumers.scheduler",  # the core and its rooms, placement
    "trajbus.consumers.replay.core",  # the façade
    "trajbus.consumers.replay.reorder",  # its rooms
    "trajbus.consumers.watchdog.core",  # the façade
    "trajbus.consumers.watchdog.detector",  # its rooms
    "trajbus.consumers.watchdog.canonical",
    "trajbus.consumers.outputs",  # the outputs the cores share
    "trajbus.archive.core",
)
#: What a pure core may import from trajbus: the contract, plain settings and helpers, other
#: pure cores.
PURE_MAY_IMPORT = ("trajbus.schemas", "trajbus.bus.settings", "trajbus.bus.errors",
                   "trajbus.bus.digest", *PURE)
#: What a pure core never imports: a Kafka client (directly or through a trajbus module it
#: imports), the wall clock, a random source.
KAFKA_CLIENTS = ("aiokafka", "kafka", "confluent_kafka")
NOT_PURE = (*KAFKA_CLIENTS, "time", "datetime", "random", "secrets")

#: Arrows that break the table today: (importing module, imported module) -> why it is there.
ALLOWED_EXCEPTIONS: dict[tuple[str, str], str] = {
    ("trajbus.producers.emitter_events", "trajbus.consumers.watchdog.canonical"):
        "the emitter validates tool calls with the watchdog's canonical form; it belongs in a "
        "lower layer both share",
    ("trajbus.producers.claimcheck", "trajbus.archive.storage"):
        "claim-check blobs are written through the archive's object store (local or S3)",
    ("trajbus.archive.rejects", "trajbus.consumers.operator.tools"):
        "the archiver reads the retained dead letters with the operators' bounded reader",
    ("trajbus.consumers.operator.reads", "trajbus.archive.rows"):
        "a sandbox's timeline from the archive turns archive rows back into records",
}


@dataclass(frozen=True)
class Arrow:
    module: str  # the importing module
    target: str  # the imported module (or package)
    line: int

    def __str__(self) -> str:
        return f"{self.module}:{self.line} imports {self.target}"


def module_name(path: Path) -> str:
    """The installed name of a source file (``consumers/engine/runner.py`` ->
    ``trajbus.consumers.engine.runner``)."""
    rel = path.relative_to(ROOT).with_suffix("")
    parts = [*FOLDERS[rel.parts[0]].split("."), *rel.parts[1:]]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def arrows(module: str, source: str, *, is_package: bool = False) -> Iterator[Arrow]:
    """Every import in ``source`` (the text of ``module``), wherever it is in the file;
    relative imports resolved against the module's package."""
    package = module.split(".") if is_package else module.split(".")[:-1]
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield Arrow(module, alias.name, node.lineno)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[:len(package) - (node.level - 1)]
                target = ".".join([*base, *([node.module] if node.module else [])])
            else:
                target = node.module or ""
            yield Arrow(module, target, node.lineno)


def _within(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


def layer_of(name: str) -> str | None:
    """The layer ``name`` belongs to (the longest layer prefix), None outside trajbus."""
    found = [layer for layer in ALLOWED if _within(name, layer)]
    return max(found, key=len) if found else None


def _excepted(arrow: Arrow) -> bool:
    return any(arrow.module == m and _within(arrow.target, t) for m, t in ALLOWED_EXCEPTIONS)


def breaks_layers(arrow: Arrow) -> bool:
    """Whether an import crosses the layers against :data:`ALLOWED` (exceptions aside)."""
    src, dst = layer_of(arrow.module), layer_of(arrow.target)
    if src is None or dst is None or src == dst or dst in ALLOWED[src]:
        return False
    return not _excepted(arrow)


def is_pure(module: str) -> bool:
    return any(_within(module, p) for p in PURE)


def breaks_purity(arrow: Arrow) -> bool:
    """Whether a pure core's import is outside :data:`PURE_MAY_IMPORT` or in
    :data:`NOT_PURE`."""
    if not is_pure(arrow.module):
        return False
    if any(_within(arrow.target, bad) for bad in NOT_PURE):
        return True
    return _within(arrow.target, "trajbus") and not any(
        _within(arrow.target, ok) for ok in PURE_MAY_IMPORT)


def _sources() -> dict[str, tuple[Path, bool]]:
    found = {}
    for folder in FOLDERS:
        for path in sorted((ROOT / folder).rglob("*.py")):
            found[module_name(path)] = (path, path.name == "__init__.py")
    return found


SOURCES = _sources()


def _all_arrows() -> list[Arrow]:
    return [a for module, (path, pkg) in SOURCES.items()
            for a in arrows(module, path.read_text(), is_package=pkg)]


ARROWS = _all_arrows()


def _resolve(target: str) -> str | None:
    """The trajbus module an import target names (``trajbus.x.Name`` -> ``trajbus.x``)."""
    while target and target not in SOURCES:
        target = target.rpartition(".")[0]
    return target or None


def test_every_folder_is_seen() -> None:
    assert {"trajbus.bus.settings", "trajbus.consumers.engine.runner",
            "trajbus.consumers.scheduler.core", "trajbus.archive.core"} <= set(SOURCES)
    assert len(ARROWS) > 500


def test_imports_follow_the_declared_layers() -> None:
    wrong = [str(a) for a in ARROWS if breaks_layers(a)]
    assert not wrong, "imports against the layer table:\n" + "\n".join(wrong)


def test_producers_never_import_consumers() -> None:
    wrong = [str(a) for a in ARROWS if _within(a.module, "trajbus.producers")
             and _within(a.target, "trajbus.consumers") and not _excepted(a)]
    assert not wrong, "\n".join(wrong)


def test_pure_cores_import_no_client_no_clock_no_shell() -> None:
    wrong = [str(a) for a in ARROWS if breaks_purity(a)]
    assert not wrong, "a pure core imports what it must not:\n" + "\n".join(wrong)


def test_pure_cores_reach_no_kafka_client_through_what_they_import() -> None:
    edges: dict[str, set[str]] = {}
    for a in ARROWS:
        edges.setdefault(a.module, set()).add(a.target)
    for core in (m for m in SOURCES if is_pure(m)):
        seen, todo = set(), [core]
        while todo:
            module = todo.pop()
            if module in seen:
                continue
            seen.add(module)
            for target in edges.get(module, ()):
                assert not any(_within(target, c) for c in KAFKA_CLIENTS), \
                    f"{core} reaches {target} through {module}"
                inner = _resolve(target) if _within(target, "trajbus") else None
                if inner is not None:
                    todo.append(inner)


def test_every_exception_is_still_needed() -> None:
    used = {(m, t) for m, t in ALLOWED_EXCEPTIONS
            if any(a.module == m and _within(a.target, t) for a in ARROWS)}
    assert used == set(ALLOWED_EXCEPTIONS), \
        f"no longer imported, remove from ALLOWED_EXCEPTIONS: {set(ALLOWED_EXCEPTIONS) - used}"


#: The one module that builds Kafka clients (``AIOKafkaConsumer(...)`` and the like).
CLIENT_BUILDER = "trajbus.bus.clients"
CLIENT_CLASSES = frozenset({"AIOKafkaConsumer", "AIOKafkaProducer", "AIOKafkaAdminClient",
                            "ClusterAdminClient", "AIOKafkaClient", "Consumer", "Producer",
                            "AdminClient"})


def client_constructions(source: str) -> list[int]:
    """The lines of ``source`` that call a Kafka client's class (by name or attribute)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call):
            f = node.func
            name = f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) \
                else None
            if name in CLIENT_CLASSES:
                found.append(node.lineno)
    return found


def test_kafka_clients_are_built_only_in_bus_clients() -> None:
    wrong = [f"{module}:{line}" for module, (path, _) in SOURCES.items()
             if module != CLIENT_BUILDER
             for line in client_constructions(path.read_text())]
    assert not wrong, ("build Kafka clients with trajbus.bus.clients (new_consumer, "
                       "new_producer, new_admin):\n" + "\n".join(wrong))


def test_a_planted_client_construction_is_caught() -> None:
    planted = "import aiokafka\nc = aiokafka.AIOKafkaConsumer('t', bootstrap_servers='x')\n"
    assert client_constructions(planted) == [2]
    assert client_constructions("c = new_consumer(k, 't')\n") == []


@pytest.mark.parametrize(("module", "source", "rule"), [
    ("trajbus.producers.planted",
     "def f():\n    from trajbus.consumers.replay.client import ReplayClient\n",
     breaks_layers),
    ("trajbus.bus.planted", "from ..archive import storage\n", breaks_layers),
    ("trajbus.schemas.planted", "import trajbus.bus.kafka\n", breaks_layers),
    ("trajbus.archive.planted", "from trajbus.producers.sender import SharedSender\n",
     breaks_layers),
    ("trajbus.consumers.scheduler.planted", "import time\n", breaks_purity),
    ("trajbus.consumers.replay.core",
     "def f():\n    from aiokafka import AIOKafkaConsumer\n", breaks_purity),
    ("trajbus.consumers.watchdog.core", "from trajbus.bus.kafka import check_broker\n",
     breaks_purity),
    ("trajbus.consumers.scheduler.planted",
     "from trajbus.consumers.engine.runner import Runner\n", breaks_purity),
])
def test_a_planted_violation_is_caught(module: str, source: str,
                                       rule: Callable[[Arrow], bool]) -> None:
    found = list(arrows(module, source))
    assert found and all(rule(a) for a in found), [str(a) for a in found]


@pytest.mark.parametrize(("module", "source"), [
    ("trajbus.consumers.engine.planted", "from trajbus.bus.kafka import check_broker\n"),
    ("trajbus.consumers.scheduler.planted", "from . import placement\n"),
    ("trajbus.cli", "from trajbus.consumers.replay.client import ReplayClient\n"),
    ("trajbus.producers.emitter_events",
     "from trajbus.consumers.watchdog.canonical import x\n"),
])
def test_an_allowed_import_is_not_flagged(module: str, source: str) -> None:
    found = list(arrows(module, source))
    assert found and not any(breaks_layers(a) or breaks_purity(a) for a in found)
