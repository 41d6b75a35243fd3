"""The `trajbus` command line. Each package contributes its commands through `register()`.

Run `trajbus COMMAND --help` for what each command does and which settings it reads.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import re
import sys
from collections.abc import Sequence

# Modules that add subcommands; a module that is missing (a feature not built yet) is skipped.
COMMAND_MODULES = (
    "trajbus.infra.cli",
    "trajbus.bus.cli",
    "trajbus.producers.cli",
    "trajbus.consumers.engine.cli",
    "trajbus.archive.cli",
    "trajbus.consumers.operator.cli",
    "trajbus.consumers.operator.inspect_cli",
    "trajbus.consumers.whatif.cli",
    "trajbus.demo",
)

# The module that registers each command: `trajbus COMMAND ...` imports only that one (a start
# of the CLI is ~0.3 s of CPU, half of it in importing every command's module). `trajbus
# --help`, a misspelt command and a command missing here import them all.
COMMAND_OWNERS = {
    "kafka": "trajbus.infra.cli",
    "config": "trajbus.bus.cli", "schemas": "trajbus.bus.cli", "topics": "trajbus.bus.cli",
    "simulate": "trajbus.producers.cli", "tail-traces": "trajbus.producers.cli",
    "replay": "trajbus.consumers.engine.cli", "worker": "trajbus.consumers.engine.cli",
    "archive": "trajbus.archive.cli",
    "scheduler": "trajbus.consumers.operator.cli", "status": "trajbus.consumers.operator.cli",
    "watchdog": "trajbus.consumers.operator.cli",
    "alerts": "trajbus.consumers.operator.inspect_cli",
    "consume": "trajbus.consumers.operator.inspect_cli",
    "deadletters": "trajbus.consumers.operator.inspect_cli",
    "whatif": "trajbus.consumers.whatif.cli",
    "demo": "trajbus.demo",
}

EPILOG = """\
configuration: every setting has a TRAJBUS_ environment variable; nested groups use '__',
e.g. TRAJBUS_KAFKA__BOOTSTRAP_SERVERS=10.0.0.5:9092, TRAJBUS_ARCHIVE__URL=s3://bucket/prefix.
The defaults are the reference configuration (see README.md).

start here:  trajbus kafka up     # a local single-node Kafka (KRaft) on 127.0.0.1:9092
             trajbus demo         # the whole pipeline on a simulated fleet
