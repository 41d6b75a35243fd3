"""CLI: `trajbus topics ...`, `trajbus schemas ...`, `trajbus config`."""

from __future__ import annotations

import argparse
import asyncio
import json
from typing import Any

from trajbus.bus.cliargs import Commands, add_actions, add_command, add_flags
from trajbus.bus.settings import get_settings, mask_url_credentials, read_settings
from trajbus.bus.topics import Topics


def register(sub: Commands) -> None:
    topics = add_command(
        sub, "topics", help="create or list trajbus's Kafka topics",
        description="Manage the topic catalog (names, partitions, retention, compaction, "
        "max message bytes). Creation is idempotent: existing topics are left alone.")
    tsub = add_actions(topics, "topics_command")
    create = add_command(tsub, "create", _topics_create,
                         help="create missing topics (idempotent)")
    create.add_argument("--task", action="append", default=[], metavar="T",
                        help="also create the replay topic trajbus.replay.T (repeatable)")
    lst = add_command(tsub, "list", _topics_list,
                      help="the topics on the broker: catalog, replay (per task), debug, state")
    add_flags(lst, json="one JSON object per topic")
    delete = add_command(tsub, "delete", _topics_delete,
                         help="delete debug replay topics made by `trajbus replay republish`",
                         examples=("trajbus topics delete debug-web-shop",
                                   "trajbus topics delete trajbus.replay.debug-web-shop",
                                   "trajbus topics delete --all-debug"))
    delete.add_argument("names", nargs="*", metavar="TOPIC",
                        help="a debug topic's full name, or its task (debug-T, or T)")
    add_flags(delete, all_debug="delete every debug replay topic under the prefix")

    schemas = add_command(sub, "schemas", _schemas_list,
                          help="the Avro event schemas: list them, show one kind's fields",
                          examples=("trajbus schemas", "trajbus schemas show LivenessProbe",
                                    "trajbus schemas show trajbus.derived.SchedulingDecision "
                                    "--json"))
    ssub = schemas.add_subparsers(dest="schemas_command", metavar="ACTION")
    add_command(ssub, "list", _schemas_list,
                help="each schema's full name and fingerprint (the default)",
                description="Each bundled schema's full name and CRC-64-AVRO fingerprint, one "
                "per line.")
    show = add_command(ssub, "show", _schemas_show,
                       help="the fields of one event kind: name, type, default, doc",
                       examples=("trajbus schemas show TraceChunk",
                                 "trajbus schemas show watchdogalert --json"))
    show.add_argument("kind", metavar="KIND", help="event kind, e.g. LivenessProbe "
                      "(`trajbus schemas` lists them)")
    add_flags(show, json="print the schema's JSON document (the envelope inlined) instead of a "
              "table")

    add_command(sub, "config", _config,
                help="print the effective settings (defaults + TRAJBUS_ environment)")


def _topics_create(args: argparse.Namespace) -> int:
    """Create every catalog topic that is missing, plus replay topics for the given tasks, and
    register the bundled Avro schemas on the schema topic."""
    from trajbus.bus.admin import ensure_base_topics, register_schemas
    from trajbus.bus.kafka import check_broker
    from trajbus.bus.producer import close_producer

    settings = get_settings()

    async def run() -> tuple[list[str], list[str], int]:
        await check_broker(settings.kafka)
        created, present = await ensure_base_topics(settings, args.task)
        try:
            n = await register_schemas(settings)
        finally:
            await close_producer()
        return created, present, n

    created, present, n = asyncio.run(run())
    for name in created:
        print(f"created  {name}")
    for name in present:
        print(f"exists   {name}")
    print(f"registered {n} schemas on {Topics(settings).schemas}")
    return 0


def _topics_list(args: argparse.Namespace) -> int:
    """Ask the broker which topics exist under the prefix (TRAJBUS_TOPICS__PREFIX) and print
    each with its partitions, retained offsets and what it is for; catalog topics that are
    missing are listed too (create them with `trajbus topics create`). Offsets include
    transaction markers, so on transactional topics they slightly exceed the record count."""
    from trajbus.bus.inventory import trajbus_topics
    from trajbus.bus.kafka import check_broker

    settings = get_settings()

    async def run() -> list[Any]:
        await check_broker(settings.kafka)
        return await trajbus_topics(settings)

    infos = asyncio.run(run())
    have = {i.name for i in infos}
    missing = [s.name for s in Topics(settings).specs if s.name not in have]
    if args.json:
        for i in infos:
            print(json.dumps({"topic": i.name, "partitions": i.partitions, "offsets": i.offsets,
                              "role": i.role, "task": i.task, "purpose": i.purpose}))
        for name in missing:
            print(json.dumps({"topic": name, "role": "catalog", "missing": True}))
        return 0
    print(f"topics on {settings.kafka.bootstrap_servers} under prefix "
          f"{settings.topics.prefix!r}:")
    width = max([len(n) for n in have | set(missing)] + [20])
    print(f"{'topic':{width}} {'parts':>5} {'offsets':>9}  {'role':<8} purpose")
    order = {"catalog": 0, "replay": 1, "debug": 2, "state": 3, "clock": 4, "other": 5}
    for i in sorted(infos, key=lambda i: (order.get(i.role, 9), i.name)):
        print(f"{i.name:{width}} {i.partitions:>5} {i.offsets:>9}  {i.role:<8} {i.purpose}")
    for name in missing:
        print(f"{name:{width}} {'-':>5} {'-':>9}  {'MISSING':<8} create it with `trajbus "
              "topics create`")
    tasks = sorted(i.task for i in infos if i.role == "replay" and i.task)
    print(f"tasks with a replay topic: {', '.join(tasks) if tasks else 'none yet'}")
    return 0


