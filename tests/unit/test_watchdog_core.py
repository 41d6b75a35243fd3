"""Specification of the watchdog core (issue 5): canonical call identity, the loop rule, the stall
rule, bounded state, restart safety, determinism and dead letters."""

from __future__ import annotations

import json
import tracemalloc
from collections.abc import Iterable
from hashlib import sha256
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from trajbus.bus.settings import WatchdogSettings
from trajbus.consumers.watchdog.canonical import (
    CanonicalError,
    Canonicalizer,
    canonical_hash,
    canonical_json,
)
from trajbus.consumers.watchdog.core import (
    AlertOut,
    DeadLetterOut,
    DecisionOut,
    Output,
    WatchdogCore,
    output_event_id,
    state_key,
    to_model,
)

T0 = 1_700_000_000_000
IGNORED = ("timestamp", "ts", "request_id", "nonce", "trace_id")
Event = tuple[str, dict[str, Any]]


# -- a tiny event simulator -----------------------------------------------------------------
class Episode:
    """Builds the decoded event dicts of one episode, as the emitter would (canonical args
    *including* noise fields: the emitter does not know the watchdog's ignore list)."""

    def __init__(self, sandbox: str = "sb-1", episode: str | None = "ep-1", task: str = "web",
                 t0: int = T0) -> None:
        self.sandbox, self.episode, self.task = sandbox, episode, task
        self.seq = 0
        self.t = t0
        self.calls = 0
        self.open: list[tuple[str, str]] = []

    def header(self, dt: int) -> dict[str, Any]:
        self.t += dt
        h = {"event_id": f"e-{self.sandbox}-{self.episode}-{self.seq}", "task": self.task,
             "sandbox": self.sandbox, "episode": self.episode, "seq": self.seq,
             "event_time_ms": self.t, "producer_id": "sidecar-1", "policy_version": None}
        self.seq += 1
        return h

    def start(self) -> Event:
        return "EpisodeStart", {"header": self.header(0), "tenant": None, "env_snapshot": None,
                                "context": {}}

    def end(self, dt: int = 1000) -> Event:
        return "EpisodeEnd", {"header": self.header(dt), "outcome": "TRUNCATED", "reason": "",
                              "reward": None}

    def call(self, tool: str, args: Any, dt: int = 1000, *, canonical: bool = True,
             text: str | None = None) -> Event:
        cid = f"c{self.calls}"
        self.calls += 1
        self.open.append((cid, tool))
        rec = {"header": self.header(dt), "call_id": cid, "tool": tool,
               "args_hash": canonical_hash(args),
               "args_canonical": text if text is not None
               else (canonical_json(args) if canonical else None),
               "args_summary": ""}
        return "ToolCall", rec

    def result(self, value: Any, status: str = "OK", dt: int = 200) -> Event:
        cid, tool = self.open.pop(0)
        text = Canonicalizer().json_value(value)  # a str result is a JSON string value
        return "ToolResult", {"header": self.header(dt), "call_id": cid, "tool": tool,
                              "status": status, "result_hash": sha256(text.encode()).hexdigest(),
                              "result_canonical": text, "result_summary": "",
                              "duration_ms": dt}

    def pair(self, tool: str, args: Any, result: Any, dt: int = 1000) -> list[Event]:
        return [self.call(tool, args, dt), self.result(result)]


def run(core: WatchdogCore, events: Iterable[Event]) -> list[Output]:
    out: list[Output] = []
    for kind, rec in events:
        out.extend(core.handle(kind, rec))
    return out


def alerts(outs: Iterable[Output], kind: str | None = None) -> list[AlertOut]:
    return [o for o in outs if isinstance(o, AlertOut) and (kind is None or o.alert == kind)]


def decisions(outs: Iterable[Output]) -> list[DecisionOut]:
    return [o for o in outs if isinstance(o, DecisionOut)]


def looping(ep: Episode, pattern: list[tuple[str, Any]], cycles: int, dt: int = 5000,
            result: Any = "same page", noise: bool = False) -> list[Event]:
    events: list[Event] = []
    for i in range(cycles):
        for tool, args in pattern:
            a = dict(args, timestamp=T0 + i, request_id=f"req-{ep.seq}") if noise else args
            events += ep.pair(tool, a, result, dt)
    return events


