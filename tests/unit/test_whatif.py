"""What-if replay (issue 40) on planted logs: the recorded rules reproduce what was recorded
(an empty diff), a lower and a higher loop threshold add and remove the expected terminations
(and the scheduler's follow-up), a shorter and a longer lease add, move and remove reclaims,
a tampered recording fails the self-check loudly, and a wrong question is refused clearly.

Pure: the live adapters fed InRecords (tests/whatif_support.py), no broker.
"""

from __future__ import annotations

import json
import re
import subprocess
from html.parser import HTMLParser
from pathlib import Path

import pytest
from whatif_support import MINUTE, SECOND, T0, Episode, PlantedLog

from trajbus.bus.errors import NotFoundError, UserError
from trajbus.consumers.whatif import Diff, LogFilter, RecordedLog, RuleError, Rules, whatif
from trajbus.consumers.whatif.render import render_html, render_json, render_table

pytestmark = pytest.mark.timeout(120)


def loop_log() -> tuple[PlantedLog, RecordedLog]:
    """sb-loop: 24 identical clicks 10.5 s apart, same result (a loop by the default rule:
    caught at the 20th call, 199.5 s in); sb-near: 17 identical clicks then 3 different ones
    (no loop at 20 repeats, one at 15); sb-fine: all different calls."""
    log = PlantedLog()
    for sb in ("sb-loop", "sb-near", "sb-fine"):
        log.active(sb, T0 - MINUTE)
        for k in range(1, 8):
            log.heartbeat(sb, T0 - MINUTE + k * 4 * MINUTE)
    log.episode(Episode("sb-loop", "ep-1", T0).start().calls_(24).end())
    log.episode(Episode("sb-near", "ep-1", T0).start().calls_(17).calls_(3, args="*").end(),
                partition=1)
    log.episode(Episode("sb-fine", "ep-1", T0).start().calls_(24, args="*").end(),
                partition=1)
    log.ticks(T0 - MINUTE, T0 + 28 * MINUTE)
    return log, log.recorded()


def changes(diff: Diff) -> set[tuple[str, str, str, str]]:
    return {(c.change, c.sandbox, c.processor, c.label) for c in diff.changes}


def test_the_recorded_rules_reproduce_every_recorded_output_and_give_an_empty_diff() -> None:
    log, rec = loop_log()
    labels = sorted((d.producer_id, d.label) for d in rec.recorded)
    assert ("trajbus.watchdog", "LOOP") in labels and ("trajbus.scheduler", "TERMINATE") in labels
    diff = whatif(rec, {}, settings=log.settings)
    assert diff.self_check.passed and diff.self_check.compared == len(rec.recorded)
    assert diff.self_check.reproduced == len(rec.recorded)
    assert diff.empty and diff.totals()["unchanged"] == len(rec.recorded)
    assert "self-check passed" in render_table(diff).splitlines()[0]
    assert "no difference" in render_table(diff)


def test_a_lower_repeat_threshold_terminates_the_near_loop_and_catches_the_loop_sooner() -> None:
    log, rec = loop_log()
    diff = whatif(rec, {"watchdog.loop_min_repeats": 15}, settings=log.settings)
    assert diff.self_check.passed
    got = changes(diff)
    # the near-loop is now a loop: alert, watchdog TERMINATE, and the scheduler acts on the
    # new alert (the changed watchdog's alerts reach the re-run scheduler)
    assert {("added", "sb-near", "watchdog", "LOOP"), ("added", "sb-near", "watchdog",
            "TERMINATE"), ("added", "sb-near", "scheduler", "TERMINATE")} <= got
    # the loop is caught 5 calls (5 x 10.5 s) sooner, at the 15th call
    (loop,) = [c for c in diff.changes if (c.sandbox, c.label) == ("sb-loop", "LOOP")]
    assert loop.change == "moved" and loop.shift_ms == -52_500
    assert loop.seq_before is not None and loop.seq_after == loop.seq_before - 10
    assert loop.detect_before_ms == 199_500 and loop.detect_delta_ms == -52_500
    # ... and so is the scheduler's TERMINATE that follows it (the moved alert reaches it)
    (term,) = [c for c in diff.changes
               if (c.sandbox, c.processor, c.label) == ("sb-loop", "scheduler", "TERMINATE")]
    assert term.change == "moved" and term.shift_ms is not None and term.shift_ms < -30_000
    assert not any(c.sandbox == "sb-fine" for c in diff.changes)  # progress is left alone
    t = diff.totals()
    assert t["mean_detect_delta_ms"] == -52_500 and t["by_label"]["added"]["LOOP"] == 1
    assert "52.5 s sooner" in render_table(diff)