"""


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The whole command line; with a known ``command``, only the commands of the module that
    registers it."""
    parser = argparse.ArgumentParser(
        prog="trajbus",
        description="trajbus: the trajectory data bus for agentic-RL sandbox fleets. "
        "Sandbox events go to Kafka as Avro; processors derive ordered replay for trainers, "
        "watchdog alerts and scheduling decisions; an archiver writes Parquet.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=_version())
    parser.add_argument("--debug", action="store_true", default=bool(os.environ.get(
        "TRAJBUS_DEBUG")), help="show the Python traceback of an error instead of a one-line "
        "message, and the Kafka client's log (also TRAJBUS_DEBUG=1)")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    owner = COMMAND_OWNERS.get(command or "")
    for name in COMMAND_MODULES if owner is None else (owner,):
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


# Commands whose Kafka client log is noise for the person at the terminal: they report what
# went wrong themselves ("Kafka at ... did not answer", "no replay topic for task ..."). The
# long-running services (worker, archive run, simulate, tail-traces, demo) keep the client's log.
QUIET_CLIENT_LOG = frozenset({"topics", "replay", "status", "scheduler", "watchdog", "consume",
                              "deadletters", "alerts", "whatif"})
EXIT_BROKEN_PIPE = 141  # what a shell reports for a tool killed by SIGPIPE (`... | head`)


# Options that take a time, which may be written relative to now with a leading '-' (-1h).
TIME_OPTIONS = frozenset({"--from", "--to", "--since"})
_RELATIVE_TIME = re.compile(r"^-\d+(\.\d+)?(ms|s|m|h|d|w)$")


def join_relative_times(argv: Sequence[str]) -> list[str]:
    """``--from -1h`` -> ``--from=-1h``: argparse would take ``-1h`` for an option."""
    out: list[str] = []
    for arg in argv:
        if out and out[-1] in TIME_OPTIONS and _RELATIVE_TIME.match(arg):
            out[-1] = f"{out[-1]}={arg}"
        else:
            out.append(arg)
    return out


def command_word(argv: Sequence[str]) -> str | None:
    """The command ``argv`` runs: its first word that is not an option (the top-level options
    take no value). None when the top-level help is asked for before it (``trajbus -h status``
    lists every command)."""
    for arg in argv:
        if arg == "-h" or (len(arg) >= 3 and "--help".startswith(arg)):
            return None
        if not arg.startswith("-"):
            return arg
    return None


def main(argv: Sequence[str] | None = None) -> None:
    argv = join_relative_times(sys.argv[1:] if argv is None else argv)
    parser = build_parser(command_word(argv))
    args = parser.parse_args(argv)
    func = getattr(args, "func", None)
    if func is None:
        # `trajbus kafka` without a subcommand: show that command's help.
        target = getattr(args, "help_parser", parser)
        target.print_help()
        sys.exit(2)
    if args.command in QUIET_CLIENT_LOG and not args.debug:
        logging.getLogger("aiokafka").setLevel(logging.CRITICAL)
    elif not args.debug and logging.lastResort is not None:
        # Long-running commands without a log set-up of their own (archive run, simulate,
        # tail-traces) print the client's warnings through Python's last-resort handler:
        # during a broker outage, hundreds a second. Each kind once per 30 s (bus/logs.py).
        from trajbus.bus.logs import RepeatLimiter

        if not any(isinstance(f, RepeatLimiter) for f in logging.lastResort.filters):
            logging.lastResort.addFilter(RepeatLimiter())
    try:
        code = func(args)
        sys.stdout.flush()  # a reader that went away shows here, not at interpreter exit
    except KeyboardInterrupt:
        code = 130
    except BrokenPipeError:
        code = _broken_pipe()
    except Exception as exc:  # a clear one-line error instead of a traceback for known failures
        message = user_error_message(exc)
        if args.debug or message is None:
            raise
        try:
            sys.stdout.flush()
        except BrokenPipeError:
            _broken_pipe()
        print(f"trajbus: error: {message}", file=sys.stderr)
        code = getattr(exc, "exit_code", 1)
    sys.exit(code or 0)


def _broken_pipe() -> int:
    """The reader of our output went away (``trajbus consume ... | head``): stop quietly.
    Point stdout at /dev/null so the interpreter's final flush does not fail again."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):
        pass
    return EXIT_BROKEN_PIPE


def user_error_message(exc: BaseException) -> str | None:
    """The message to print for an error the user can act on (a mistake in the request, an
    unreachable or refusing broker, a missing file), or None for a bug (shown as a
    traceback)."""
    from aiokafka.errors import KafkaConnectionError, KafkaError

    from trajbus.bus.errors import UserError
    from trajbus.bus.kafka import BrokerUnavailableError
    from trajbus.infra.broker import BrokerError, KafkaSetupError

    if isinstance(exc, UserError | BrokerUnavailableError | BrokerError | KafkaSetupError):
        return str(exc)
    if isinstance(exc, KafkaConnectionError):
        from trajbus.bus.settings import get_settings

        return (f"cannot reach Kafka at {get_settings().kafka.bootstrap_servers} ({exc}). "
                "Start the local broker with `trajbus kafka up`, or point "
                "TRAJBUS_KAFKA__BOOTSTRAP_SERVERS at a running cluster.")
    if isinstance(exc, KafkaError):
        return f"Kafka answered with an error: {type(exc).__name__}: {exc}"
    duckdb = sys.modules.get("duckdb")  # the archive's SQL engine, when a command loaded it
    if duckdb is not None and isinstance(exc, duckdb.Error):
        return f"DuckDB: {exc}"
    if isinstance(exc, OSError) and exc.filename is not None:
        return f"{exc.strerror or exc}: {exc.filename}"
    if isinstance(exc, ValueError | FileNotFoundError | PermissionError | NotImplementedError
                  | TimeoutError):
        return str(exc) or type(exc).__name__
    return None


if __name__ == "__main__":
    main()