CLICK = ("browser.click", {"selector": "#submit", "page": 1})
TYPE = ("browser.type", {"selector": "#q", "text": "hello"})
SHELL = ("shell", {"cmd": "curl http://10.0.0.7/health", "timeout": 30})


# -- canonical JSON -------------------------------------------------------------------------
class TestCanonical:
    def test_key_order_whitespace_and_number_spelling_do_not_matter(self) -> None:
        a = '{"b": [1, 2.0, 1e0], "a": {"y": 1.50, "x": -0.0}}'
        b = {"a": {"x": 0, "y": 1.5}, "b": [1, 2, 1]}
        assert canonical_json(a) == canonical_json(b) == '{"a":{"x":0,"y":1.5},"b":[1,2,1]}'
        assert canonical_hash(a) == canonical_hash(b)
        assert canonical_json(1e20) == "100000000000000000000" == canonical_json(10**20)
        assert canonical_json("[true,false,null]") == "[true,false,null]"

    def test_ignored_fields_are_removed_at_any_depth(self) -> None:
        v = {"ts": 1, "a": [{"nonce": "x", "k": {"request_id": 7, "v": 1}}], "b": {"ts": {}}}
        assert canonical_json(v, IGNORED) == '{"a":[{"k":{"v":1}}],"b":{}}'
        # values are never inspected
        assert canonical_json({"a": "ts"}, IGNORED) == '{"a":"ts"}'

    def test_accepts_json_text_and_bytes(self) -> None:
        assert canonical_json(b'{"b":1,"a":2}') == canonical_json('{"a":2, "b":1}')

    @pytest.mark.parametrize(("bad", "code"), [
        ('{"a": NaN}', "non_finite"), ("{", "invalid_json"), (float("inf"), "non_finite"),
        ({1: 2}, "bad_key"), (object(), "unsupported_type"), (b"\xff", "invalid_json"),
    ])
    def test_invalid_values_raise_canonical_error(self, bad: Any, code: str) -> None:
        with pytest.raises(CanonicalError) as info:
            canonical_json(bad)
        assert info.value.reason_code == code

    def test_strip_canonical_handles_nested_and_escaped_values(self) -> None:
        c = Canonicalizer(IGNORED)
        v = {"a": 1, "nonce": 'a\\"b', "request_id": 3, "ts": {"z": [1]},
             "z": [{"q": 'x,"ts":1', "ts": 1.5e-7}]}
        text = canonical_json(v)
        assert c.strip_canonical(text) == canonical_json(v, IGNORED)
        assert c.strip_canonical('{"a":1}') == '{"a":1}'

    json_values = st.recursive(
        st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False,
                                                             allow_infinity=False)
        | st.text(alphabet=st.sampled_from('ab"\\,:{}ts é\n')),
        lambda children: st.lists(children, max_size=4)
        | st.dictionaries(st.sampled_from(["a", "b", "ts", "nonce", "x,", 'q"']), children,
                          max_size=4),
        max_leaves=20,
    )

    @given(json_values)
    @settings(max_examples=300)
    def test_properties(self, v: Any) -> None:
        v = {"v": v}  # a top-level str would be read as JSON text
        text = canonical_json(v)
        assert canonical_json(text) == text  # idempotent
        assert json.loads(text) == json.loads(canonical_json(json.dumps(v, indent=2)))
        c = Canonicalizer(IGNORED)
        assert c.strip_canonical(text) == canonical_json(v, IGNORED)  # fast path == slow path
        assert c.digest_canonical(text).hex() == canonical_hash(v, IGNORED)