@pytest.mark.parametrize("rule", [{"loop_min_repeats": 25}, {"loop_min_span_ms": "5m"}])
def test_a_higher_threshold_or_longer_window_misses_the_loop(rule: dict[str, object]) -> None:
    log, rec = loop_log()
    diff = whatif(rec, rule, settings=log.settings)
    assert diff.self_check.passed
    got = changes(diff)
    assert {("removed", "sb-loop", "watchdog", "LOOP"),
            ("removed", "sb-loop", "watchdog", "TERMINATE"),
            ("removed", "sb-loop", "watchdog", "LOOP_ENDED"),
            ("removed", "sb-loop", "scheduler", "TERMINATE")} <= got
    assert not any(c.change == "added" and c.processor == "watchdog" for c in diff.changes)
    assert not any(c.sandbox in ("sb-near", "sb-fine") and c.processor == "watchdog"
                   for c in diff.changes)
    (loop,) = [c for c in diff.changes if (c.sandbox, c.label) == ("sb-loop", "LOOP")]
    assert loop.detect_before_ms == 199_500 and loop.detect_after_ms is None


def lease_log(ttl: int = 600_000) -> tuple[PlantedLog, RecordedLog]:
    """sb-steady: a heartbeat every 4 min; sb-gap: the same with a 12-min gap (4 .. 16 min).
    Heartbeats ask for a lease of ``ttl``."""
    log = PlantedLog()
    log.active("sb-steady", T0)
    log.active("sb-gap", T0)
    for k in range(1, 9):
        log.heartbeat("sb-steady", T0 + k * 4 * MINUTE, ttl)
    for k in (1, 4, 5, 6, 7, 8):
        log.heartbeat("sb-gap", T0 + k * 4 * MINUTE, ttl)
    log.ticks(T0, T0 + 34 * MINUTE)
    return log, log.recorded()


def reclaims(diff: Diff) -> dict[str, tuple[str, int | None]]:
    return {c.sandbox: (c.change, c.shift_ms) for c in diff.changes if c.label == "RECLAIM"}


def test_a_shorter_lease_reclaims_the_steady_sandbox_and_the_gap_sooner() -> None:
    log, rec = lease_log()
    assert [(d.label, d.record["header"]["sandbox"], d.time_ms) for d in rec.recorded
            if d.label == "RECLAIM"] == [("RECLAIM", "sb-gap", T0 + 14 * MINUTE + 1)]
    diff = whatif(rec, Rules.parse(["scheduler.lease_ttl_ms=3m"]), settings=log.settings)
    assert diff.self_check.passed
    # the steady sandbox beats every 4 min: a 3-min lease runs out first (T0+1s+3m+1ms)
    assert reclaims(diff) == {"sb-steady": ("added", None),
                              "sb-gap": ("moved", (3 * MINUTE + SECOND + 1)
                                         - (14 * MINUTE + 1))}
    assert diff.rules == [("scheduler.lease_ttl_ms", 600_000, 180_000)]


def test_a_longer_lease_removes_the_reclaim_of_the_gap() -> None:
    """The lease is the shortest of what the heartbeat asks (20 min here), lease_ttl_ms and
    missed_heartbeats_to_reclaim x heartbeat_interval_ms: 15 min and 3 x 5 min cover the 12-min
    gap."""
    log, rec = lease_log(ttl=20 * MINUTE)
    assert {d.label for d in rec.recorded if d.record["header"]["sandbox"] == "sb-gap"} \
        >= {"RECLAIM"}
    diff = whatif(rec, {"lease_ttl_ms": "15m", "missed_heartbeats_to_reclaim": "3"},
                  settings=log.settings)
    assert diff.self_check.passed
    assert reclaims(diff) == {"sb-gap": ("removed", None)}
    assert {c.sandbox for c in diff.changes} == {"sb-gap"}


