"""No Python traceback for a user's mistake, in any command (issue 16, item 6).

The commands are enumerated from the argparse tree of ``trajbus --help``, so a command added
later is covered without touching this file. Every command

* documents every option (``--help`` text on each);
* answers a wrong argument (an unknown option, a value of the wrong type, a choice that does
  not exist) with a usage error, exit status 2;
* with the broker down (``TRAJBUS_KAFKA__BOOTSTRAP_SERVERS`` pointing at a closed port) either
  works without Kafka or exits non-zero naming the address it could not reach;

and never prints a traceback, "Unclosed AIOKafka..." or "Exception ignored" while doing so.
The mistakes operators made against a real broker are in tests/kafka/test_cli_hygiene_broker.py.
"""

from __future__ import annotations

import argparse
import importlib
import os
import subprocess
import sys
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest
from support import REPO

from trajbus.cli import (
    COMMAND_MODULES,
    COMMAND_OWNERS,
    EXIT_BROKEN_PIPE,
    build_parser,
    command_word,
    main,
)
from trajbus.infra.broker import free_port

NOISE = ("Traceback (most recent call last)", "Unclosed AIOKafka", "Exception ignored",
         "Task exception was never retrieved", "Task was destroyed")

# Commands that do not use the configured Kafka: with it down they still work (or fail for
# their own reason, cleanly). Any other command must say it could not reach Kafka.
OFFLINE = {
    ("kafka", "up"), ("kafka", "down"), ("kafka", "status"), ("kafka", "jars"),  # local broker
    # the local cluster's drills (no cluster there: they say so)
    ("kafka", "kill-node"), ("kafka", "stop-node"), ("kafka", "start-node"),
    ("kafka", "pause-node"), ("kafka", "resume-node"),
    ("schemas",), ("schemas", "list"), ("schemas", "show"), ("config",),
    ("archive", "episode"), ("archive", "episodes"), ("archive", "sql"), ("archive", "compact"),
    ("archive", "retention"), ("archive", "context"), ("archive", "files"),
}

# A valid value for a required argument, by its dest (anything else gets "x").
PLACEHOLDERS = {"sandbox": "sb-none", "task": "no-such-task", "episode": "ep-none",
                "query": "SELECT 1", "topic": "sandbox.events", "names": "debug-none",
                "ids": "0123456789abcdef", "id": "0123456789abcdef", "node": "1"}


@dataclass(frozen=True)
class Leaf:
    path: tuple[str, ...]
    parser: argparse.ArgumentParser

    @property
    def name(self) -> str:
        return " ".join(self.path)

    def options(self) -> Iterator[argparse.Action]:
        for a in self.parser._actions:
            if not isinstance(a, argparse._HelpAction | argparse._VersionAction
                              | argparse._SubParsersAction):
                yield a

    def valid_argv(self, tmp: Path) -> list[str]:
        """The command with a plausible value for every required argument."""
        argv = list(self.path)
        # one of each required group of alternatives (e.g. --task T | --all-tasks)
        chosen = {g._group_actions[0] for g in self.parser._mutually_exclusive_groups
                  if g.required}
        for a in self.options():
            if not a.option_strings:  # positional
                if a.nargs != "?":
                    argv.append(self._value(a, tmp))
            elif a.required or a in chosen:
                argv.append(a.option_strings[0])
                if a.nargs != 0:
                    argv.append(self._value(a, tmp))
        return argv

    @staticmethod
    def _value(a: argparse.Action, tmp: Path) -> str:
        if a.choices:
            return str(next(iter(a.choices)))
        if a.dest == "out":
            return str(tmp / "report.html")
        if a.dest == "dir":
            (tmp / "traces").mkdir(exist_ok=True)
            return str(tmp / "traces")
        return PLACEHOLDERS.get(a.dest, "x")


def leaves() -> list[Leaf]:
    """Every runnable command of ``trajbus``, from the argparse tree."""
    out: list[Leaf] = []

    def walk(p: argparse.ArgumentParser, path: tuple[str, ...]) -> None:
        subs = [a for a in p._actions if isinstance(a, argparse._SubParsersAction)]
        runnable_alone = p.get_default("func") is not None and not any(s.required for s in subs)
        if path and (not subs or runnable_alone):  # e.g. `trajbus deadletters`
            out.append(Leaf(path, p))
        for s in subs:
            for name, child in s.choices.items():
                walk(child, (*path, name))

    walk(build_parser(), ())
    return out


LEAVES = leaves()


def test_the_walk_finds_the_commands_of_trajbus_help() -> None:
    names = {leaf.name for leaf in LEAVES}
    assert {"kafka up", "topics list", "topics delete", "replay tail", "replay republish",
            "archive sql", "archive run", "status", "worker", "simulate"} <= names
    assert len(names) >= 25


def test_each_command_is_built_from_the_module_that_registers_it() -> None:
    """`trajbus COMMAND` imports only COMMAND_OWNERS[COMMAND]: a command registered elsewhere
    would not be found, and one missing from the table would slow that command's start."""
    registered = {}
    for name in COMMAND_MODULES:
        sub = argparse.ArgumentParser().add_subparsers()
        importlib.import_module(name).register(sub)
        registered.update(dict.fromkeys(sub.choices, name))
    assert COMMAND_OWNERS == registered
    for command, owner in COMMAND_OWNERS.items():
        alone = build_parser(command)
        full = next(a for a in build_parser()._actions
                    if isinstance(a, argparse._SubParsersAction)).choices[command]
        mine = next(a for a in alone._actions
                    if isinstance(a, argparse._SubParsersAction)).choices
        assert set(mine) == {c for c, o in COMMAND_OWNERS.items() if o == owner}
        assert mine[command].format_help() == full.format_help()


