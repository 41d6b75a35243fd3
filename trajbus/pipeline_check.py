"""The demo's check and its report: :func:`summary` compares what the trainer, the replay
topics, the watchdog, the scheduler and the archive hold with what the emitters had
acknowledged (the rules are in :mod:`trajbus.pipeline_demo`), prints the summary and returns
0 only when every check passed.

Guarantee: every difference found is named as a problem (with where it stopped, for an
episode that never reached the trainer); a RECYCLE_WITH_LOSS of a sandbox that did not crash
passes only when the log shows injected faults held the confirmation back past the drain
window (:func:`unexplained_loss`).
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

from trajbus.pipeline_collect import ReplayTopics
from trajbus.pipeline_view import Faults, View


def never_reached(sandbox: str, episode: str, acked: int, view: View,
                   replay: ReplayTopics) -> str:
    """The problem of an episode that never reached the trainer, with where it stopped: on the
    replay topic itself (the worker did not write it, or an open transaction hides it) or
    between the topic and the trainer."""
    key = (sandbox, episode)
    last = "with" if key in replay.closed else "without"
    return (f"{sandbox}/{episode}: never reached the trainer (the replay topic holds "
            f"{len(replay.seqs.get(key, ()))} of its {acked} events, {last} its last segment; "
            f"the trainer had {len(view.open.get(key, ()))})")


def expects_gap(acked: list[tuple[int, str]], final_seq: int | None) -> bool:
    """True when an acknowledged seq is really missing (a crash lost it): only then may the
    replay carry a gap marker."""
    seqs = sorted(seq for seq, _ in acked)
    if not seqs:
        return final_seq is not None and final_seq >= 0
    return seqs != list(range(seqs[-1] + 1)) or (final_seq is not None and final_seq > seqs[-1])


def unexplained_loss(sandbox: str, details: dict[str, str], replay: ReplayTopics,
                      faults: Faults | None) -> str | None:
    """Why a RECYCLE_WITH_LOSS of a sandbox that did not crash is a fault of the pipeline, or
    None when the log shows the platform's rule at work.

    The scheduler ends a drain with loss when its grace window ends (log time) before
    downstream confirms the final seqs, or before the sandbox's Drained report. A broker outage
    and a worker restart together can hold those back past the window: then the confirmation
    (or the report) is in the log *after* the window's end, and the verdict is right. One that
    is in the log before the window's end means the scheduler judged by a clock ahead of its
    inputs: a bug. An emitter that could not flush is explained only by a broker outage."""
    outage = faults is not None and faults.longest_outage_s > 0
    lost = details.get("lost", "")
    ended = details.get("grace_ended_ms")
    if ended is None:  # the emitter's own Drained report said it could not flush everything
        return None if outage else (f"sandbox {sandbox}: RECYCLE_WITH_LOSS ({lost}) without a "
                                    "crash or a broker outage")
    end = int(ended)
    if lost.startswith("unknown"):
        at = replay.drained_at(sandbox)
        if at is not None and at > end:
            return None
        return (f"sandbox {sandbox}: RECYCLE_WITH_LOSS (no Drained report when the grace window "
                f"ended at {end}), but its Drained report was in the log at {at}")
    for part in lost.split(","):
        episode, _, span = part.rpartition(":")
        if episode == "unflushed":
            if outage:
                continue
            return f"sandbox {sandbox}: RECYCLE_WITH_LOSS ({part}) without a broker outage"
        final_seq = int(span.rpartition("-")[2])
        at = replay.confirmed_at(sandbox, episode, final_seq)
        if at is None:
            return (f"sandbox {sandbox}: RECYCLE_WITH_LOSS ({part}), and downstream never "
                    f"confirmed seq {final_seq} on the replay topics")
        if at <= end:
            return (f"sandbox {sandbox}: RECYCLE_WITH_LOSS ({part} unconfirmed when the grace "
                    f"window ended at {end}), but downstream confirmed seq {final_seq} at {at}")
    return None


def summary(expected: dict[tuple[str, str, str], Any], manifest: Any, view: View,
             replay: ReplayTopics, archive: dict[str, Any], waterfall: Path | None,
             elapsed: float, faults: Faults | None = None,
             drain_window_s: float = 30.0) -> int:
    problems: list[str] = []
    exact = truncated_ok = 0
    for (_task, sandbox, episode), rec in sorted(expected.items()):
        got = view.episodes.get((sandbox, episode))
        want = sorted((seq, eid) for seq, eid in rec.acked)
        if got is None:
            problems.append(never_reached(sandbox, episode, len(want), view, replay))
        elif got == want:
            exact += 1
            if (sandbox, episode) in view.truncated:
                truncated_ok += 1
        else:
            missing = sorted(set(want) - set(got))[:3]
            extra = sorted(set(got) - set(want))[:3]
            problems.append(f"{sandbox}/{episode}: {len(got)} events vs {len(want)} "
                            f"acknowledged (missing {missing}, unexpected {extra})")

    problems.extend(view.reader_failures)
    if replay.unstable and any("never reached the trainer" in p for p in problems):
        problems.append(f"replay partitions with an open transaction at the end (last stable "
                        f"offset, end): {replay.unstable}")
    # The replay topics themselves: once each, gaps only where a seq is really missing.
    if replay.error is not None:
        problems.append(f"reading the replay topics failed: {replay.error}")
    for exit_ in faults.unexpected_exits if faults is not None else []:
        problems.append(f"unexpected worker exit: {exit_}")
    twice = false_gaps = 0
    for (_task, sandbox, episode), rec in sorted(expected.items()):
        seen = replay.seqs.get((sandbox, episode), Counter())
        dups = sorted(k for k, n in seen.items() if n > 1)
        if dups:
            twice += len(dups)
            problems.append(f"{sandbox}/{episode}: {len(dups)} events more than once on the "
                            f"replay topic (e.g. seq {dups[0][0]})")
        gaps = replay.gaps.get((sandbox, episode))
        if gaps and not expects_gap(rec.acked, rec.final_seq):
            false_gaps += 1
            problems.append(f"{sandbox}/{episode}: false gap marker(s) {gaps} (every seq was "
                            "acknowledged)")

    planted = {(e.sandbox, e.episode) for e in manifest.loops}
    caught = {(s, ep) for s, ep in view.loop_alerts if ep is not None}
    missed = planted - caught
    false_alarms = caught - planted
    for s, ep in sorted(missed):
        problems.append(f"looping episode {s}/{ep} was not caught")
    for s, ep in sorted(false_alarms):
        behaviour = next((e.behaviour for e in manifest.episodes
                          if (e.sandbox, e.episode) == (s, ep)), "?")
        problems.append(f"false loop alert on {s}/{ep} ({behaviour})")

    # Lifecycles: every sandbox drained, then recycled once; loss only where a crash was planted.
    crashed = {e.sandbox for e in manifest.episodes if e.behaviour == "crash"}
    outage_losses = 0
    sandboxes = sorted({e.sandbox for e in manifest.episodes} | set(manifest.sandbox_streams))
    for sb in sandboxes:
        ds = view.by_sandbox.get(sb, [])
        recycles = [d for d in ds if d in ("RECYCLE", "RECYCLE_WITH_LOSS")]
        # The drain starts with DRAIN (the sandbox reported DRAINING) or with TERMINATE (the
        # watchdog's loop verdict reached the scheduler first: it drains the sandbox itself).
        drains = [i for i, d in enumerate(ds) if d in ("DRAIN", "TERMINATE")]
        if len(recycles) != 1 or not drains or drains[0] > ds.index(recycles[0]):
            problems.append(f"sandbox {sb}: lifecycle decisions {ds} (want DRAIN or "
                            "TERMINATE, then one RECYCLE)")
        elif recycles == ["RECYCLE_WITH_LOSS"] and sb not in crashed:
            why_not = unexplained_loss(sb, view.loss_details.get(sb, {}), replay, faults)
            if why_not is None:
                outage_losses += 1
            else:
                problems.append(why_not)
    for a in view.anomalies[:10]:
        problems.append(f"ANOMALY decision: {a}")
    if view.dead_letters:
        problems.append(f"dead letters from a clean fleet: {dict(view.dead_letters)}; e.g. "
                        + "; ".join(view.dead_letter_examples))

    # The archive: every acknowledged event once (episodes and sandbox-level streams).
    archived_ok = None
    if "events" in archive:
        mine = set(sandboxes)
        rows: dict[tuple[str, str | None], Counter[tuple[int, str]]] = {}
        for sb, ep, seq, eid, n in archive["events"]:
            if sb in mine:
                rows.setdefault((sb, ep), Counter())[(seq, eid)] += n
        want_rows: dict[tuple[str, str | None], list[tuple[int, str]]] = {
            (s, ep): list(r.acked) for (_t, s, ep), r in expected.items()}
        for sb, stream in manifest.sandbox_streams.items():
            want_rows[(sb, None)] = [(int(seq), str(eid)) for seq, eid in stream]
        bad = 0
        for key, want in sorted(want_rows.items(), key=lambda kv: (kv[0][0], kv[0][1] or "")):
            have = rows.pop(key, Counter())
            wanted = {(int(seq), str(eid)) for seq, eid in want}
            missing = sorted(wanted - set(have))
            dups = sorted(k for k, n in have.items() if n > 1)
            extra = sorted(set(have) - wanted)
            if missing or dups or extra:
                bad += 1
                if bad <= 5:
                    problems.append(f"archive {key[0]}/{key[1] or '(sandbox)'}: "
                                    f"{len(missing)} missing, {len(dups)} duplicated, "
                                    f"{len(extra)} unexpected rows")
        for key in sorted(rows, key=lambda k: (k[0], k[1] or ""))[:5]:
            problems.append(f"archive has rows of {key[0]}/{key[1]} that nobody acknowledged")
        if bad > 5:
            problems.append(f"... and {bad - 5} more archived streams differ")
        archived_ok = bad == 0 and not rows

    print("\n=== trajbus demo summary ===")
    print(f"elapsed: {elapsed:.1f}s; first replay segment reached the trainer after "
          f"{view.first_segment_s or float('nan'):.2f}s")
    if faults is not None and faults.log:
        print("faults injected: " + "; ".join(faults.log))
    print(f"trainer view: {exact}/{len(expected)} episodes exactly equal to what the emitters "
          f"acknowledged (in order, no duplicates); {len(view.truncated)} truncated "
          f"(crashed/recycled), {len(view.gappy)} with gap markers")
    print(f"replay topics (raw): {twice} events more than once, {false_gaps} false gaps")
    print("events by kind at the trainer: " +
          ", ".join(f"{k}={v}" for k, v in view.kinds.most_common()))
    nonloops = sum(1 for e in manifest.episodes if e.behaviour == "nonloop")
    print(f"watchdog: {len(caught & planted)}/{len(planted)} planted loops caught, "
          f"{len(false_alarms)} false alarms ({nonloops} look-alike non-loops left alone); "
          f"alerts {dict(view.alerts)}")
    print(f"scheduler decisions: {dict(view.decisions)}; {len(crashed)} sandboxes crashed on "
          "purpose" + (f"; {outage_losses} RECYCLE_WITH_LOSS from the injected faults "
                       f"(downstream confirmed after the {drain_window_s:.0f}s drain window "
                       "had ended, as the log shows)" if outage_losses else ""))
    print(f"dead letters: {dict(view.dead_letters) or 'none'}; anomalies: "
          f"{len(view.anomalies) or 'none'}")
    stats = archive.get("stats")
    print(f"archive: {archive.get('url')} ({archive.get('seconds', 0):.1f}s; {stats})"
          + ("" if archived_ok is None else
             "; every acknowledged event archived once" if archived_ok else "; NOT exact"))
    if "rows" in archive:
        print(f"  sample query: trajbus archive sql \"{archive['query']}\"")
        for row in archive["rows"]:
            print("   ", " | ".join(str(c) for c in row))
    if "context" in archive:
        ctx, on_topics = archive["context"], archive["topics"]
        same = all(set(ctx[v]) == on_topics[v] for v in on_topics)
        by = Counter(ctx["decisions"].values())
        print(f"  decision context: {len(ctx['decisions'])} decisions ({dict(by)}), "
              f"{len(ctx['alerts'])} alerts, {len(ctx['dead_letters'])} dead letters"
              + ("; the same as on their topics" if same else "; NOT the topics'"))
        print("  episode endings: " + ", ".join(
            f"{e}{f' ({t})' if t else ''}={n}" for (e, t), n in sorted(
                archive["endings"].items(), key=lambda kv: (kv[0][0], kv[0][1] or ""))))
        stuck = sum(n for (e, _), n in archive["endings"].items() if e == "in_progress")
        if stuck:  # every sandbox was recycled: no episode of theirs can still be running
            problems.append(f"archive: {stuck} episodes still in_progress after every sandbox "
                            "was recycled")
        for v in on_topics:
            if set(ctx[v]) != on_topics[v]:
                problems.append(f"archive {v}: {len(set(ctx[v]) - on_topics[v])} not on the "
                                f"topic, {len(on_topics[v] - set(ctx[v]))} missing")
    elif "error" in archive:
        problems.append(f"archive query failed: {archive['error']}")
    if waterfall:
        print(f"step-time waterfall of one episode: {waterfall}")
    if problems:
        print(f"\nPROBLEMS ({len(problems)}):")
        for p in problems[:40]:
            print(f"  - {p}")
        return 1
    print("\nOK: every acknowledged event reached the trainer once, in order, and the archive "
          "once; every planted loop was caught and nothing else was flagged; every sandbox "
          "drained and recycled; no dead letters, no anomalies.")
    return 0