def test_a_tampered_recording_fails_the_self_check_loudly() -> None:
    log, rec = loop_log()
    dropped = next(d for d in rec.recorded if d.label == "TERMINATE")
    rec.recorded.remove(dropped)
    diff = whatif(rec, {}, settings=log.settings)
    assert not diff.self_check.passed
    (m,) = diff.self_check.mismatches
    assert (m.kind, m.event_id) == ("reproduced_not_recorded", dropped.event_id)
    text = render_table(diff)
    assert text.startswith("SELF-CHECK FAILED") and dropped.event_id[:8] in text
    assert json.loads(render_json(diff))["self_check"]["passed"] is False


def test_the_filter_narrows_the_diff_and_the_self_check() -> None:
    log, rec = loop_log()
    diff = whatif(rec, {"loop_min_repeats": 15}, settings=log.settings,
                  where=LogFilter(sandbox="sb-near"))
    assert {c.sandbox for c in diff.changes} == {"sb-near"}
    assert diff.self_check.compared == sum(
        d.record["header"]["sandbox"] == "sb-near" for d in rec.recorded)
    late = whatif(rec, {"loop_min_repeats": 15}, settings=log.settings,
                  where=LogFilter(from_ms=T0 + 30 * SECOND, to_ms=T0 + 3 * MINUTE))
    assert late.changes and all(T0 + 30 * SECOND <= c.time_ms <= T0 + 3 * MINUTE
                                for c in late.changes)


def test_wrong_questions_are_refused_with_what_exists() -> None:
    log, rec = loop_log()
    with pytest.raises(NotFoundError, match="sb-nope") as e:
        whatif(rec, {}, settings=log.settings, where=LogFilter(sandbox="sb-nope"))
    assert "sb-loop" in str(e.value)  # the hint lists the sandboxes that exist
    with pytest.raises(NotFoundError, match="task"):
        whatif(rec, {}, settings=log.settings, where=LogFilter(task="no-such-task"))
    with pytest.raises(UserError, match="no input event") as e:
        whatif(rec, {}, settings=log.settings,
               where=LogFilter(from_ms=T0 + 10 * 3_600_000))
    assert "the log's events run from" in str(e.value)
    with pytest.raises(RuleError, match="unknown rule") as e:
        whatif(rec, {"loop_min_repeat": 15}, settings=log.settings)
    assert "loop_min_repeats" in str(e.value)  # the nearest names
    with pytest.raises(RuleError, match="reorder rule"):
        Rules.parse(["replay.gap_timeout_ms=10s"])
    with pytest.raises(RuleError, match="loop_min_repeats must be >= 2"):
        Rules.parse(["watchdog.loop_min_repeats=1"])
    with pytest.raises(RuleError, match="NAME=VALUE"):
        Rules.parse(["loop_min_repeats"])
    with pytest.raises(NotFoundError, match="no input records"):
        whatif(RecordedLog({}), {}, settings=log.settings)


def test_rules_from_flags_and_files(tmp_path: Path) -> None:
    assert Rules.parse(["loop_min_span_ms=90s", "scheduler.lease-ttl-ms=15m"]).changes == {
        "watchdog.loop_min_span_ms": 90_000, "scheduler.lease_ttl_ms": 900_000}
    f = tmp_path / "rules.toml"
    f.write_text("[watchdog]\nloop_min_repeats = 30\ndry_run = true\n")
    assert Rules.parse([], f).changes == {"watchdog.loop_min_repeats": 30,
                                          "watchdog.dry_run": True}
    j = tmp_path / "rules.json"
    j.write_text('{"watchdog.loop_min_repeats": 30, "watchdog": {"max_cycle_length": 2}}')
    assert Rules.parse(["loop_min_repeats=12"], j).changes == {
        "watchdog.loop_min_repeats": 12, "watchdog.max_cycle_length": 2}  # flags win
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(RuleError, match="cannot read rules file"):
        Rules.parse([], bad)


class _Structure(HTMLParser):
    """Checks that every element opened is closed, in order (void elements aside)."""

    VOID = frozenset({"meta", "br", "img", "hr", "link", "input"})

    def __init__(self) -> None:
        super().__init__()
        self.stack: list[str] = []
        self.errors: list[str] = []
        self.ids: set[str] = set()
        self.rows = 0

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.ids.update(v for k, v in attrs if k == "id" and v)
        self.rows += tag == "tr"
        if tag not in self.VOID:
            self.stack.append(tag)

    def handle_endtag(self, tag: str) -> None:
        if not self.stack or self.stack[-1] != tag:
            self.errors.append(f"</{tag}> closes {self.stack[-1:] or 'nothing'}")
        else:
            self.stack.pop()