@pytest.mark.parametrize("argv", [["-h", "status"], ["--debug", "--help", "kafka"],
                                  ["--he", "archive"], ["--help"]])
def test_the_top_level_help_lists_every_command_wherever_it_is_asked_for(
        argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 0
    listed = capsys.readouterr().out.split("COMMAND ...", 1)[1]
    assert all(command in listed for command in COMMAND_OWNERS), listed


def test_the_command_is_the_first_word_that_is_not_an_option() -> None:
    assert command_word(["--debug", "status", "--json"]) == "status"
    assert command_word(["archive", "sql", "--help"]) == "archive"
    assert command_word(["replay", "tail", "--from", "-1h"]) == "replay"
    assert command_word(["--version"]) is None and command_word([]) is None
    assert command_word(["--debug", "-h", "status"]) is None


@pytest.mark.parametrize("leaf", LEAVES, ids=lambda leaf: leaf.name)
def test_every_option_has_help_text(leaf: Leaf) -> None:
    undocumented = [a.option_strings or [a.dest] for a in leaf.options()
                    if a.help != argparse.SUPPRESS and not (a.help or "").strip()]
    assert undocumented == [], f"`trajbus {leaf.name}`: options without --help text"
    assert (leaf.parser.description or "").strip() or leaf.parser.format_help()
    with pytest.raises(SystemExit) as exit_:
        leaf.parser.parse_args(["--help"])
    assert exit_.value.code == 0


def _run_main(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    code = exit_.value.code
    return (code if isinstance(code, int) else 1), capsys.readouterr().err


@pytest.mark.parametrize("leaf", LEAVES, ids=lambda leaf: leaf.name)
def test_a_wrong_argument_is_a_usage_error(leaf: Leaf, tmp_path: Path,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    valid = leaf.valid_argv(tmp_path)
    wrong = [[*valid, "--no-such-option"]]
    for a in leaf.options():
        if not a.option_strings:
            continue
        if a.type in (int, float):
            wrong.append([*valid, a.option_strings[0], "not-a-number"])
        elif a.choices:
            wrong.append([*valid, a.option_strings[0], "no-such-choice"])
    for argv in wrong:
        code, err = _run_main(argv, capsys)
        assert code == 2, (argv, err)
        assert "usage:" in err and "error:" in err, (argv, err)
        assert not any(n in err for n in NOISE), (argv, err)


def _broker_down_env(tmp: Path, port: int) -> dict[str, str]:
    env = dict(os.environ)
    env.update({
        "TRAJBUS_KAFKA__BOOTSTRAP_SERVERS": f"127.0.0.1:{port}",
        "TRAJBUS_KAFKA__CONNECT_TIMEOUT_S": "3",
        "TRAJBUS_TOPICS__PREFIX": "hygiene",
        "TRAJBUS_ARCHIVE__URL": str(tmp / "archive"),
        "TRAJBUS_ARCHIVE__SPOOL_DIR": str(tmp / "spool"),
        "TRAJBUS_STATE_DIR": str(tmp / "state"),
        # `trajbus kafka ...` manages a local broker: give it one it cannot start
        "TRAJBUS_KAFKA_DATA_DIR": str(tmp / "kafka"),
        "TRAJBUS_KAFKA_PORT": str(port),
        "TRAJBUS_KAFKA_LIB_DIR": str(tmp / "no-jars"),
    })
    env.pop("TRAJBUS_DEBUG", None)
    (tmp / "no-jars").mkdir(exist_ok=True)
    return env


@pytest.mark.timeout(600)
def test_every_command_with_the_broker_down_says_so_without_a_traceback(tmp_path: Path) -> None:
    port = free_port()  # nothing listens there
    env = _broker_down_env(tmp_path, port)

    def run(leaf: Leaf) -> tuple[Leaf, list[str], subprocess.CompletedProcess[str]]:
        work = tmp_path / leaf.name.replace(" ", "-")
        work.mkdir()
        argv = leaf.valid_argv(work)
        proc = subprocess.run([sys.executable, "-m", "trajbus", *argv], env=env, cwd=work,
                              capture_output=True, text=True, timeout=120, check=False)
        return leaf, argv, proc

    with ThreadPoolExecutor(max_workers=3) as pool:
        results = list(pool.map(run, LEAVES))
    problems = []
    for leaf, argv, proc in results:
        out = proc.stdout + proc.stderr
        if any(n in out for n in NOISE):
            problems.append(f"`trajbus {' '.join(argv)}` printed a traceback:\n{out[-3000:]}")
        elif leaf.path in OFFLINE:
            if proc.returncode == 0 and "error" in proc.stderr.lower():
                problems.append(f"`trajbus {' '.join(argv)}` reported an error with exit 0:\n"
                                f"{proc.stderr[-2000:]}")
        elif proc.returncode == 0:
            problems.append(f"`trajbus {' '.join(argv)}` exited 0 with the broker down:\n"
                            f"{out[-2000:]}")
        elif f"127.0.0.1:{port}" not in proc.stderr:
            problems.append(f"`trajbus {' '.join(argv)}` failed without naming the broker "
                            f"address (rc {proc.returncode}):\n{proc.stderr[-2000:]}")
    assert problems == [], "\n\n".join(problems)


def test_a_reader_that_goes_away_stops_the_command_quietly() -> None:
    """``trajbus schemas | head -0``: the pipe is closed before the first line is written."""
    r, w = os.pipe()
    os.close(r)
    try:
        proc = subprocess.run([sys.executable, "-m", "trajbus", "schemas"], stdout=w,
                              stderr=subprocess.PIPE, text=True, timeout=60, cwd=REPO,
                              check=False)
    finally:
        os.close(w)
    assert proc.returncode == EXIT_BROKEN_PIPE, proc.stderr
    assert proc.stderr == ""
