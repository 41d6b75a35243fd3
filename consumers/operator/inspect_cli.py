"""Operators' reading commands: ``trajbus consume``, ``trajbus deadletters``,
``trajbus alerts``. All read without a consumer group (nothing committed, nothing changed),
except ``deadletters redrive``, which produces to the dead letters' source topics."""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from typing import Any

from trajbus.bus.cliargs import (
    Commands,
    add_actions,
    add_command,
    add_filters,
    add_flags,
)
from trajbus.bus.positions import TIME_HELP, now_ms, parse_start, parse_time
from trajbus.bus.settings import get_settings


def register(sub: Commands) -> None:
    _register_consume(sub)
    _register_deadletters(sub)
    _register_alerts(sub)


# -- consume ---------------------------------------------------------------------------------
def _register_consume(sub: Commands) -> None:
    c = add_command(sub, "consume", _consume,
                    help="print any trajbus topic's records, decoded (like kcat -C)",
                    examples=(
                        "trajbus consume decisions --from -1h --kind TERMINATE",
                        "trajbus consume events --sandbox sb-17 --episode ep-3 --count 20",
                        "trajbus consume web-shop --from end --follow           # new replay "
                        "segments",
                        "trajbus consume deadletter --json | jq .record.reason",
                        "trajbus consume alerts --from 2026-11-30T10:00 --to 2026-11-30T11:00"))
    c.add_argument("topic", metavar="TOPIC", help="the topic (see above)")
    c.add_argument("--from", dest="start", default="beginning", metavar="POSITION",
                   help=f"beginning (default), end, or a time: {TIME_HELP}")
    c.add_argument("--to", default=None, metavar="TIME",
                   help="stop at records written after this time")
    c.add_argument("-n", "--count", type=int, default=None, metavar="N",
                   help="stop after N printed records")
    c.add_argument("-f", "--follow", action="store_true",
                   help="keep reading new records after reaching the end (Ctrl-C stops)")
    c.add_argument("--partition", default=None, metavar="P[,P...]",
                   help="only these partitions")
    add_filters(c, "task", "sandbox", "episode")
    c.add_argument("--kind", action="append", default=[],
                   help="only records of this kind (ToolCall, ReplaySegment, ...) or label "
                   "(a decision like TERMINATE, an alert like LOOP, a dead letter's reason "
                   "code); repeatable, any case")
    add_flags(c, ticks="also show the processors' Tick records",
              json="one JSON object per record (position, timestamp, decoded record)",
              expand=_EXPAND)


_EXPAND = "with --json: bytes as base64 instead of '<N bytes>'"


def _consume(args: argparse.Namespace) -> int:
    """Read a topic from a position and print its records decoded: raw sandbox events and
    trace chunks, replay segments, watchdog alerts, scheduling decisions, dead letters, late
    events. No consumer group: nothing is committed. Stops at the end offsets of the moment it
    started, unless --follow. read_committed: aborted transactional outputs are never shown.
    Ticks (the processors' clock records) are left out unless --ticks.

    TOPIC: a full name, a name under the prefix (sandbox.events, replay.web-shop), a short name
    (events, traces, control, nodes, decisions, alerts, deadletter, late, schemas) or a task
    (its replay topic)."""
    from trajbus.bus.inventory import topic_names
    from trajbus.bus.kafka import check_broker
    from trajbus.consumers.operator.consume import (
        RecordFilter,
        consume,
        parse_partitions,
        resolve_topic,
    )

    settings = get_settings()
    start = parse_start(args.start)
    if start == "resume":
        raise ValueError("--from resume needs a consumer group; consume reads without one: "
                         "use beginning, end or a time")
    until = parse_time(args.to) if args.to else None
    partitions = parse_partitions(args.partition)
    filt = RecordFilter.of(args.task, args.sandbox, args.episode, args.kind, args.ticks)
    if args.count is not None and args.count <= 0:
        raise ValueError("--count must be a positive number")

    async def run() -> tuple[str, int]:
        await check_broker(settings.kafka)
        topic = resolve_topic(settings, args.topic, await topic_names(settings))
        shown = 0
        async for rec in consume(settings, topic, start, follow=args.follow,
                                 partitions=partitions):
            if until is not None and rec.timestamp_ms > until:
                continue
            if not rec.matches(filt):
                continue
            print(json.dumps(rec.to_dict(args.expand)) if args.json else rec.line(),
                  flush=args.follow)
            shown += 1
            if args.count is not None and shown >= args.count:
                break
        return topic, shown

    topic, shown = asyncio.run(run())
    if not args.json:
        print(f"{shown} record(s) from {topic}", file=sys.stderr)
    return 0