def test_the_html_report_is_self_contained_and_well_formed() -> None:
    log, rec = loop_log()
    diff = whatif(rec, {"watchdog.loop_min_repeats": 15}, settings=log.settings)
    page = render_html(diff)
    parser = _Structure()
    parser.feed(page)
    parser.close()
    assert parser.errors == [] and parser.stack == []
    assert {"self-check", "rules", "totals", "sandbox-sb-near", "sandbox-sb-loop"} <= parser.ids
    assert parser.rows >= 3 + len(diff.changes)
    assert "<script" not in page.lower()
    assert not re.search(r"(src|href)\s*=\s*[\"']?(https?:)?//", page)  # nothing fetched


def test_the_html_report_renders_in_headless_chromium(tmp_path: Path) -> None:
    from trajbus.consumers.operator.waterfall import chromium_command, find_chromium

    binary = find_chromium()
    if binary is None:
        pytest.skip("no headless Chromium on PATH (CI: apt-get install -y "
                    "chromium-headless-shell, or set TRAJBUS_CHROMIUM)")
    log, rec = loop_log()
    diff = whatif(rec, {"watchdog.loop_min_repeats": 15}, settings=log.settings)
    page = tmp_path / "whatif.html"
    page.write_text(render_html(diff), encoding="utf-8")
    proc = subprocess.run(
        chromium_command(binary, tmp_path / "profile", "--dump-dom", page.as_uri()),
        capture_output=True, timeout=90, check=False)
    assert proc.returncode == 0, proc.stderr.decode(errors="replace")[-2000:]
    text = re.sub(r"\s+", " ", re.sub(r"<[^>]+>", " ", proc.stdout.decode()))
    for expected in ("self-check passed", "watchdog.loop_min_repeats", "Sandbox sb-near",
                     "Sandbox sb-loop", "52.5 s sooner", "TERMINATE"):
        assert expected in text, expected


def _cli(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
         rec: RecordedLog, *argv: str) -> tuple[int, str, str]:
    """``trajbus whatif ...`` in this process, its log read from ``rec`` instead of Kafka."""
    from trajbus import cli
    from trajbus.consumers.whatif import source

    async def planted(*_: object, **kw: object) -> RecordedLog:
        note = kw.get("progress")
        if callable(note):
            note("reading (planted)")
        return rec

    monkeypatch.setattr(source, "read_kafka_log", planted)
    monkeypatch.setenv("TRAJBUS_TOPICS__PREFIX", "t")
    from trajbus.bus.settings import get_settings

    get_settings.cache_clear()
    try:
        with pytest.raises(SystemExit) as exit_:
            cli.main(["whatif", *argv])
    finally:
        get_settings.cache_clear()
    out = capsys.readouterr()
    return int(exit_.value.code or 0), out.out, out.err


def test_the_command_prints_the_self_check_first_and_exits_3_when_it_fails(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
        tmp_path: Path) -> None:
    _, rec = loop_log()
    code, out, err = _cli(monkeypatch, capsys, rec, "--set", "loop_min_repeats=15",
                          "--html", str(tmp_path / "r.html"))
    assert code == 0, err
    assert out.startswith("self-check passed") and "sandbox sb-near" in out
    assert "reading (planted)" in err and "HTML report written" in err
    assert (tmp_path / "r.html").read_text().startswith("<!DOCTYPE html>")

    rec.recorded.pop()  # a recorded output the re-run will not find among the recorded
    code, out, err = _cli(monkeypatch, capsys, rec, "--json", "--quiet")
    assert code == 3 and "the self-check failed" in err
    assert json.loads(out)["self_check"]["passed"] is False

    code, out, err = _cli(monkeypatch, capsys, rec, "--set", "no_such_rule=1")
    assert code == 1 and "unknown rule 'no_such_rule'" in err and "Traceback" not in err


def test_progress_is_reported_per_stage_up_to_the_total() -> None:
    log, rec = loop_log()
    seen: list[tuple[str, int, int]] = []
    whatif(rec, {"loop_min_repeats": 15}, settings=log.settings,
           progress=lambda stage, done, total: seen.append((stage, done, total)))
    finished = [(s, d) for s, d, t in seen if d == t]
    assert [s for s, _ in finished] == ["recorded rules: watchdog", "recorded rules: scheduler",
                                        "changed rules: watchdog", "changed rules: scheduler"]
