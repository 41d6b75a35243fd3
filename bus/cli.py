"""CLI: `trajbus topics ...`, `trajbus schemas ...`, `trajbus config`."""

from __future__ import annotations

import argparse
import asyncio
import json

from trajbus.bus.settings import Settings, get_settings
from trajbus.bus.topics import Topics


def register(sub: argparse._SubParsersAction) -> None:
    topics = sub.add_parser(
        "topics",
        help="create or list trajbus's Kafka topics",
        description="Manage the topic catalog (names, partitions, retention, compaction, "
        "max message bytes). Creation is idempotent: existing topics are left alone.",
    )
    tsub = topics.add_subparsers(dest="topics_command", metavar="ACTION")
    topics.set_defaults(help_parser=topics)
    create = tsub.add_parser(
        "create",
        help="create missing topics (idempotent)",
        description="Create every catalog topic that is missing, plus replay topics for the "
        "given tasks, and register the bundled Avro schemas on the schema topic.",
    )
    create.add_argument("--task", action="append", default=[], metavar="T",
                        help="also create the replay topic trajbus.replay.T (repeatable)")
    create.set_defaults(func=_topics_create)
    lst = tsub.add_parser("list", help="print the catalog with each topic's settings")
    lst.set_defaults(func=_topics_list)

    schemas = sub.add_parser(
        "schemas",
        help="list the Avro event schemas and their fingerprints",
        description="The Avro schemas in schemas/avro are the contract. Lists each schema's "
        "full name and CRC-64-AVRO fingerprint (the 8 bytes after C3 01 on the wire).",
    )
    schemas.set_defaults(func=_schemas_list)

    config = sub.add_parser(
        "config",
        help="print the effective settings (defaults + TRAJBUS_ environment)",
        description="Print the effective configuration as JSON; secrets are masked.",
    )
    config.set_defaults(func=_config)


def _topics_create(args: argparse.Namespace) -> int:
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
    settings = get_settings()
    print(f"{'topic':40} {'parts':>5} {'retention':>10} {'policy':>8}  key / purpose")
    for s in Topics(settings).specs:
        days = "forever" if s.retention_ms < 0 else f"{s.retention_ms / 86_400_000:g}d"
        policy = "compact" if s.compacted else "delete"
        print(f"{s.name:40} {s.partitions:>5} {days:>10} {policy:>8}  {s.key}: {s.doc}")
    print(f"{Topics(settings).replay('<task>'):40} {settings.topics.partitions:>5} "
          f"{'7d':>10} {'delete':>8}  episode: ordered replay segments per task")
    return 0


def _schemas_list(args: argparse.Namespace) -> int:
    from trajbus.schemas.registry import default_registry

    reg = default_registry()
    for name in reg.names:
        print(f"{reg.reader(name).fingerprint.hex()}  {name}")
    return 0


def _config(args: argparse.Namespace) -> int:
    data = Settings().model_dump(mode="json")
    if data["kafka"].get("sasl_password"):
        data["kafka"]["sasl_password"] = "***"
    print(json.dumps(data, indent=2))
    return 0