# -- deadletters -----------------------------------------------------------------------------
def _register_deadletters(sub: Commands) -> None:
    d = add_command(
        sub, "deadletters", _dl_counts,
        help="what the processors refused: counts, list, inspect, re-drive",
        examples=(
            "trajbus deadletters                                  # counts by stage and reason",
            "trajbus deadletters list --reason conflicting_duplicate",
            "trajbus deadletters show 3f2a9c1e                    # one, decoded",
            "trajbus deadletters redrive --reason too_many_open_episodes --dry-run",
            "trajbus deadletters resolve 3f2a9c1e --note 'sandbox fixed, events not needed'",
            "trajbus deadletters list --status open"))
    add_flags(d, json="the counts as one JSON object")
    dsub = add_actions(d, "deadletters_command")

    def selection(p: argparse.ArgumentParser) -> None:
        p.add_argument("--stage", action="append", default=[],
                       help="only this stage: reorder, watchdog, scheduler, archiver "
                       "(repeatable)")
        p.add_argument("--reason", action="append", default=[], metavar="CODE",
                       help="only this reason code, e.g. conflicting_duplicate (repeatable)")
        add_filters(p, "task", "sandbox")
        p.add_argument("--since", default=None, metavar="TIME",
                       help=f"only dead letters since this time: {TIME_HELP}")
        p.add_argument("--status", action="append", default=[],
                       choices=["open", "redriven", "resolved"],
                       help="only dead letters with this status (repeatable): open (nothing "
                       "done yet), redriven, resolved")

    lst = add_command(dsub, "list", _dl_list, help="one line per dead letter (oldest first)")
    selection(lst)
    add_flags(lst, json="one JSON object per dead letter")
    lst.add_argument("-n", "--count", type=int, default=None, metavar="N",
                     help="only the latest N")

    show = add_command(dsub, "show", _dl_show,
                       help="one dead letter whole: reason, source, original bytes decoded")
    show.add_argument("id", help="the dead letter's id, or its first characters (at least 4)")
    add_flags(show, json="as one JSON object", expand=_EXPAND)

    every = "every dead letter matching the filters (required when no id and no filter is given)"
    rd = add_command(dsub, "redrive", _dl_redrive,
                     help="send dead letters back to their source topic after a fix")
    rd.add_argument("ids", nargs="*", metavar="ID", help="dead letter ids (or prefixes)")
    selection(rd)
    add_flags(rd, all=every, dry_run="list what would be re-driven")

    rs = add_command(dsub, "resolve", _dl_resolve,
                     help="mark dead letters resolved, with a note (nothing is sent)")
    rs.add_argument("ids", nargs="*", metavar="ID", help="dead letter ids (or prefixes)")
    selection(rs)
    add_flags(rs, all=every)
    rs.add_argument("--note", required=True, help="why: who fixed what, where the data went")
    add_flags(rs, reopen="mark them open again instead")


def _dl_read(args: argparse.Namespace) -> list[Any]:
    return _dl_read_both(args)[0]


def _dl_read_both(args: argparse.Namespace) -> tuple[list[Any], list[Any]]:
    """The dead letters the filters select, and every dead letter read."""
    from trajbus.consumers.operator.deadletters import read_dead_letters, select

    every = asyncio.run(read_dead_letters(get_settings()))
    if not hasattr(args, "stage"):
        return every, every
    since = parse_time(args.since) if args.since else None
    return select(every, stages=args.stage, reasons=args.reason, tasks=args.task,
                  sandboxes=args.sandbox, since_ms=since, statuses=args.status), every


