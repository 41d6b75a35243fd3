"""``trajbus whatif``: re-run the processors over the log with changed rules and show what they
would have decided differently (a thin shell over :func:`trajbus.consumers.whatif.whatif`)."""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from pathlib import Path

from trajbus.bus.settings import get_settings

DESCRIPTION = """\
Re-run the watchdog and the scheduler over the past log in Kafka twice -- once with the
recorded rules (the settings as configured; this run must reproduce every recorded decision
and alert exactly: the self-check, printed first), once with the rules you change -- and show,
per sandbox, the decisions and alerts the changed rules add (+), remove (-) or move in time (~),
with seq, event time and, for loops, the time to detect; then the totals.

The cores run over the whole retained log (the scheduler is global, and a core's state at any
moment depends on everything before it); --task, --sandbox, --from and --to choose what the
self-check and the diff report. Nothing is written to Kafka.

rules: watchdog.<setting> and scheduler.<setting> (see --list-rules); a bare name works
when only one processor has it; *_ms rules also take 90s, 15m, 2h. A task's
watchdog.per_task overrides still win for that task (change them with --rules FILE).
"""

EPILOG = """\
examples:
  # would 15 repeats over 90 s have caught loops sooner, or terminated agents that were fine?
  trajbus whatif --set watchdog.loop_min_repeats=15 --set watchdog.loop_min_span_ms=90s

  # which reclaims would a 4-minute lease have added, for one sandbox, as JSON
  trajbus whatif --set scheduler.lease_ttl_ms=4m --sandbox sb-0007 --json

  # rules from a file, an HTML report for the team
  echo '{"watchdog": {"loop_min_repeats": 30}}' > looser.json
  trajbus whatif --rules looser.json --html whatif.html

exit status: 0 when the self-check passed, 3 when it failed (the recorded rules did not
reproduce what was recorded: the diff is not to be trusted), 1 for a wrong question.
"""


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "whatif", help="what changed rules would have decided differently over the past log",
        description=DESCRIPTION, epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--set", dest="assignments", action="append", default=[],
                   metavar="RULE=VALUE",
                   help="change a rule, e.g. watchdog.loop_min_repeats=15 (repeatable)")
    p.add_argument("--rules", metavar="FILE", default=None,
                   help='JSON or TOML file of rules, e.g. {"scheduler": {"lease_ttl_ms": '
                   '900000}}; --set wins over it')
    p.add_argument("--list-rules", action="store_true",
                   help="print the rule names with their recorded values and exit")
    p.add_argument("--task", default=None, help="only this task's sandboxes")
    p.add_argument("--sandbox", default=None, help="only this sandbox")
    p.add_argument("--from", dest="from_", default=None, metavar="TIME",
                   help="only decisions/alerts at or after this event time (ISO-8601, epoch "
                   "ms, or relative: -2h)")
    p.add_argument("--to", default=None, metavar="TIME", help="... and at or before this one")
    p.add_argument("--json", action="store_true", help="print the diff as JSON")
    p.add_argument("--html", metavar="FILE", default=None,
                   help="also write a self-contained HTML report to FILE")
    p.add_argument("--timeout", type=float, default=300.0, metavar="S",
                   help="give up reading the log after S seconds (default 300)")
    p.add_argument("--quiet", action="store_true", help="no progress on stderr")
    p.set_defaults(func=_whatif)


class _Progress:
    """Progress on stderr, at most every second, when it is a terminal or the run is long."""

    def __init__(self, quiet: bool) -> None:
        self.quiet = quiet
        self.started = time.monotonic()
        self.last = 0.0

    def note(self, text: str) -> None:
        if not self.quiet:
            print(f"whatif: {text}", file=sys.stderr, flush=True)

    def __call__(self, stage: str, done: int, total: int) -> None:
        now = time.monotonic()
        if self.quiet or (now - self.last < 1.0 and done < total) or now - self.started < 2.0:
            return
        self.last = now
        pct = 100 * done // total if total else 100
        print(f"whatif: {stage}: {done}/{total} records ({pct}%)", file=sys.stderr,
              flush=True)


def _whatif(args: argparse.Namespace) -> int:
    from trajbus.bus.positions import parse_time
    from trajbus.consumers.whatif.api import whatif
    from trajbus.consumers.whatif.render import render_html, render_json, render_table
    from trajbus.consumers.whatif.rules import Rules, rule_names
    from trajbus.consumers.whatif.source import LogFilter, read_kafka_log

    settings = get_settings()
    if args.list_rules:
        for name in rule_names():
            group, field = name.split(".", 1)
            print(f"{name} = {getattr(getattr(settings, group), field)!r}")
        return 0
    rules = Rules.parse(args.assignments, args.rules)  # a wrong rule fails before any read
    where = LogFilter(task=args.task, sandbox=args.sandbox,
                      from_ms=parse_time(args.from_) if args.from_ else None,
                      to_ms=parse_time(args.to) if args.to else None)
    progress = _Progress(args.quiet)
    log = asyncio.run(read_kafka_log(settings, timeout_s=args.timeout, progress=progress.note))
    diff = whatif(log, rules, settings=settings, where=where, progress=progress)
    print(render_json(diff) if args.json else render_table(diff))
    if args.html:
        path = Path(args.html)
        path.write_text(render_html(diff), encoding="utf-8")
        progress.note(f"HTML report written to {path}")
    if not diff.self_check.passed:
        print("trajbus: the self-check failed: the recorded rules did not reproduce the "
              "recorded decisions/alerts (listed first); the diff is not to be trusted",
              file=sys.stderr)
        return 3
    return 0