def _topics_delete(args: argparse.Namespace) -> int:
    """Delete debug replay topics (<prefix>.replay.debug-TASK). Any other topic is refused:
    catalog, replay and state topics hold the pipeline's data."""
    from trajbus.bus.errors import UserError
    from trajbus.bus.inventory import delete_debug_topics, trajbus_topics
    from trajbus.bus.kafka import check_broker

    settings = get_settings()
    if not args.names and not args.all_debug:
        raise UserError("name the debug topics to delete, or pass --all-debug",
                        hint="`trajbus topics list` shows them (role 'debug')")

    async def run() -> list[str]:
        await check_broker(settings.kafka)
        names = list(args.names)
        if args.all_debug:
            names += [i.name for i in await trajbus_topics(settings) if i.role == "debug"]
        return await delete_debug_topics(settings, list(dict.fromkeys(names)))

    deleted = asyncio.run(run())
    for name in deleted:
        print(f"deleted  {name}")
    if not deleted:
        print("no debug topics to delete")
    return 0


def _schemas_list(args: argparse.Namespace) -> int:
    """The Avro schemas in schemas/avro are the contract. Without an action, lists each
    schema's full name and CRC-64-AVRO fingerprint (the 8 bytes after C3 01 on the wire);
    `schemas show KIND` prints the fields of one kind."""
    from trajbus.schemas.registry import default_registry

    reg = default_registry()
    for name in reg.names:
        print(f"{reg.reader(name).fingerprint.hex()}  {name}")
    return 0


def _schemas_show(args: argparse.Namespace) -> int:
    """Print the Avro fields of one event kind: name, type, default (blank: required) and doc;
    the envelope's fields as header.*. KIND is the short name (LivenessProbe,
    case-insensitive) or the full name (trajbus.events.LivenessProbe); an unknown kind is an
    error listing the kinds. How the fields become archive columns: archive/README.md
    (Columns)."""
    from trajbus.bus.errors import NotFoundError
    from trajbus.schemas.registry import default_registry, describe_fields

    reg = default_registry()
    by_name = {n.lower(): n for n in reg.names}
    by_name.update({n.rsplit(".", 1)[-1].lower(): n for n in reg.names})
    full = by_name.get(args.kind.lower())
    if full is None:
        kinds = ", ".join(sorted(n.rsplit(".", 1)[-1] for n in reg.names))
        raise NotFoundError(f"unknown event kind {args.kind!r}; kinds: {kinds}",
                            hint="`trajbus schemas` lists them with their full names")
    schema = reg.definition(full)
    if args.json:
        print(json.dumps(schema, indent=2))
        return 0
    print(f"{full}  fingerprint {reg.reader(full).fingerprint.hex()}")
    if schema.get("doc"):
        print(schema["doc"])
    rows = [("field", "type", "default", "doc"), *describe_fields(schema)]
    widths = [max(len(r[i]) for r in rows) for i in range(3)]
    print()
    for r in rows:
        line = "  ".join(c.ljust(w) for c, w in zip(r[:3], widths, strict=True))
        print(f"{line}  {r[3]}".rstrip())
    return 0


def _config(args: argparse.Namespace) -> int:
    """Print the effective configuration as JSON; secrets are masked."""
    data = read_settings().model_dump(mode="json")
    if data["kafka"].get("sasl_password"):
        data["kafka"]["sasl_password"] = "***"
    print(json.dumps(_masked(data), indent=2))
    return 0


def _masked(value: Any) -> Any:
    """Settings as printed: a URL's user-info (``s3://key:secret@...``) shown as ``***@``."""
    if isinstance(value, str):
        return mask_url_credentials(value)
    if isinstance(value, dict):
        return {k: _masked(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_masked(v) for v in value]
    return value