def _dl_counts(args: argparse.Namespace) -> int:
    """The dead-letter topic (<prefix>.deadletter): input a processor or the archiver could not
    accept, with the stage, reason, source position and the original bytes. Without an action:
    counts by stage and reason."""
    from trajbus.bus.topics import Topics
    from trajbus.consumers.operator.deadletters import counts, stage_reason_table

    dls = _dl_read(args)
    rows = counts(dls)
    topic = Topics(get_settings()).deadletter
    by_status = {st: sum(1 for d in dls if d.state == st) for st in ("open", "redriven",
                                                                    "resolved")}
    if args.json:
        print(json.dumps({"topic": topic, "total": len(dls), "by_status": by_status,
                          "by_stage_and_reason": [
            {"stage": c.stage, "reason_code": c.reason_code, "count": c.count,
             "first_ms": c.first_ms, "last_ms": c.last_ms, "latest_id": c.example}
            for c in rows]}, indent=2))
        return 0
    print(f"{len(dls)} dead letter(s) on {topic}: "
          + ", ".join(f"{n} {st}" for st, n in by_status.items()))
    for line in stage_reason_table(rows):
        print(line)
    if dls:
        print("more: `trajbus deadletters list [--reason CODE] [--status open]`, "
              "`trajbus deadletters show ID`")
    return 0


def _dl_list(args: argparse.Namespace) -> int:
    """One line per dead letter: short id, time, stage/reason, source position, task,
    sandbox/episode and the reason."""
    dls = _dl_read(args)
    if args.count is not None:
        dls = dls[-args.count:] if args.count > 0 else []
    for d in dls:
        print(json.dumps(d.to_dict()) if args.json else d.line())
    if not args.json:
        print(f"{len(dls)} dead letter(s)", file=sys.stderr)
    return 0


def _dl_show(args: argparse.Namespace) -> int:
    """Everything about one dead letter: reason, stage, source topic/partition/offset, the
    original key, the original record decoded (when it decodes; else its first bytes) and, for
    a conflicting duplicate, the version that was kept."""
    from trajbus.consumers.operator.deadletters import find, kept_version

    d = find(_dl_read(args), args.id)
    kept = None
    if d.reason_code == "conflicting_duplicate" and d.conflicting_value is None:
        kept = asyncio.run(kept_version(get_settings(), d))  # emitted: from the replay topic
    print(json.dumps(d.to_dict(args.expand, kept), indent=2) if args.json else d.render(kept))
    return 0


def _dl_redrive(args: argparse.Namespace) -> int:
    """Produce each selected source record's original key and bytes to its source topic and
    partition again, so the processors take it once more (after the cause was fixed). Each
    source record is sent once, however many stages dead-lettered it. Every dead letter sent
    gets the status 'redriven' (in the same Kafka transaction), so a second redrive skips it:
    re-driving twice sends nothing twice. Refuses permanent failures (bytes that are not a
    trajbus record or do not decode, malformed events, the losing version of a conflict, ...:
    sending the same bytes again would fail the same way), truncated bytes (the reason says
    where the whole record is), and skips resolved ones. Select by id, by
    --stage/--reason/--task/--sandbox/--since/--status, or --all."""
    from trajbus.consumers.operator.deadletters import redrive

    dls, every = _dl_selected_and_every(args, "re-drive")
    done = asyncio.run(redrive(get_settings(), dls, dry_run=args.dry_run, every=every))
    n: dict[str, int] = {}
    for r in done:
        n[r.action] = n.get(r.action, 0) + 1
        what = f"{r.dead_letter.short_id} ({r.dead_letter.stage}/{r.dead_letter.reason_code})"
        if r.action == "sent":
            where = f"{r.topic} p{r.partition}" + (f"@{r.offset}" if r.offset >= 0 else "")
            print(f"{'would re-drive' if args.dry_run else 're-drove'} {what} -> {where}")
        elif r.action == "same_source":
            print(f"  and {what}: the same source record (sent once, with {r.with_id[:12]})")
        elif r.action == "already":
            print(f"skipped {what}: {r.why}")
        else:
            print(f"refused {what}: {r.why}")
    sent = n.get("sent", 0)
    print(f"{sent} source record(s) {'would be ' if args.dry_run else ''}re-driven for "
          f"{sent + n.get('same_source', 0)} dead letter(s); {n.get('refused', 0)} refused, "
          f"{n.get('already', 0)} already re-driven or resolved", file=sys.stderr)
    return 0


