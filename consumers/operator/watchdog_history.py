"""``watchdog explain``: what the watchdog knew of a sandbox's streams, moment by moment,
from its restored state or by running a fresh core over the sandbox's log."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Any

from trajbus.bus.kafka import check_broker
from trajbus.bus.settings import Settings
from trajbus.consumers.operator.reads import read_records, read_sandbox_log
from trajbus.consumers.operator.timeline import TimelineEntry, humanize, shorten_ids


async def watchdog_explain(settings: Settings, sandbox: str, episode: str | None = None,
                           *, from_log: bool = False) -> list[Any]:
    """The watchdog core's explanation (``WatchdogCore.explain``) for a sandbox's tracked
    streams. Default: the live state, restored from ``<prefix>.watchdog.state`` (streams of
    ended episodes are no longer tracked there). ``from_log``: a fresh core fed the sandbox's
    timeline from Kafka *without* its EpisodeEnd and DRAINING/RECYCLED events, so it explains
    finished episodes too ("why did the loop rule (not) fire during this episode")."""
    from trajbus.consumers.watchdog.core import WatchdogCore, state_key

    core = WatchdogCore(settings.watchdog, getattr(settings.watchdog, "per_task", None))
    if from_log:
        for e in await read_sandbox_log(settings, sandbox, episode=episode, must_exist=True):
            if e.kind == "EpisodeEnd" or (e.kind == "SandboxLifecycle"
                                          and e.record.get("state") in ("DRAINING", "RECYCLED")):
                continue
            core.handle(e.kind, e.record)
        return core.explain(sandbox, episode)
    await check_broker(settings.kafka)
    parts = await read_records(settings, [f"{settings.topics.prefix}.watchdog.state"])
    latest: dict[str, bytes | None] = {}
    mine = state_key(sandbox, "")
    for tp in sorted(parts, key=lambda tp: tp.partition):
        for r in parts[tp]:
            key = r.key.decode(errors="replace") if r.key else ""
            if key == sandbox or key.startswith(mine):
                latest[key] = r.value or None
    for key in sorted(latest):
        blob = latest[key]
        if blob is not None:
            core.restore(key, blob)
    return core.explain(sandbox, episode)


@dataclass(frozen=True)
class WatchdogMoment:
    """A moment of one stream's history: an alert firing, the episode's end, or the end of
    the log (a stream still tracked there: an episode truncated, e.g. terminated)."""

    what: str  # LOOP | LOOP_ENDED | STALL | episode end | end of the log
    time_ms: int  # the event time of the event that led to it
    seq: int
    explanation: Any  # the watchdog core's Explanation of the stream at that moment
    alert: dict[str, Any] | None = None  # the alert's fields (pattern, repeats, span, ...)
    decision: str | None = None  # the decision the alert requested (TERMINATE)
    evidence: tuple[TimelineEntry, ...] = ()  # the calls of the alert's window


@dataclass
class StreamHistory:
    """What the loop rule saw in one (sandbox, episode) stream, moment by moment."""

    task: str
    sandbox: str
    episode: str | None
    moments: list[WatchdogMoment]

    @property
    def verdict(self) -> str:
        loops = [m for m in self.moments if m.what == "LOOP"]
        if not loops:
            return "no loop"
        return ", ".join(f"LOOP fired at seq {m.seq}" for m in loops)

    def render(self) -> str:
        rules = self.moments[0].explanation.rules if self.moments else None
        lines = [f"sandbox {self.sandbox} episode {self.episode} (task {self.task}): "
                 f"{self.verdict}"]
        if rules is not None:
            from trajbus.bus.positions import duration

            lines.append(f"  the rule: fires at >= {rules.loop_min_repeats} repeats over >= "
                         f"{duration(rules.loop_min_span_ms)} with <= "
                         f"{rules.loop_max_distinct_results} result changes (cycles of up to "
                         f"{rules.max_cycle_length} calls){'; DRY RUN' if rules.dry_run else ''}")
        for m in self.moments:
            lines.extend(_render_moment(m))
        return "\n".join(lines)


def _render_moment(m: WatchdogMoment) -> list[str]:
    from trajbus.bus.positions import duration, iso

    head = f"  {iso(m.time_ms)} seq {m.seq:<5} "
    out: list[str] = []
    if m.alert is not None:
        a = m.alert
        if m.what in ("LOOP", "STALL"):
            calls = " -> ".join(p.split(":", 1)[0] for p in a.get("pattern") or [])
            what = (f"{m.what} fired: {calls or 'a call'} repeated {a.get('repeat_count')}x over "
                    f"{duration(a.get('span_ms') or 0)}, {a.get('distinct_results')} result "
                    "changes" if m.what == "LOOP" else f"STALL: {humanize(a.get('reason', ''))}")
            out.append(head + what + (f" -> {m.decision} requested" if m.decision else ""))
        else:
            out.append(head + f"{m.what}: {humanize(a.get('reason', ''))}")
        if m.evidence:
            out.append(f"      evidence: {len(m.evidence)} calls, seq {a.get('first_seq')}.."
                       f"{a.get('last_seq')}:")
            shown = list(m.evidence)
            if len(shown) > 5:
                shown = [*shown[:3], *shown[-2:]]
            for i, e in enumerate(shown):
                if len(m.evidence) > 5 and i == 3:
                    out.append(f"        ... {len(m.evidence) - 5} more ...")
                out.append(f"        #{e.seq:<5} {iso(e.time_ms)}  {humanize(e.summary)}")
    else:
        out.append(head + f"{m.what}: {m.explanation.verdict}")
    ex = m.explanation
    fired = m.what == "LOOP" and ex.loop_cycle_length
    for c in ex.candidates:
        if fired and c.cycle_length != ex.loop_cycle_length:
            continue  # at the moment it fired: the window that fired
        state = "MET" if not c.blockers else "; ".join(humanize(b) for b in c.blockers)
        if fired:
            state = "fired"
        pattern = ", ".join(shorten_ids(p) for p in c.pattern)
        out.append(f"      window of {c.cycle_length}-call cycles [{pattern}]: {c.repeat_count} "
                   f"repeats over {duration(c.span_ms)}, {c.result_changes} result changes, "
                   f"since seq {c.first_seq} ({c.since}) -> {state}")
    return out


async def watchdog_history(settings: Settings, sandbox: str, episode: str | None = None
                           ) -> list[StreamHistory]:
    """Re-run a fresh watchdog core over the sandbox's events (from Kafka, each episode in
    sequence order, as the watchdog reads replay) and record, per episode, the moment each
    alert fired (with the window that fired and the calls that are its evidence), the state
    just before the episode's end, and, for an episode still open at the end of the log (a
    truncated one), its last state. Sandbox-level DRAINING/RECYCLED events are left out: they
    end every stream of the sandbox, and the timeline lists them before the episodes."""
    from trajbus.consumers.watchdog.core import AlertOut, DecisionOut, WatchdogCore

    entries = await read_sandbox_log(settings, sandbox, episode=episode, must_exist=True)
    core = WatchdogCore(settings.watchdog, getattr(settings.watchdog, "per_task", None),
                        evict_idle_ms=None)
    histories: dict[str | None, StreamHistory] = {}
    by_episode: dict[str | None, list[TimelineEntry]] = defaultdict(list)
    for e in entries:
        by_episode[e.episode].append(e)

    def moment_of(e: TimelineEntry, what: str, **kw: Any) -> None:
        found = core.explain(sandbox, e.episode)
        if not found:
            return
        ex = found[0]
        h = histories.setdefault(e.episode, StreamHistory(ex.task, sandbox, e.episode, []))
        h.moments.append(WatchdogMoment(what, e.time_ms, e.seq, ex, **kw))

    for e in entries:
        if e.kind == "SandboxLifecycle" and e.record.get("state") in ("DRAINING", "RECYCLED"):
            continue
        if e.kind == "EpisodeEnd":
            moment_of(e, "episode end")
        outs = core.handle(e.kind, e.record)
        decision = next((o.decision for o in outs if isinstance(o, DecisionOut)), None)
        for o in outs:
            if not isinstance(o, AlertOut):
                continue
            alert = {"pattern": list(o.pattern), "repeat_count": o.repeat_count,
                     "span_ms": o.span_ms, "first_seq": o.first_seq, "last_seq": o.last_seq,
                     "distinct_results": o.distinct_results, "reason": o.reason}
            evidence = tuple(x for x in by_episode[o.episode]
                             if x.kind == "ToolCall" and o.first_seq <= x.seq <= o.last_seq)
            ex = core.explain(sandbox, o.episode)
            if not ex and o.episode in histories:  # the stream ended with this alert
                ex = [histories[o.episode].moments[-1].explanation]
            if not ex:
                continue
            h = histories.setdefault(o.episode, StreamHistory(ex[0].task, sandbox, o.episode,
                                                              []))
            h.moments.append(WatchdogMoment(o.alert, o.event_time_ms, o.seq, ex[0], alert,
                                            decision if o.alert == "LOOP" else None,
                                            evidence if o.alert == "LOOP" else ()))
    for still_open in core.explain(sandbox, episode):  # still open at the end of the log
        last = by_episode[still_open.episode][-1] if by_episode[still_open.episode] else None
        h = histories.setdefault(still_open.episode, StreamHistory(
            still_open.task, sandbox, still_open.episode, []))
        h.moments.append(WatchdogMoment("end of the log (episode not ended)",
                                        last.time_ms if last else still_open.last_event_time_ms,
                                        still_open.last_seq, still_open))
    return [histories[k] for k in sorted(histories, key=lambda k: (
        min((m.time_ms for m in histories[k].moments), default=0), k or ""))]