# -- the loop rule: true loops ----------------------------------------------------------------
class TestTrueLoops:
    def test_same_call_20_times_over_2_minutes_fires_once_with_evidence(self) -> None:
        ep = Episode()
        core = WatchdogCore()
        outs = run(core, [ep.start(), *looping(ep, [SHELL], 40, dt=10_000)])
        [loop] = alerts(outs, "LOOP")
        [kill] = decisions(outs)
        assert loop.pattern == (f"shell:{canonical_hash(SHELL[1])}",)
        assert loop.repeat_count == 20 and loop.distinct_results == 0
        assert loop.first_seq == 1 and loop.last_seq == 39  # 20th call (seq 1, 3, ..., 39)
        assert loop.span_ms == 19 * 10_200 and loop.span_ms >= 120_000
        assert not loop.dry_run and "20 times" in loop.reason
        assert kill.decision == "TERMINATE" and kill.suspicious
        assert loop.event_id in kill.cause_event_ids
        assert dict(kill.details)["pattern"] == loop.pattern[0]

    @pytest.mark.parametrize("pattern", [[CLICK, TYPE], [CLICK, TYPE, SHELL]],
                             ids=["cycle2", "cycle3"])
    def test_cycles_of_length_2_and_3(self, pattern: list[tuple[str, Any]]) -> None:
        ep = Episode()
        core = WatchdogCore()
        outs = run(core, looping(ep, pattern, 30, dt=4000))
        [loop] = alerts(outs, "LOOP")
        assert len(loop.pattern) == len(pattern)
        assert loop.pattern == tuple(f"{t}:{canonical_hash(a)}" for t, a in pattern)
        assert loop.repeat_count == 20 and loop.first_seq == 0
        assert len(decisions(outs)) == 1

    def test_repeating_a_within_a_cycle_is_reported_as_the_shortest_cycle(self) -> None:
        core = WatchdogCore()
        outs = run(core, looping(Episode(), [CLICK, CLICK], 20, dt=10_000))
        [loop] = alerts(outs, "LOOP")
        assert len(loop.pattern) == 1 and loop.repeat_count == 20

    @pytest.mark.parametrize("pattern", [[SHELL], [CLICK, TYPE], [CLICK, TYPE, SHELL]])
    def test_noise_fields_are_ignored(self, pattern: list[tuple[str, Any]]) -> None:
        ep = Episode()
        events = looping(ep, pattern, 25, dt=5000, noise=True)
        hashes = {rec["args_hash"] for kind, rec in events if kind == "ToolCall"}
        assert len(hashes) == len(events) // 2  # every call differs before canonicalisation
        [loop] = alerts(run(WatchdogCore(), events), "LOOP")
        # the evidence hash is the canonical hash without the ignored fields
        assert loop.pattern == tuple(f"{t}:{canonical_hash(a)}" for t, a in pattern)

    def test_untrusted_canonical_text_is_recanonicalised(self) -> None:
        ep = Episode()
        events: list[Event] = []
        for i in range(25):
            text = (f'{{ "timeout": {30 + (i % 2) * 0.0}, "cmd" : "ls", "nonce": {i} }}'
                    if i % 2 else f'{{"cmd":"ls","timeout":3e1,"ts":{i}}}')
            events += [ep.call("shell", {"x": i}, 6000, text=text), ep.result("out")]
        assert alerts(run(WatchdogCore(trust_canonical=True), events), "LOOP") == []
        [loop] = alerts(run(WatchdogCore(trust_canonical=False), events), "LOOP")
        assert loop.pattern == (f"shell:{canonical_hash({'cmd': 'ls', 'timeout': 30})}",)

    def test_calls_without_canonical_text_use_args_hash(self) -> None:
        ep = Episode()
        events: list[Event] = []
        for _ in range(25):
            events += [ep.call(*SHELL, dt=6000, canonical=False), ep.result("x")]
        assert len(alerts(run(WatchdogCore(), events), "LOOP")) == 1

    def test_error_results_count_as_unchanged_results(self) -> None:
        ep = Episode()
        events: list[Event] = []
        for _ in range(25):  # retrying a dead IP: same timeout every time
            events += [ep.call(*SHELL, dt=6000), ep.result(None, status="TIMEOUT")]
        assert len(alerts(run(WatchdogCore(), events), "LOOP")) == 1


