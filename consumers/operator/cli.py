"""Operators' commands.

``register_replay(rsub)`` adds to ``trajbus replay``: ``events``, ``explain``, ``republish``,
``waterfall``. ``register(sub)`` adds the top-level ``status``, ``scheduler status`` and
``watchdog explain``. Every command reads the settings from the environment (``TRAJBUS_...``)
and only reads topics, except ``replay republish``, which writes to a debug replay topic.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from pathlib import Path
from typing import Any

from trajbus.bus.cliargs import Commands, add_actions, add_command, add_flags, add_target
from trajbus.bus.settings import get_settings


def register_replay(rsub: Commands) -> None:
    """Add ``events``, ``explain``, ``republish`` and ``waterfall`` to ``trajbus replay``."""
    e = add_command(rsub, "events", _events,
                    help="a sandbox's event timeline (from Kafka or the archive)",
                    examples=("trajbus replay events --sandbox sb-17",
                              "trajbus replay events --sandbox sb-17 --episode ep-3 --expand",
                              "trajbus replay events --sandbox sb-17 --from 2025-01-01T10:00 "
                              "--to 2025-01-01T11:00",
                              "trajbus replay events --sandbox sb-17 --json | jq .summary"))
    add_target(e, episode="only this episode's events")
    e.add_argument("--from", dest="from_", default=None, metavar="ISO",
                   help="only events at or after this time (ISO-8601, UTC if no zone; or "
                   "epoch ms)")
    e.add_argument("--to", default=None, metavar="ISO",
                   help="only events at or before this time (ISO-8601 or epoch ms)")
    _add_source(e)
    add_flags(e, json="one JSON object per event (with the decoded record)",
              expand="show trace chunks' text (and, with --json, bytes as base64)")

    x = add_command(rsub, "explain", _explain,
                    help="why the processors decided what they did about a sandbox")
    add_target(x)
    add_flags(x, json="the explanation as one JSON object")

    p = add_command(rsub, "republish", _republish,
                    help="re-emit an episode to a debug replay topic for a trainer")
    add_target(p, task="the episode's task (names the debug topic)", episode="episode id",
               episode_required=True)
    p.add_argument("--to-topic", default=None, metavar="TOPIC",
                   help="target topic (default: <prefix>.replay.debug-TASK)")
    _add_source(p)

    w = add_command(rsub, "waterfall", _waterfall,
                    help="an episode's step-time waterfall (where the time went) as HTML/PNG")
    add_target(w, episode="episode id", episode_required=True)
    w.add_argument("--out", required=True, type=Path, metavar="report.html",
                   help="where to write the HTML report")
    w.add_argument("--png", default=None, type=Path, metavar="out.png",
                   help="also write a PNG image")
    _add_source(w)


def register(sub: Commands) -> None:
    """Add the top-level ``status``, ``scheduler status`` and ``watchdog explain``."""
    s = add_command(sub, "status", _status,
                    help="is a worker running; processors' lag, dead letters, replay topics")
    add_flags(s, json="print one JSON object")

    sch = add_command(sub, "scheduler", help="inspect the scheduler's state",
                      description="Inspect the scheduler processor's state.")
    st = add_command(add_actions(sch, "scheduler_command"), "status", _scheduler_status,
                     help="sandboxes by state, expiring leases, queues, node headroom")
    add_flags(st, json="print core.status() as JSON")

    wd = add_command(sub, "watchdog", help="inspect the watchdog's loop detection",
                     description="Inspect the watchdog processor.")
    we = add_command(add_actions(wd, "watchdog_command"), "explain", _watchdog_explain,
                     help="why the loop rule fired or not for a sandbox")
    add_target(we, episode="only this episode")
    add_flags(we, from_log="re-run over the sandbox's events: each alert at the moment it fired")


def _add_source(p: argparse.ArgumentParser) -> None:
    p.add_argument("--source", choices=("kafka", "archive"), default="kafka",
                   help="read the Kafka topics (default; within their retention) or the "
                   "Parquet archive")


# -- handlers --------------------------------------------------------------------------------
def _events(args: argparse.Namespace) -> int:
    """Print what a sandbox did: its lifecycle, heartbeats, probes, tool calls and results,
    trace chunks, episode starts and ends, one line each.

    Reads the raw input topics (sandbox events and trace chunks) from the beginning up to their
    current end (bounded: it terminates while producers keep writing), keeps the sandbox's
    events, drops duplicates by event id and orders them: sandbox-level events by time, then
    each episode (earliest first) by sequence number."""
    from trajbus.consumers.operator.tools import read_sandbox_log

    entries = asyncio.run(read_sandbox_log(get_settings(), args.sandbox, episode=args.episode,
                                           from_ms=args.from_, to_ms=args.to,
                                           source=args.source, must_exist=True))
    for e in entries:
        if args.json:
            print(json.dumps(e.to_dict(expand=args.expand)))
        else:
            print(e.line(expand=args.expand))
    if not entries and not args.json:
        print(f"no events of sandbox {args.sandbox}"
              + (f" episode {args.episode}" if args.episode else "")
              + " in that time range", file=sys.stderr)
    return 0


def _explain(args: argparse.Namespace) -> int:
    """Re-run the scheduler (and the watchdog, when built) over the retained log with the same
    code the workers run, and list every decision and alert about the sandbox with the events
    that caused it. Then compare with what was recorded on the decisions and alerts topics by
    event id (ids are deterministic) and list divergences: recorded but not reproduced,
    reproduced but not recorded, same id with different content.

    Input order: the live interleaving of partitions is not recorded; the re-run merges
    partitions by record timestamp (each in offset order), the best available approximation.
    Reads every input of the scheduler (it is global), so it costs a full read of the retained
    log.

    Exit status: 0 consistent, 3 divergences found."""
    from trajbus.consumers.operator.tools import explain

    result = asyncio.run(explain(get_settings(), args.sandbox))
    print(json.dumps(result.to_dict(), indent=2) if args.json else result.render())
    return 0 if result.consistent else 3


def _republish(args: argparse.Namespace) -> int:
    """Read one episode from the log and publish it as replay segments (events in sequence
    order, duplicates dropped; split only at sequence gaps and size limits) to a debug replay
    topic, by default trajbus.replay.debug-TASK. A trainer reads it like any replay topic by
    subscribing to the task 'debug-TASK', e.g.
      ReplayClient(['debug-TASK'], group_id='my-debug')
      trajbus replay tail --task debug-TASK
    Republishing twice produces segments with the same event ids; the ReplayClient drops the
    second copy."""
    from trajbus.consumers.operator.tools import debug_replay_task, republish

    r = asyncio.run(republish(get_settings(), args.task, args.sandbox, args.episode,
                              to_topic=args.to_topic, source=args.source))
    print(f"published {r.events} events (seq {r.first_seq}..{r.last_seq}) in {r.segments} "
          f"segment(s) to {r.topic}" + ("" if r.is_last else " (episode has no end yet)")
          + (f"; gaps {list(r.gaps)}" if r.gaps else ""))
    if args.to_topic is None:
        print(f"a trainer reads it with task {debug_replay_task(args.task)!r}, e.g. "
              f"`trajbus replay tail --task {debug_replay_task(args.task)}`")
    return 0


def _waterfall(args: argparse.Namespace) -> int:
    """Per tool call: ToolCall -> ToolResult duration (matched by call id), the gaps between
    steps as agent think time, and each tool's share of the episode. The HTML report is one
    self-contained file (inline CSS and SVG, no script, no network). --png needs matplotlib or
    a headless Chromium (chromium / chromium-headless-shell on PATH, or TRAJBUS_CHROMIUM)."""
    from trajbus.consumers.operator.tools import read_sandbox_log
    from trajbus.consumers.operator.waterfall import (
        PngUnavailableError,
        build_waterfall,
        render_html,
        render_png,
    )

    entries = asyncio.run(read_sandbox_log(get_settings(), args.sandbox, episode=args.episode,
                                           source=args.source, must_exist=True))
    if not entries:
        print(f"no events of sandbox {args.sandbox} episode {args.episode}", file=sys.stderr)
        return 1
    args.out.write_text(render_html(entries, args.episode), encoding="utf-8")
    print(f"wrote {args.out}: {build_waterfall(entries, args.episode).headline}")
    if args.png:
        try:
            render_png(entries, args.png, args.episode)
        except PngUnavailableError as exc:
            print(f"no PNG: {exc}", file=sys.stderr)
            return 1
        print(f"wrote {args.png}")
    return 0


def _ranges(ps: list[int]) -> str:
    """[0, 1, 2, 5] -> "0-2,5"."""
    ps = sorted(ps)
    out: list[str] = []
    i = 0
    while i < len(ps):
        j = i
        while j + 1 < len(ps) and ps[j + 1] == ps[j] + 1:
            j += 1
        out.append(str(ps[i]) if i == j else f"{ps[i]}-{ps[j]}")
        i = j + 1
    return ",".join(out)


def _status(args: argparse.Namespace) -> int:
    """For each processor (reorder, watchdog, scheduler): its consumer group's live members
    (which worker holds which partitions; none means no worker runs it) and its lag per input
    topic in records (transaction markers excluded: a caught-up processor shows 0). Then the
    dead letters retained and the replay topics with their segment counts."""
    from trajbus.consumers.operator.tools import fleet_status

    st = asyncio.run(fleet_status(get_settings()))
    if args.json:
        print(json.dumps(st, indent=2))
        return 0
    prefix = st["prefix"] + "."

    def short(topic: str) -> str:
        return topic.removeprefix(prefix)

    print(f"kafka {st['bootstrap_servers']}, topics under {prefix}")
    _print_cluster(st["cluster"])
    print("processors (lag: records not yet processed; transaction markers and the "
          "processors' Ticks not counted):")
    for name, g in st["processors"].items():
        if not g["available"]:
            print(f"  {name:<10} (not built)")
            continue
        members = g["members"]
        alive = (f"{len(members)} live member{'s' if len(members) != 1 else ''}" if members
                 else "NO LIVE MEMBER: no worker runs it")
        detail = ", ".join(f"{short(t)} {n}" for t, n in g["lag"].items() if n) or (
            "caught up" if g["lag"] else "no input topics yet")
        print(f"  {name:<10} group {short(g['group'])} ({g['state'].lower()}): {alive}; lag "
              f"{g['total_lag']} ({detail})")
        for m in members:
            parts = "; ".join(f"{short(t)} [{_ranges(ps)}]"
                              for t, ps in sorted(m["partitions"].items()))
            print(f"      {short(m['client_id'])} on {m['host']}: {parts or 'no partitions yet'}")
    print("archivers (lag: records not yet archived, Ticks and markers not counted; rows in a "
          "batch not yet written count until it is):" if st["archivers"] else
          "archivers: none has run under this prefix (`trajbus archive run`)")
    for group, g in st["archivers"].items():
        members = g["members"]
        alive = (f"{len(members)} live member{'s' if len(members) != 1 else ''}" if members
                 else "NO LIVE MEMBER: no archiver runs it")
        print(f"  group {short(group)} ({g['state'].lower()}): {alive}; lag {g['total_lag']}"
              + (" (caught up)" if not g["total_lag"] else ""))
        for m in members:
            parts = "; ".join(f"{short(t)} [{_ranges(ps)}]"
                              for t, ps in sorted(m["partitions"].items()))
            print(f"      {m['client_id']} on {m['host']}: {parts or 'no partitions yet'}")
    print(f"dead letters: {st['dead_letters']} on {short(st['deadletter_topic'])}"
          + (" (`trajbus deadletters` for counts by stage and reason)"
             if st["dead_letters"] else ""))
    print("replay topics:" if st["replay_topics"] else "replay topics: none")
    for t, info in st["replay_topics"].items():
        print(f"  {short(t):<36} {info['records']} segments")
    return 0


def _print_cluster(c: dict[str, Any]) -> None:
    brokers = c["brokers"]
    print(f"cluster: {len(brokers)} live broker{'s' if len(brokers) != 1 else ''} "
          f"({', '.join(map(str, brokers))}); {c['partitions']} partitions of these topics and "
          f"Kafka's internal ones: {len(c['under_replicated'])} under-replicated, "
          f"{len(c['under_min_isr'])} under min.insync.replicas, {len(c['offline'])} offline")
    for what, key, why in (
            ("OFFLINE (no leader: neither read nor written)", "offline", ""),
            ("UNDER MIN ISR (writes refused until a replica returns)", "under_min_isr", ""),
            ("under-replicated (a replica is down or catching up)", "under_replicated", "")):
        parts = c[key]
        if parts:
            shown = ", ".join(parts[:8]) + (f", ... (+{len(parts) - 8})" if len(parts) > 8
                                            else "")
            print(f"  {what}: {shown}{why}")


def _scheduler_status(args: argparse.Namespace) -> int:
    """Rebuild the scheduler's state from its committed changelog topic
    (<prefix>.scheduler.state, what a restarted worker would load) and print: sandboxes by
    lifecycle state, leases close to expiry, draining sandboxes, queued requests and credit per
    tenant, nodes by headroom. Times are the scheduler's own clock (the latest event time it
    processed)."""
    from trajbus.bus.positions import duration, iso
    from trajbus.consumers.operator.tools import restore_scheduler

    core = asyncio.run(restore_scheduler(get_settings()))
    st: dict[str, Any] = core.status()
    if args.json:
        print(json.dumps(st, indent=2))
        return 0
    now = st["now_ms"]

    def gib(mb: float) -> str:
        return f"{mb / 1024:.1f} GiB" if mb >= 1024 else f"{mb:g} MiB"

    if not now:
        print("scheduler time: none yet (the scheduler has processed nothing)")
    else:
        print(f"scheduler time: {iso(now)} (the latest event time it processed; "
              "times below are relative to it)")
    print("sandboxes by state: " + (", ".join(
        f"{k} {v}" for k, v in st["sandboxes_by_state"].items() if v) or "none"))
    print(f"leases expiring soon: {len(st['leases_expiring'])}")
    for e in st["leases_expiring"]:
        left = e["remaining_ms"]
        when = f"expires in {duration(left)}" if left >= 0 else f"EXPIRED {duration(-left)} ago"
        print(f"  {e['sandbox']:<24} {e['state']:<12} node {e['node']} tenant {e['tenant']}: "
              f"{when}")
    if st["draining"]:
        print(f"draining: {len(st['draining'])}")
        for d in st["draining"]:
            left = d["grace_ends_ms"] - now
            grace = (f"grace ends in {duration(left)}" if left >= 0
                     else f"grace ended {duration(-left)} ago")
            print(f"  {d['sandbox']:<24} {d['reason']}; {grace}; "
                  f"{'drained' if d['drained'] else 'not drained yet'}"
                  + ("; SUSPICIOUS" if d["suspicious"] else ""))
    print("tenants:" if st["queued_by_tenant"] else "tenants: none yet")
    for name, t in st["queued_by_tenant"].items():
        print(f"  {name:<20} {t['queued']} queued; using {t['usage_cpu']:g} of "
              f"{t['limit_cpu']:g} CPUs allowed (credit {t['credit_cpu']:g})"
              + ("; DEMOTED" if t["demoted"] else ""))
    print("nodes, most free first:" if st["nodes_by_headroom"] else "nodes: none reported")
    for n in st["nodes_by_headroom"]:
        age = n.get("report_age_ms")
        print(f"  {n['node']:<20} free: {n['cpu_free']:.1f} of {n['cpu_total']:g} CPUs, "
              f"{gib(n['memory_free_mb'])} of {gib(n['memory_total_mb'])}, "
              f"{n['gpu_free']:.1f} of {n['gpu_total']:g} GPUs; {n['sandboxes']} sandboxes"
              + (f"; last report {duration(age)} earlier" if age is not None else "")
              + ("" if n["fresh"] else " (STALE)"))
    return 0


def _watchdog_explain(args: argparse.Namespace) -> int:
    """By default, from the live state (restored from <prefix>.watchdog.state; ended episodes
    are no longer tracked there): for each tracked stream (episode), the loop thresholds and,
    for every cycle length, the current repetition window (pattern, repeats, span, result
    changes) with what keeps it from firing.

    --from-log re-runs the watchdog over the sandbox's events and tells each episode's story:
    the moment each alert fired (the window that fired and the calls that are its evidence,
    the decision it requested), the loop's end, and the state just before the episode ended
    (or at the end of the log, for an episode cut short)."""
    from trajbus.consumers.operator.tools import watchdog_explain

    settings = get_settings()
    if args.from_log:
        from trajbus.consumers.operator.tools import watchdog_history

        histories = asyncio.run(watchdog_history(settings, args.sandbox, args.episode))
        for h in histories:
            print(h.render())
        if not histories:
            print(f"no tool calls of sandbox {args.sandbox}"
                  + (f" episode {args.episode}" if args.episode else "") + " in its events")
        return 0
    found = asyncio.run(watchdog_explain(settings, args.sandbox, args.episode))
    if not found:
        from trajbus.bus.errors import NotFoundError, existing
        from trajbus.consumers.operator.tools import sandboxes_in_log

        known = asyncio.run(sandboxes_in_log(settings))
        if args.sandbox not in known:
            raise NotFoundError(f"no events of sandbox {args.sandbox!r} in the Kafka topics",
                                hint=existing("sandboxes", known))
    if not found:
        print(f"no tracked stream of sandbox {args.sandbox} in the live watchdog state "
              "(ended episodes: try --from-log)")
        return 0
    for ex in found:
        print(ex.render())
    return 0
