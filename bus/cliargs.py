"""Building blocks for the ``trajbus`` commands' argument parsers, shared by every package
that registers commands (``bus``, ``infra``, ``archive``, ``consumers``).

A command is added with :func:`add_command`: its ``--help`` description is its handler's
docstring (or an explicit ``description``), its epilog the example command lines given, and
:class:`ParagraphFormatter` lays both out. The options several commands share are added by one
function each: :func:`add_target` (``--task``/``--sandbox``/``--episode`` naming what a command
acts on), :func:`add_filters` (repeatable ``--task``/``--sandbox``/``--episode`` narrowing a
listing), :func:`add_flags` (on/off options such as ``--json`` and ``--dry-run``).
:func:`add_actions` gives a command its own sub-commands (``trajbus topics list``), with the
command's help shown when none is named.
"""

from __future__ import annotations

import argparse
import inspect
import re
import textwrap
from collections.abc import Callable, Sequence

Handler = Callable[[argparse.Namespace], int]
Commands = argparse._SubParsersAction  # what ``add_subparsers()`` returns

_PARAGRAPH_BREAK = re.compile(r"\n[ \t]*\n")


class ParagraphFormatter(argparse.HelpFormatter):
    """Help text in paragraphs: blank lines separate paragraphs, each filled to the terminal's
    width; a line that starts with a space (an example, a layout line) is printed as written."""

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        out: list[str] = []
        for paragraph in _PARAGRAPH_BREAK.split(text.strip("\n")):
            if out:
                out.append("")
            prose: list[str] = []
            for line in paragraph.splitlines():
                if line.startswith((" ", "\t")):
                    out.extend(_fill(prose, width, indent))
                    prose = []
                    out.append(indent + line.rstrip())
                else:
                    prose.append(line)
            out.extend(_fill(prose, width, indent))
        return "\n".join(out)


def _fill(lines: list[str], width: int, indent: str) -> list[str]:
    text = " ".join(" ".join(lines).split())
    if not text:
        return []
    return textwrap.wrap(text, width, initial_indent=indent, subsequent_indent=indent)


def paragraphs(*texts: str) -> str:
    """Paragraphs of help text, for :class:`ParagraphFormatter`."""
    return "\n\n".join(texts)


def examples_epilog(*lines: str) -> str:
    """An epilog that lists example command lines (``examples:`` and one line each)."""
    return "\n".join(["examples:", *(f"  {line}" for line in lines)])


def add_command(sub: Commands, name: str, func: Handler | None = None, *, help: str,
                description: str | None = None, examples: Sequence[str] = (),
                key: str = "func") -> argparse.ArgumentParser:
    """Add the command ``name`` to ``sub`` and return its parser. ``args.<key>`` is set to
    ``func`` (the handler, called with the parsed arguments); the description shown by
    ``--help`` is ``description``, else the handler's docstring; ``examples`` become the
    epilog. Raises ValueError when there is neither a description nor a docstring."""
    text = description if description is not None else inspect.getdoc(func)
    if not text:
        raise ValueError(f"command {name!r}: no description and no handler docstring")
    p: argparse.ArgumentParser = sub.add_parser(
        name, help=help, description=text, formatter_class=ParagraphFormatter,
        epilog=examples_epilog(*examples) if examples else None)
    if func is not None:
        p.set_defaults(**{key: func})
    return p



def add_actions(parser: argparse.ArgumentParser, dest: str) -> Commands:
    """Sub-commands (``ACTION``) of the command ``parser``; the command named without one
    shows its help (``args.help_parser``; the CLI's ``main`` prints it)."""
    parser.set_defaults(help_parser=parser)
    return parser.add_subparsers(dest=dest, metavar="ACTION")


def add_target(p: argparse.ArgumentParser, *, task: str | None = None,
               episode: str | None = None, episode_required: bool = False) -> None:
    """``--sandbox`` (required), after ``--task`` (required) when ``task`` gives its help,
    before ``--episode`` when ``episode`` gives its help."""
    if task is not None:
        p.add_argument("--task", required=True, help=task)
    p.add_argument("--sandbox", required=True, help="sandbox id")
    if episode is not None:
        p.add_argument("--episode", required=episode_required, default=None, help=episode)


def add_filters(p: argparse.ArgumentParser, *names: str) -> None:
    """A repeatable ``--NAME`` for each name (task, sandbox, episode): only these, as a list
    (empty: all)."""
    for name in names:
        p.add_argument(f"--{name}", action="append", default=[],
                       help=f"only this {name} (repeatable)")


def add_flags(p: argparse.ArgumentParser, **helps: str) -> None:
    """An on/off option for each keyword, with its help text: ``dry_run=...`` adds
    ``--dry-run`` (``args.dry_run``, False unless given)."""
    for dest, text in helps.items():
        p.add_argument("--" + dest.replace("_", "-"), action="store_true", help=text)
