"""The `trajbus` command line. Each package contributes its commands through `register()`.

Run `trajbus COMMAND --help` for what each command does and which settings it reads.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

# Modules that add subcommands; a module that is missing (a feature not built yet) is skipped.
COMMAND_MODULES = (
    "trajbus.infra.cli",
    "trajbus.bus.cli",
    "trajbus.producers.cli",
    "trajbus.consumers.cli",
    "trajbus.archive.cli",
    "trajbus.consumers.operator_cli",
    "trajbus.demo",
)

EPILOG = """\
configuration: every setting has a TRAJBUS_ environment variable; nested groups use '__',
e.g. TRAJBUS_KAFKA__BOOTSTRAP_SERVERS=10.0.0.5:9092, TRAJBUS_ARCHIVE__URL=s3://bucket/prefix.
The defaults are the reference configuration (see README.md).

start here:  trajbus kafka up     # a local single-node Kafka (KRaft) on 127.0.0.1:9092
             trajbus demo         # the whole pipeline on a simulated fleet
"""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="trajbus",
        description="trajbus: the trajectory data bus for agentic-RL sandbox fleets. "
        "Sandbox events go to Kafka as Avro; processors derive ordered replay for trainers, "
        "watchdog alerts and scheduling decisions; an archiver writes Parquet.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=_version())
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMAND_MODULES:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as exc:
            if exc.name == name:
                continue
            raise
        module.register(sub)
    return parser


def _version() -> str:
    from trajbus import __version__

    return f"trajbus {__version__}"


def main(argv: Sequence[str] | None = None) -> None:
    parser = build_parser()
    args = parser.parse_args(argv)
    func = getattr(args, "func", None)
    if func is None:
        # `trajbus kafka` without a subcommand: show that command's help.
        target = getattr(args, "help_parser", parser)
        target.print_help()
        sys.exit(2)
    try:
        code = func(args)
    except KeyboardInterrupt:
        code = 130
    except Exception as exc:  # a clear one-line error instead of a traceback for known failures
        if getattr(args, "debug", False) or not _is_user_error(exc):
            raise
        print(f"trajbus: error: {exc}", file=sys.stderr)
        code = 1
    sys.exit(code or 0)


def _is_user_error(exc: Exception) -> bool:
    from trajbus.bus.kafka import BrokerUnavailableError

    user_errors = BrokerUnavailableError | FileNotFoundError | PermissionError | ValueError
    return isinstance(exc, user_errors)


if __name__ == "__main__":
    main()