# -- the loop rule: not loops ------------------------------------------------------------------
class TestNotLoops:
    def test_button_clicked_until_the_page_changes(self) -> None:
        """Clicking "next" for 10 minutes is progress as long as the page keeps changing (here
        every 5th click), and clicking until the page loads is not a loop either."""
        ep = Episode()
        events: list[Event] = []
        for i in range(60):
            events += ep.pair(*CLICK, result={"page": i // 5}, dt=10_000)
        for i in range(19):
            events += ep.pair(*TYPE, result="loading" if i < 18 else "ready", dt=10_000)
        events += ep.pair(*SHELL, result="ok")
        assert run(WatchdogCore(), events) == []

    def test_results_that_keep_changing(self) -> None:
        ep = Episode()
        events: list[Event] = []
        for i in range(60):
            events += ep.pair(*SHELL, result={"progress": i // 2}, dt=5000)  # changes every 2nd
        assert run(WatchdogCore(), events) == []

    def test_a_result_change_restarts_the_count(self) -> None:
        ep = Episode()
        events = looping(ep, [CLICK], 15, dt=10_000, result="a")
        events += looping(ep, [CLICK], 15, dt=10_000, result="b")
        core = WatchdogCore()
        assert run(core, events) == []
        [expl] = core.explain("sb-1")
        [c1] = [c for c in expl.candidates if c.cycle_length == 1]
        assert c1.repeat_count == 15 and c1.since == "a result changed"
        assert any(b.startswith("repeats 15 < 20") for b in c1.blockers)
        assert expl.verdict == "no loop"

    def test_repetition_shorter_than_two_minutes(self) -> None:
        core = WatchdogCore()
        assert run(core, looping(Episode(), [SHELL], 100, dt=1000)) == []  # 100 calls, ~110 s
        [expl] = core.explain("sb-1")
        c1 = expl.candidates[0]
        assert c1.repeat_count == 100 and c1.blockers == (f"span {c1.span_ms} ms < 120000 ms",)

    def test_interrupted_by_another_call(self) -> None:
        ep = Episode()
        events = looping(ep, [SHELL], 15, dt=10_000)
        events += ep.pair(*TYPE, result="ok", dt=10_000)
        events += looping(ep, [SHELL], 15, dt=10_000)
        assert run(WatchdogCore(), events) == []

    def test_cycle_interrupted(self) -> None:
        ep = Episode()
        events = looping(ep, [CLICK, TYPE], 12, dt=10_000)
        events += ep.pair(*TYPE, result="same page", dt=10_000)  # A,B,...,A,B,B
        events += looping(ep, [CLICK, TYPE], 12, dt=10_000)
        assert run(WatchdogCore(), events) == []

    def test_fewer_than_20_repeats(self) -> None:
        assert run(WatchdogCore(), looping(Episode(), [SHELL], 19, dt=60_000)) == []
        assert run(WatchdogCore(), looping(Episode(), [CLICK, TYPE], 19, dt=60_000)) == []

    def test_different_episodes_and_sandboxes_are_separate(self) -> None:
        events: list[Event] = []
        eps = [Episode("sb-1", "e1"), Episode("sb-1", "e2"), Episode("sb-2", "e1")]
        for _ in range(12):
            for ep in eps:
                events += ep.pair(*SHELL, result="x", dt=20_000)
        assert run(WatchdogCore(), events) == []

    @given(st.data())
    @settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
    def test_property_non_repeating_streams_never_fire(self, data: st.DataObject) -> None:
        """Calls whose arguments never repeat, with any tools, timings and results, never fire
        -- even with aggressive thresholds."""
        core = WatchdogCore(WatchdogSettings(loop_min_repeats=2, loop_min_span_ms=0))
        ep = Episode()
        n = data.draw(st.integers(1, 120))
        tools = data.draw(st.lists(st.sampled_from(["a", "b", "c"]), min_size=n, max_size=n))
        gaps = data.draw(st.lists(st.integers(0, 600_000), min_size=n, max_size=n))
        results = data.draw(st.lists(st.sampled_from(["x", "y", None]), min_size=n, max_size=n))
        events: list[Event] = []
        for i in range(n):
            events.append(ep.call(tools[i], {"i": i, "ts": gaps[i]}, gaps[i]))
            if results[i] is not None:
                events.append(ep.result(results[i]))
        assert alerts(run(core, events)) == []


# -- the loop rule against a brute-force oracle ------------------------------------------------
def oracle(calls: list[str], times: list[int], repeats: int, span: int, m: int) -> list[tuple]:
    """Reference semantics for result-free streams: LOOP at call n when, for the smallest L
    whose maximal periodic run ending at n has a primitive pattern, >= repeats occurrences and
    >= span ms; LOOP_ENDED at the call that breaks the active loop's period."""
    out: list[tuple] = []
    active = 0
    for n in range(len(calls)):
        if active and calls[n] != calls[n - active]:
            out.append(("LOOP_ENDED", n, active))
            active = 0
        if active:
            continue
        for length in range(1, m + 1):
            s = max(0, n - length + 1)
            while s > 0 and s - 1 + length <= n and calls[s - 1] == calls[s - 1 + length]:
                s -= 1
            pat = calls[s:s + length]
            primitive = len(pat) == length and all(
                pat != pat[d:] + pat[:d] for d in range(1, length) if length % d == 0)
            if ((n - s + 1) // length >= repeats and times[n] - times[s] >= span
                    and primitive):
                out.append(("LOOP", n, length))
                active = length
                break
    return out


@given(st.data())
@settings(max_examples=300, deadline=None)
def test_property_matches_reference_semantics(data: st.DataObject) -> None:
    repeats = data.draw(st.integers(2, 4))
    span = data.draw(st.sampled_from([0, 5, 20]))
    m = data.draw(st.integers(1, 3))
    n = data.draw(st.integers(0, 80))
    calls = data.draw(st.lists(st.sampled_from("ABC"), min_size=n, max_size=n))
    gaps = data.draw(st.lists(st.integers(0, 3), min_size=n, max_size=n))
    core = WatchdogCore(WatchdogSettings(loop_min_repeats=repeats, loop_min_span_ms=span,
                                         max_cycle_length=m))
    ep = Episode(t0=0)
    got: list[tuple] = []
    times: list[int] = []
    for i, c in enumerate(calls):
        kind, rec = ep.call(c, {}, gaps[i])
        times.append(rec["header"]["event_time_ms"])
        for a in alerts(core.handle(kind, rec)):
            got.append((a.alert, i, len(a.pattern)))
    assert got == oracle(calls, times, repeats, span, m)


# -- one alert per loop, and the end of a loop -------------------------------------------------
class TestAlertLifecycle:
    def test_no_duplicate_alerts_for_a_long_loop(self) -> None:
        outs = run(WatchdogCore(), looping(Episode(), [CLICK, TYPE], 500, dt=3000))
        assert len(alerts(outs, "LOOP")) == 1 and len(decisions(outs)) == 1
        assert alerts(outs, "LOOP_ENDED") == []

    def test_loop_ended_once_when_the_pattern_breaks(self) -> None:
        ep = Episode()
        events = looping(ep, [SHELL], 30, dt=10_000)
        events += ep.pair(*TYPE, result="ok") + ep.pair(*CLICK, result="ok")
        outs = run(WatchdogCore(), events)
        [loop] = alerts(outs, "LOOP")
        [ended] = alerts(outs, "LOOP_ENDED")
        assert ended.first_seq == loop.first_seq and ended.pattern == loop.pattern
        assert ended.repeat_count == 30 and ended.last_seq == 60
        assert "pattern broken" in ended.reason and ended.event_id != loop.event_id

    def test_loop_ended_when_results_change_then_a_new_loop_alerts_again(self) -> None:
        ep = Episode()
        events = looping(ep, [SHELL], 25, dt=10_000, result="a")
        events += looping(ep, [SHELL], 25, dt=10_000, result="b")
        outs = run(WatchdogCore(), events)
        assert [a.alert for a in alerts(outs)] == ["LOOP", "LOOP_ENDED", "LOOP"]
        first, ended, second = alerts(outs)
        assert "result changed" in ended.reason and ended.distinct_results == 1
        assert second.first_seq == 50 and second.event_id != first.event_id
        assert len(decisions(outs)) == 2

    def test_loop_ended_when_the_episode_ends_and_state_is_dropped(self) -> None:
        ep = Episode()
        core = WatchdogCore()
        outs = run(core, looping(ep, [SHELL], 25, dt=10_000))
        core.take_dirty()
        [ended] = alerts(core.handle(*ep.end()), "LOOP_ENDED")
        assert "episode ended" in ended.reason
        assert core.take_dirty() == {state_key("sb-1", "ep-1"): None}
        assert core.tracked() == 0 and len(alerts(outs)) == 1

    def test_recycled_sandbox_ends_tracking_of_all_its_episodes(self) -> None:
        core = WatchdogCore()
        a, b = Episode("sb-9", "e1"), Episode("sb-9", "e2")
        run(core, looping(a, [SHELL], 25, dt=10_000) + b.pair(*TYPE, result="x"))
        run(core, [Episode("sb-other").call(*SHELL)])
        life = {"header": {"event_id": "l1", "task": "web", "sandbox": "sb-9", "episode": None,
                           "seq": 3, "event_time_ms": T0 + 10**6, "producer_id": "p"},
                "state": "RECYCLED", "previous_state": "DRAINING"}
        outs = core.handle("SandboxLifecycle", life)
        assert [o.alert for o in alerts(outs)] == ["LOOP_ENDED"]
        assert core.tracked() == 1 and core.explain("sb-9") == []

    def test_dry_run_alerts_without_a_decision(self) -> None:
        outs = run(WatchdogCore(WatchdogSettings(dry_run=True)),
                   looping(Episode(), [SHELL], 30, dt=10_000))
        [loop] = alerts(outs, "LOOP")
        assert loop.dry_run and decisions(outs) == []

    def test_per_task_thresholds(self) -> None:
        core = WatchdogCore(per_task={"quick": {"loop_min_repeats": 5, "loop_min_span_ms": 0},
                                      "lenient": {"dry_run": True}})
        quick = run(core, looping(Episode("q", task="quick"), [SHELL], 6, dt=10))
        assert alerts(quick, "LOOP")[0].repeat_count == 5
        lenient = run(core, looping(Episode("l", task="lenient"), [SHELL], 30, dt=10_000))
        assert len(alerts(lenient)) == 1 and decisions(lenient) == []
        with pytest.raises(ValueError, match="unknown watchdog setting"):
            WatchdogCore(per_task={"x": {"loop_min_repeat": 3}})

    def test_allowed_result_changes(self) -> None:
        ep = Episode()
        events: list[Event] = []
        for i in range(30):
            events += ep.pair(*SHELL, result="a" if i < 10 else "b", dt=10_000)
        core = WatchdogCore(WatchdogSettings(loop_max_distinct_results=1))
        [loop] = alerts(run(core, events), "LOOP")
        assert loop.distinct_results == 1 and loop.first_seq == 0


# -- stall rule ---------------------------------------------------------------------------------
class TestStall:
    def test_open_call_without_events_stalls_once(self) -> None:
        core = WatchdogCore(WatchdogSettings(stall_after_ms=60_000))
        ep = Episode()
        kind, rec = ep.call(*SHELL)
        core.handle(kind, rec)
        t = rec["header"]["event_time_ms"]
        assert core.tick(t + 59_999) == []
        [stall] = core.tick(t + 60_000)
        assert isinstance(stall, AlertOut) and stall.alert == "STALL"
        assert stall.first_seq == 0 and stall.span_ms == 60_000
        assert stall.pattern == (f"shell:{canonical_hash(SHELL[1])}",)
        assert core.tick(t + 120_000) == []  # once
        # the call returns, a new call hangs: a new stall alert, with a new id
        run(core, [ep.result("ok"), ep.call(*TYPE)])
        t2 = max(ep.t, t + 120_000)  # timers count from the later of the clock and the event
        assert core.tick(t2 + 59_999) == []
        [again] = core.tick(t2 + 60_000)
        assert again.event_id != stall.event_id

    def test_no_stall_without_an_open_call_or_with_recent_events(self) -> None:
        core = WatchdogCore(WatchdogSettings(stall_after_ms=60_000))
        ep = Episode()
        run(core, ep.pair(*SHELL, result="ok"))
        assert core.tick(ep.t + 10**6) == []
        run(core, [ep.call(*SHELL)])
        assert core.tick(ep.t + 1000) == []

    def test_tick_events_drive_stalls_too(self) -> None:
        core = WatchdogCore(WatchdogSettings(stall_after_ms=60_000))
        ep = Episode()
        run(core, [ep.call(*SHELL)])
        tick = {"header": {"event_id": "t", "task": "", "sandbox": "", "episode": None,
                           "seq": 0, "event_time_ms": ep.t + 60_000, "producer_id": "r"}}
        [stall] = core.handle("Tick", tick)
        assert isinstance(stall, AlertOut) and stall.alert == "STALL"
        assert decisions([stall]) == []

    def test_idle_streams_are_evicted(self) -> None:
        core = WatchdogCore(evict_idle_ms=3_600_000)
        ep = Episode()
        run(core, looping(ep, [SHELL], 25, dt=10_000))
        outs = core.tick(ep.t + 3_600_000)
        assert [a.alert for a in alerts(outs)] == ["LOOP_ENDED"] and core.tracked() == 0


# -- restart safety and determinism -------------------------------------------------------------
def restarted(core: WatchdogCore, **kwargs: Any) -> WatchdogCore:
    fresh = WatchdogCore(**kwargs)
    for key, blob in core.take_dirty().items():
        assert fresh.restore(key, blob) is None
    return fresh


class TestRestart:
    @pytest.mark.parametrize("cut", [5, 24, 37, 38, 39, 41, 60])
    def test_restart_mid_loop_yields_exactly_one_alert(self, cut: int) -> None:
        events = looping(Episode(), [CLICK, TYPE], 20, dt=4000)
        events += looping(Episode("sb-2"), [SHELL], 30, dt=10_000)
        events.sort(key=lambda e: e[1]["header"]["event_time_ms"])
        core = WatchdogCore()
        outs = run(core, events[:cut])
        core2 = restarted(core)
        outs += run(core2, events[max(0, cut - 10):])  # redelivery of the last 10 events
        assert len(alerts(outs, "LOOP")) == 2 and len(decisions(outs)) == 2
        assert outs == run(WatchdogCore(), events)

    def test_state_survives_repeated_incremental_snapshots(self) -> None:
        events = looping(Episode(), [CLICK, TYPE, SHELL], 25, dt=3000)
        core = WatchdogCore()
        outs: list[Output] = []
        for i, ev in enumerate(events):
            outs += core.handle(*ev)
            if i % 7 == 0:
                core = restarted(core)
        assert outs == run(WatchdogCore(), events)

    def test_restore_refuses_corrupt_blobs(self) -> None:
        core = WatchdogCore()
        bad = core.restore("k", b"\x00not json")
        assert isinstance(bad, DeadLetterOut) and bad.reason_code == "bad_state"
        assert isinstance(core.restore("k", b"[1,2,3]"), DeadLetterOut)
        assert core.tracked() == 0

    def test_restore_with_a_different_cycle_setting(self) -> None:
        core = WatchdogCore()
        run(core, looping(Episode(), [CLICK, TYPE], 10, dt=10_000))
        small = restarted(core, settings=WatchdogSettings(max_cycle_length=1))
        assert small.tracked() == 1 and small.explain("sb-1")[0].calls_seen == 20

    def test_restore_into_a_larger_cycle_setting_explains_and_detects(self) -> None:
        """Restored into a larger ring, only the calls the smaller one held are known: the
        windows start at those, never at a call not remembered (explain raised TypeError on
        a window timed from an empty slot)."""
        ep = Episode()
        core = WatchdogCore(WatchdogSettings(max_cycle_length=2))
        run(core, looping(ep, [CLICK, TYPE, SHELL], 4, dt=10_000))
        big = restarted(core, settings=WatchdogSettings(max_cycle_length=6))
        (before,) = big.explain("sb-1")
        assert before.calls_seen == 12
        assert all(c.calls <= 3 and c.span_ms >= 0 for c in before.candidates)
        outs = run(big, looping(ep, [CLICK, TYPE, SHELL], 25, dt=10_000))
        assert [a.alert for a in alerts(outs)] == ["LOOP"]
        assert alerts(outs)[0].pattern[0].startswith(CLICK[0])
        big.explain("sb-1")

    def test_same_log_gives_identical_outputs_and_bytes(self) -> None:
        events = looping(Episode(), [SHELL], 30, dt=10_000)
        events += looping(Episode("sb-2"), [CLICK, TYPE], 25, dt=5000, noise=True)
        a, b = run(WatchdogCore(), events), run(WatchdogCore(), events)
        assert a == b and len(alerts(a)) == 2
        enc_a = [to_model(o, "watchdog-0").encode() for o in a if not isinstance(o, DeadLetterOut)]
        enc_b = [to_model(o, "watchdog-0").encode() for o in b if not isinstance(o, DeadLetterOut)]
        assert enc_a == enc_b
        alert = to_model(alerts(a)[0], "watchdog-0")
        assert alert.header.event_id == alerts(a)[0].event_id
        assert alert.header.event_id == output_event_id(
            "LOOP", "sb-1", "ep-1", alerts(a)[0].first_seq, 1)


# -- bounded state --------------------------------------------------------------------------------
class TestBoundedState:
    def test_state_size_does_not_grow_with_history(self) -> None:
        core = WatchdogCore()
        ep = Episode()
        sizes = []
        cycle = [SHELL, CLICK, TYPE, ("a", {"x": 1}), ("b", {"y": 2})]
        for i in range(100_000):
            tool, args = cycle[(i // 7) % len(cycle)] if i % 3 else (f"t{i % 11}", {"i": i})
            core.handle(*ep.call(tool, args, 50, canonical=False))
            if i % 2:
                core.handle(*ep.result(i % 5))
            if i in (1_000, 99_999):
                sizes.append(len(core.snapshot()[state_key("sb-1", "ep-1")]))
        assert sizes[1] <= sizes[0] + 64 and sizes[1] < 2048  # only digits grow

    def test_memory_per_sandbox(self) -> None:
        core = WatchdogCore()
        eps = [Episode(f"sandbox-{i:05d}", f"episode-{i:05d}") for i in range(2000)]
        for ep in eps:
            run(core, looping(ep, [SHELL], 3))
        tracemalloc.start()
        before = tracemalloc.take_snapshot()
        for ep in eps:
            run(core, looping(ep, [CLICK, TYPE], 2))
        tracemalloc.stop()
        core2 = WatchdogCore()
        tracemalloc.start()
        base = tracemalloc.get_traced_memory()[0]
        for key, blob in core.snapshot().items():
            core2.restore(key, blob)
        per = (tracemalloc.get_traced_memory()[0] - base) / len(eps)
        tracemalloc.stop()
        del before
        assert per < 2048, per


# -- dead letters ---------------------------------------------------------------------------------
class TestInvalidInput:
    def _call(self) -> dict[str, Any]:
        return Episode().call(*SHELL)[1]

    @pytest.mark.parametrize(("mutate", "code"), [
        (lambda r: r.pop("header"), "missing_field"),
        (lambda r: r["header"].pop("sandbox"), "missing_field"),
        (lambda r: r["header"].update(seq=-1), "negative_seq"),
        (lambda r: r["header"].update(seq="1"), "wrong_type"),
        (lambda r: r["header"].update(event_time_ms=True), "wrong_type"),
        (lambda r: r.update(tool=None), "wrong_type"),
        (lambda r: r.pop("args_hash"), "missing_field"),
        (lambda r: r.update(args_canonical='{"ts": [1'), "bad_args_canonical"),
        (lambda r: r.update(header=[1, 2]), "wrong_type"),
    ])
    def test_bad_records_become_dead_letters(self, mutate: Any, code: str) -> None:
        rec = self._call()
        mutate(rec)
        core = WatchdogCore()
        [dl] = core.handle("ToolCall", rec)
        assert isinstance(dl, DeadLetterOut) and dl.reason_code == code, dl
        assert core.tracked() == 0

    def test_non_mapping_record(self) -> None:
        [dl] = WatchdogCore().handle("ToolResult", None)  # type: ignore[arg-type]
        assert isinstance(dl, DeadLetterOut) and dl.reason_code == "wrong_type"

    def test_unknown_kinds_and_duplicates_are_ignored(self) -> None:
        core = WatchdogCore()
        ep = Episode()
        call = ep.call(*SHELL)
        assert core.handle(*call) == [] and core.handle(*call) == []
        assert core.handle("Heartbeat", {"junk": 1}) == []

    json_junk = st.recursive(
        st.none() | st.booleans() | st.integers(-3, 3) | st.text(max_size=3),
        lambda c: st.lists(c, max_size=3) | st.dictionaries(
            st.sampled_from(["header", "seq", "sandbox", "episode", "task", "event_id",
                             "event_time_ms", "call_id", "tool", "args_hash", "status",
                             "result_hash", "state", "args_canonical"]), c, max_size=8),
        max_leaves=30,
    )

    @given(st.sampled_from(["ToolCall", "ToolResult", "EpisodeStart", "EpisodeEnd",
                            "SandboxLifecycle", "Tick", "TraceChunk"]), json_junk)
    @settings(max_examples=400)
    def test_junk_never_raises(self, kind: str, record: Any) -> None:
        outs = WatchdogCore().handle(kind, record)
        assert all(isinstance(o, (DeadLetterOut, AlertOut)) for o in outs)