def _dl_selected(args: argparse.Namespace, verb: str) -> list[Any]:
    return _dl_selected_and_every(args, verb)[0]


def _dl_selected_and_every(args: argparse.Namespace, verb: str
                           ) -> tuple[list[Any], list[Any]]:
    from trajbus.bus.errors import UserError
    from trajbus.consumers.operator.deadletters import find

    filtered = bool(args.stage or args.reason or args.task or args.sandbox or args.since
                    or args.status)
    if not (args.ids or filtered or args.all):
        raise UserError(f"select the dead letters to {verb}: ids, --stage/--reason/--task/"
                        "--sandbox/--since/--status, or --all",
                        hint="`trajbus deadletters list` shows them"
                        + ("; try --dry-run first" if verb == "re-drive" else ""))
    dls, every = _dl_read_both(args)
    if args.ids:
        dls = list({d.event_id: d for d in (find(dls, i) for i in args.ids)}.values())
    return dls, every


def _dl_resolve(args: argparse.Namespace) -> int:
    """Record that the selected dead letters need nothing more (e.g. the data is not needed, or
    was recovered another way), with a note, on <prefix>.deadletter-status. `list --status
    open` then no longer shows them and redrive skips them. --reopen marks them open again."""
    from trajbus.consumers.operator.deadletters import resolve

    dls = _dl_selected(args, "resolve")
    n = asyncio.run(resolve(get_settings(), dls, args.note, reopen=args.reopen))
    for d in dls:
        print(f"{'reopened' if args.reopen else 'resolved'} {d.short_id} "
              f"({d.stage}/{d.reason_code}, was {d.state})")
    print(f"{n} dead letter(s) marked {'open' if args.reopen else 'resolved'}", file=sys.stderr)
    return 0


# -- alerts ----------------------------------------------------------------------------------
def _register_alerts(sub: Commands) -> None:
    from trajbus.consumers.operator.alerts import DEFAULT_KINDS

    a = add_command(
        sub, "alerts", _alerts,
        help="recent loops, terminations, anomalies, reclaims, recycles with loss",
        description="The watchdog's alerts and the scheduler's decisions written since a time: "
        "which sandboxes looped, stalled, were terminated, reclaimed or recycled with loss, or "
        "raised an anomaly -- when, in which task, and why. Default kinds: "
        f"{', '.join(DEFAULT_KINDS)}.",
        examples=("trajbus alerts --since 1h",
                  "trajbus alerts --since 2026-11-30T10:00 --kind TERMINATE --task web-shop",
                  "trajbus alerts --since 1d --kind DRAIN --kind RECYCLE --json"))
    a.add_argument("--since", default="1h", metavar="TIME",
                   help=f"how far back (default 1h): {TIME_HELP}")
    a.add_argument("--kind", action="append", default=[],
                   help="only these alert/decision kinds (repeatable; any alert or decision "
                   "kind, e.g. PLACE, DRAIN)")
    add_filters(a, "task", "sandbox")
    add_flags(a, json="one JSON object per line")


def _alerts(args: argparse.Namespace) -> int:
    from trajbus.consumers.operator.alerts import DEFAULT_KINDS, happenings, headline
    from trajbus.schemas.models import AlertKind, DecisionKind

    known = {k.value for k in AlertKind} | {k.value for k in DecisionKind}
    kinds = [k.upper() for k in args.kind] or list(DEFAULT_KINDS)
    unknown = sorted(set(kinds) - known)
    if unknown:
        raise ValueError(f"unknown kind {unknown[0]!r}; alert and decision kinds: "
                         f"{', '.join(sorted(known))}")
    since = parse_time(args.since)
    now = now_ms()
    items = asyncio.run(happenings(get_settings(), since, kinds, args.sandbox, args.task))
    if args.json:
        for h in items:
            print(json.dumps(h.to_dict()))
        return 0
    from trajbus.bus.positions import ago, iso

    print(f"since {iso(since)} ({ago(since, now)}): {headline(items, kinds)}")
    for h in items:
        print(h.line(now))
    return 0
