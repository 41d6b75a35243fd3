"""Specification of the scheduler core (issue 6): each rule on crafted event logs, with and
without ticks; determinism; restart recovery; drain-before-recycle both ways; placement of 1,000
requests on 50 nodes under tenant credit."""

from __future__ import annotations

import itertools
import random
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from trajbus.bus.settings import SchedulerSettings
from trajbus.consumers.scheduler.core import (
    REPLAY_ACK,
    DeadLetterOut,
    DecisionOut,
    NodeState,
    Output,
    SandboxState,
    SchedulerCore,
)
from trajbus.schemas.models import decode_event

MIN = 60_000
T0 = 1_700_000_000_000
_ids = itertools.count()


def hdr(sandbox: str, t: int, seq: int = 0, task: str = "swe", episode: str | None = None,
        eid: str | None = None) -> dict[str, Any]:
    return {"event_id": eid or f"e{next(_ids)}", "task": task, "sandbox": sandbox,
            "episode": episode, "seq": seq, "event_time_ms": t, "producer_id": "test",
            "policy_version": None}


class Log:
    """Builds events for one test; per-sandbox lifecycle seqs are handed out automatically."""

    def __init__(self) -> None:
        self.seq: dict[str, int] = {}

    def h(self, sandbox: str, t: int, **kw: Any) -> dict[str, Any]:
        s = self.seq.get(sandbox, 0)
        self.seq[sandbox] = s + 1
        return hdr(sandbox, t, seq=s, **kw)

    def lifecycle(self, sb: str, t: int, state: str, **kw: Any) -> tuple[str, dict[str, Any]]:
        return "SandboxLifecycle", {"header": self.h(sb, t), "state": state,
                                    "previous_state": None, "node": kw.get("node"),
                                    "tenant": kw.get("tenant"), "reason": kw.get("reason", "")}

    def heartbeat(self, sb: str, t: int, ttl: int = 600_000) -> tuple[str, dict[str, Any]]:
        return "Heartbeat", {"header": self.h(sb, t), "lease_ttl_ms": ttl}

    def probe(self, sb: str, t: int, ok: bool) -> tuple[str, dict[str, Any]]:
        return "LivenessProbe", {"header": self.h(sb, t), "probe": "tcp", "target": ":8080",
                                 "ok": ok, "latency_ms": 3, "error": None if ok else "refused"}

    def drained(self, sb: str, t: int, finals: dict[str, int], complete: bool = True,
                unflushed: int = 0) -> tuple[str, dict[str, Any]]:
        return "Drained", {"header": self.h(sb, t), "complete": complete,
                           "unflushed": unflushed, "detail": "",
                           "final_seqs": [{"episode": e, "final_seq": s}
                                          for e, s in finals.items()]}


def release(sb: str, t: int) -> tuple[str, dict[str, Any]]:
    return "TrainerRelease", {"header": hdr(sb, t, task="trainer"), "reason": "done"}


def ack(sb: str, episode: str, last_seq: int, t: int | None = None) -> tuple[str, dict[str, Any]]:
    rec: dict[str, Any] = {"sandbox": sb, "episode": episode, "last_seq": last_seq}
    if t is not None:
        rec["event_time_ms"] = t
    return REPLAY_ACK, rec


def tick(t: int) -> tuple[str, dict[str, Any]]:
    return "Tick", {"header": hdr("_timer", t, task="_fleet")}


def alert(sb: str, t: int, kind: str = "LOOP", dry_run: bool = False) -> tuple[str, dict]:
    return "WatchdogAlert", {"header": hdr(sb, t, task="_watchdog"), "alert": kind,
                             "pattern": ["bash:ab12"], "repeat_count": 20, "span_ms": 130_000,
                             "first_seq": 3, "last_seq": 60, "distinct_results": 0,
                             "dry_run": dry_run, "reason": "same call 20x"}


def node_report(node: str, t: int, cpu: float = 32.0, mem: int = 131_072, gpu: float = 0.0,
                cpu_free: float | None = None, mem_free: int | None = None,
                gpu_free: float | None = None, datasets: list[str] | None = None,
                ) -> tuple[str, dict[str, Any]]:
    return "NodeReport", {
        "header": hdr(node, t, task="_fleet"), "node": node, "cpu_total": cpu,
        "cpu_free": cpu if cpu_free is None else cpu_free, "memory_total_mb": mem,
        "memory_free_mb": mem if mem_free is None else mem_free, "gpu_total": gpu,
        "gpu_free": gpu if gpu_free is None else gpu_free, "network_free_mbps": 1000.0,
        "cached_datasets": datasets or [],
    }


def request(sb: str, t: int, tenant: str = "acme", cpu: float = 4.0, mem: int = 8192,
            gpu: float = 0.0, dataset: str | None = None, rid: str | None = None,
            ) -> tuple[str, dict[str, Any]]:
    return "SandboxRequest", {"header": hdr(sb, t, task="swe"), "request_id": rid or f"r-{sb}",
                              "tenant": tenant, "cpu": cpu, "memory_mb": mem, "gpu_share": gpu,
                              "dataset": dataset, "ttl_ms": 600_000}


def run(core: SchedulerCore, events: list[tuple[str, dict[str, Any]]]) -> list[Output]:
    out: list[Output] = []
    for kind, rec in events:
        out += core.handle(kind, rec)
    return out


def decisions(out: list[Output], kind: str | None = None) -> list[DecisionOut]:
    return [o for o in out if isinstance(o, DecisionOut) and (kind is None or o.decision == kind)]


def kinds(out: list[Output]) -> list[str]:
    return [o.decision for o in decisions(out)]


def sbx(core: SchedulerCore, sandbox: str) -> SandboxState:
    sb = core.sandbox(sandbox)
    assert sb is not None
    return sb


def nodex(core: SchedulerCore, node: str) -> NodeState:
    n = core.node(node)
    assert n is not None
    return n


def active_sandbox(core: SchedulerCore, log: Log, sb: str, t: int) -> None:
    assert run(core, [log.lifecycle(sb, t, "PROVISIONING", node="n1", tenant="acme"),
                      log.lifecycle(sb, t + 1000, "ACTIVE")]) == []


# -- 1. lifecycle ---------------------------------------------------------------------------
def test_legal_lifecycle_path_ends_recycled_after_confirmed_drain() -> None:
    core, log = SchedulerCore(SchedulerSettings()), Log()
    active_sandbox(core, log, "s1", T0)
    assert sbx(core, "s1").state == "ACTIVE"
    out = run(core, [release("s1", T0 + MIN)])
    assert kinds(out) == ["DRAIN"] and sbx(core, "s1").state == "DRAINING"
    out = run(core, [log.drained("s1", T0 + MIN + 2000, {"ep1": 7}), ack("s1", "ep1", 7)])
    assert kinds(out) == ["RECYCLE"]
    assert sbx(core, "s1").state == "RECYCLED"
    # the sandbox then confirms what the scheduler decided: a no-op
    assert run(core, [log.lifecycle("s1", T0 + MIN + 3000, "DRAINING"),
                      log.lifecycle("s1", T0 + MIN + 3001, "RECYCLED")]) == []


@pytest.mark.parametrize(("path", "bad"), [
    (["PROVISIONING", "ACTIVE"], "PROVISIONING"),
    (["PROVISIONING", "ACTIVE"], "RECYCLED"),  # skipping the drain
    (["PROVISIONING"], "RECYCLED"),
])
def test_illegal_transition_is_an_anomaly_and_changes_nothing(path: list[str], bad: str) -> None:
    core, log = SchedulerCore(), Log()
    run(core, [log.lifecycle("s1", T0 + i, s, node="n1") for i, s in enumerate(path)])
    out = run(core, [log.lifecycle("s1", T0 + 100, bad)])
    (d,) = decisions(out)
    assert d.decision == "ANOMALY" and d.details["from"] == path[-1] and d.details["to"] == bad
    assert sbx(core, "s1").state == path[-1]


def test_lifecycle_of_recycled_sandbox_going_back_is_an_anomaly() -> None:
    core, log = SchedulerCore(), Log()
    active_sandbox(core, log, "s1", T0)
    run(core, [release("s1", T0 + 5000), log.drained("s1", T0 + 6000, {})])
    assert sbx(core, "s1").state == "RECYCLED"
    assert run(core, [log.lifecycle("s1", T0 + 7000, "ACTIVE")]) == []  # a repeat: no-op
    assert kinds(run(core, [log.lifecycle("s1", T0 + 8000, "PROVISIONING")])) == ["ANOMALY"]


def test_reports_lagging_behind_the_schedulers_decisions_are_not_anomalies() -> None:
    core, log = SchedulerCore(), Log()
    run(core, [log.lifecycle("s1", T0, "PROVISIONING", node="n1")])
    assert kinds(run(core, [tick(T0 + 10 * MIN + 1)])) == ["RECLAIM"]
    assert run(core, [log.lifecycle("s1", T0 + 10 * MIN + 5, "ACTIVE"),
                      log.lifecycle("s1", T0 + 10 * MIN + 9, "DRAINING")]) == []
    assert sbx(core, "s1").state == "DRAINING"


def test_unknown_sandbox_lifecycle_other_than_provisioning_is_an_anomaly() -> None:
    core, log = SchedulerCore(), Log()
    assert kinds(run(core, [log.lifecycle("ghost", T0, "ACTIVE")])) == ["ANOMALY"]
    assert core.sandbox("ghost") is None


def test_redelivered_lifecycle_event_is_ignored() -> None:
    core, log = SchedulerCore(), Log()
    kind, rec = log.lifecycle("s1", T0, "PROVISIONING")
    kind2, rec2 = log.lifecycle("s1", T0 + 1, "ACTIVE")
    assert run(core, [(kind, rec), (kind2, rec2), (kind, rec), (kind2, rec2)]) == []
    assert core.stats["duplicate"] == 2


@pytest.mark.parametrize(("kind", "rec", "code"), [
    ("Heartbeat", {}, "invalid_record"),
    ("Heartbeat", {"header": {"sandbox": "s"}}, "invalid_record"),
    ("Heartbeat", {"header": {**hdr("s", T0), "event_time_ms": "soon"}}, "invalid_record"),
    ("SandboxLifecycle", {"header": hdr("s", T0), "state": "EXPLODED"}, "invalid_record"),
    ("SandboxRequest", {"header": hdr("s", T0), "request_id": "r", "tenant": "t", "cpu": -1,
                        "memory_mb": 1}, "invalid_record"),
    ("NodeReport", {"header": hdr("n", T0), "node": "n", "cpu_total": "many"}, "invalid_record"),
    ("Drained", {"header": hdr("s", T0), "final_seqs": [{"episode": "e"}], "complete": True},
     "invalid_record"),
    ("ToolCall", {"header": hdr("s", T0)}, "unknown_kind"),
    (REPLAY_ACK, {"sandbox": "s", "episode": "e", "last_seq": "7"}, "invalid_record"),
    ("Heartbeat", {"header": hdr("nobody", T0)}, "unknown_sandbox"),
    ("TrainerRelease", {"header": hdr("nobody", T0)}, "unknown_sandbox"),
])
def test_bad_input_becomes_a_dead_letter(kind: str, rec: dict[str, Any], code: str) -> None:
    core = SchedulerCore()
    before = core.snapshot()
    (dl,) = core.handle(kind, rec)
    assert isinstance(dl, DeadLetterOut) and dl.reason_code == code and dl.reason
    after = core.snapshot()
    assert {k: v for k, v in after.items() if k != "meta"} == \
        {k: v for k, v in before.items() if k != "meta"}


_json = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=5),
    lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=8), c, max_size=4),
    max_leaves=10,
)


@settings(max_examples=300, deadline=None)
@given(kind=st.sampled_from(["SandboxLifecycle", "Heartbeat", "LivenessProbe", "NodeReport",
                             "SandboxRequest", "TrainerRelease", "Drained", "Tick",
                             "WatchdogAlert", REPLAY_ACK, "Bogus"]),
       rec=st.dictionaries(st.sampled_from(["header", "state", "ok", "node", "cpu", "tenant",
                                            "final_seqs", "complete", "alert", "sandbox",
                                            "episode", "last_seq", "request_id", "memory_mb",
                                            "cpu_total", "cpu_free"]), _json),
       t=st.integers(min_value=0, max_value=2**40))
def test_arbitrary_records_never_raise(kind: str, rec: dict[str, Any], t: int) -> None:
    core = SchedulerCore()
    active_sandbox(core, Log(), "s", T0)
    if isinstance(rec.get("header"), dict):
        rec["header"].setdefault("event_time_ms", t)
        rec["header"].setdefault("sandbox", "s")
    for o in core.handle(kind, rec):
        assert isinstance(o, DecisionOut | DeadLetterOut)


# -- 2. leases ------------------------------------------------------------------------------
@pytest.mark.parametrize("with_ticks", [False, True])
def test_heartbeats_every_five_minutes_keep_the_lease(with_ticks: bool) -> None:
    core, log = SchedulerCore(), Log()
    active_sandbox(core, log, "s1", T0)
    events = []
    for i in range(1, 13):
        events.append(log.heartbeat("s1", T0 + i * 5 * MIN))
        if with_ticks:
            events += [tick(T0 + i * 5 * MIN + k * 30_000) for k in range(1, 10)]
    assert run(core, events) == []
    assert sbx(core, "s1").state == "ACTIVE"


def test_two_missed_heartbeats_reclaim_on_the_tick_that_passes_the_deadline() -> None:
    core, log = SchedulerCore(), Log()
    active_sandbox(core, log, "s1", T0)
    run(core, [log.heartbeat("s1", T0 + 5 * MIN)])
    assert run(core, [tick(T0 + 10 * MIN), tick(T0 + 15 * MIN)]) == []  # one beat missed; the
    # second is due at the deadline (10 min after the last): the lease still covers it
    out = run(core, [tick(T0 + 15 * MIN + 1)])  # the deadline has passed
    (d,) = decisions(out)
    assert d.decision == "RECLAIM" and d.time_ms == T0 + 15 * MIN + 1 and d.sandbox == "s1"
    assert "missed 2 heartbeats" in d.reason
    assert sbx(core, "s1").state == "DRAINING"


def test_reclaim_without_ticks_fires_on_the_next_event_stamped_at_its_expiry() -> None:
    """Without ticks the RECLAIM comes with the next event past the deadline, stamped with the
    lease's expiry (deadline + 1 ms), exactly as a tick there would have made it."""
    core, log = SchedulerCore(), Log()
    active_sandbox(core, log, "s1", T0)
    active_sandbox(core, log, "s2", T0 + 9 * MIN)
    out = run(core, [log.heartbeat("s2", T0 + 10 * MIN + 10_000)])  # unrelated event: time on
    (d,) = decisions(out)
    assert (d.decision, d.sandbox, d.time_ms) == ("RECLAIM", "s1", T0 + 1000 + 10 * MIN + 1)


def test_heartbeat_with_shorter_ttl_and_late_heartbeat_never_shorten_the_lease() -> None:
    core, log = SchedulerCore(), Log()
    active_sandbox(core, log, "s1", T0)
    deadline = sbx(core, "s1").lease_deadline
    run(core, [log.heartbeat("s1", T0 + 2000, ttl=60_000)])
    assert sbx(core, "s1").lease_deadline == deadline


def test_lease_rules_give_the_same_decisions_with_and_without_ticks() -> None:
    def scenario(with_ticks: bool) -> list[tuple[str, str | None, int, str]]:
        core, log = SchedulerCore(), Log()
        events = []
        for i in range(6):
            events.append(log.lifecycle(f"s{i}", T0 + i * MIN, "PROVISIONING", node="n1"))
            events.append(log.lifecycle(f"s{i}", T0 + i * MIN + 10, "ACTIVE"))
        for k in range(1, 8):  # only even sandboxes heartbeat
            events += [log.heartbeat(f"s{i}", T0 + k * 5 * MIN + i) for i in range(0, 6, 2)]
        events.append(log.heartbeat("s0", T0 + 50 * MIN))
        if with_ticks:
            events += [tick(T0 + k * 1000) for k in range(0, 50 * 60, 7)]
            events.sort(key=lambda e: e[1]["header"]["event_time_ms"])
        return [(d.decision, d.sandbox, d.time_ms, d.reason) for d in decisions(run(core, events))]

    without, with_ = scenario(False), scenario(True)
    assert without == with_
    assert {s for k, s, *_ in without if k == "RECLAIM"} == {"s1", "s3", "s5", "s0", "s2", "s4"}


# -- 3. drain triggers ----------------------------------------------------------------------
def test_three_consecutive_failed_probes_drain() -> None:
    core, log = SchedulerCore(), Log()
    active_sandbox(core, log, "s1", T0)
    flaky = [log.probe("s1", T0 + k * 15_000, ok) for k, ok in
             enumerate([False, False, True, False, False], start=1)]
    assert run(core, flaky) == []
    out = run(core, [log.probe("s1", T0 + 100_000, False)])
    (d,) = decisions(out)
    assert d.decision == "DRAIN" and "3 consecutive failed liveness probes" in d.reason
    assert len(d.cause_event_ids) == 3
    assert run(core, [log.probe("s1", T0 + 110_000, False)]) == []  # already draining


def test_trainer_release_drains() -> None:
    core, log = SchedulerCore(), Log()
    active_sandbox(core, log, "s1", T0)
    (d,) = decisions(run(core, [release("s1", T0 + 5000)]))
    assert d.decision == "DRAIN" and d.reason.startswith("released by trainer")
    assert run(core, [release("s1", T0 + 6000)]) == []  # idempotent


def test_watchdog_loop_terminates_and_marks_suspicious() -> None:
    core, log = SchedulerCore(), Log()
    active_sandbox(core, log, "s1", T0)
    assert run(core, [alert("s1", T0 + 1, dry_run=True), alert("s1", T0 + 2, "LOOP_ENDED"),
                      alert("s1", T0 + 3, "STALL")]) == []
    (d,) = decisions(run(core, [alert("s1", T0 + 10)]))
    assert d.decision == "TERMINATE" and d.suspicious
    assert d.details["order"] == "cut_resources,terminate,drain_data"
    assert sbx(core, "s1").state == "DRAINING"
    (r,) = decisions(run(core, [log.drained("s1", T0 + 20, {})]))
    assert r.decision == "RECYCLE" and r.suspicious


def test_watchdog_decision_on_the_decisions_topic_is_not_an_input() -> None:
    core, log = SchedulerCore(), Log()
    active_sandbox(core, log, "s1", T0)
    rec = {"header": hdr("s1", T0 + 5), "decision": "TERMINATE", "reason": "loop"}
    assert core.handle("SchedulingDecision", rec) == []
    assert sbx(core, "s1").state == "ACTIVE"


def test_runtime_ack_of_terminate_is_counted_and_a_failed_one_is_an_anomaly() -> None:
    core, log = SchedulerCore(), Log()
    for sb in ("s1", "s2"):
        active_sandbox(core, log, sb, T0)
    for i, sb in enumerate(("s1", "s2")):
        assert kinds(run(core, [alert(sb, T0 + 10 + i)])) == ["TERMINATE"]

    def answer(sb: str, t: int, outcome: str, detail: str = "") -> tuple[str, dict[str, Any]]:
        return "DecisionAck", {"header": log.h(sb, t), "decision_event_id": f"d-{sb}",
                               "decision": "TERMINATE", "outcome": outcome, "detail": detail}

    assert run(core, [answer("s1", T0 + 20, "DONE")]) == []
    assert core.stats["decision_ack_done"] == 1
    (bad,) = decisions(run(core, [answer("s2", T0 + 21, "FAILED", "kill refused: EPERM")]))
    assert bad.decision == "ANOMALY" and bad.sandbox == "s2" and bad.suspicious
    assert "could not carry out TERMINATE: kill refused: EPERM" in bad.reason
    assert bad.details["decision_event_id"] == "d-s2"
    assert core.stats["decision_ack_failed"] == 1
    # the drains TERMINATE started run on either way
    assert sbx(core, "s1").state == sbx(core, "s2").state == "DRAINING"
    (dl,) = run(core, [answer("s-unknown", T0 + 30, "DONE")])
    assert isinstance(dl, DeadLetterOut) and dl.reason_code == "unknown_sandbox"


# -- 4. drain before recycle ----------------------------------------------------------------
def _full_node_with_one_sandbox(core: SchedulerCore) -> None:
    run(core, [node_report("n1", T0, cpu=8, mem=16_384)])
    assert kinds(run(core, [request("s1", T0 + 1, cpu=8, mem=16_384)])) == ["PLACE"]
    assert kinds(run(core, [request("s2", T0 + 2, cpu=8, mem=16_384)])) == ["QUEUE"]


@pytest.mark.parametrize("ack_first", [False, True])
def test_drain_confirmed_by_drained_and_downstream_ack_recycles_then_slot_is_reused(
    ack_first: bool,
) -> None:
    core, log = SchedulerCore(), Log()
    _full_node_with_one_sandbox(core)
    run(core, [log.lifecycle("s1", T0 + 10, "PROVISIONING"),
               log.lifecycle("s1", T0 + 20, "ACTIVE"), release("s1", T0 + 1000)])
    # the node already reports the capacity free (the process is gone): still not offered
    assert run(core, [node_report("n1", T0 + 1100, cpu=8, mem=16_384)]) == []
    confirm = [log.drained("s1", T0 + 2000, {"ep1": 41, "ep2": 9})]
    acks = [ack("s1", "ep1", 41), ack("s1", "ep2", 8)]
    out = run(core, acks + confirm if ack_first else confirm + acks)
    assert out == []  # ep2 not fully processed downstream yet: the slot stays taken
    assert core.sandbox("s2") is None and core.queued("acme")[0]["sandbox"] == "s2"
    out = run(core, [ack("s1", "ep2", 9)])
    assert kinds(out) == ["RECYCLE", "ADMIT", "PLACE"]
    ds = decisions(out)
    assert ds[0].details["final_seqs"] == "ep1:41,ep2:9"
    assert ds[2].sandbox == "s2" and ds[2].node == "n1"


def test_grace_window_expiry_recycles_with_loss_naming_what_was_lost() -> None:
    core, log = SchedulerCore(), Log()
    _full_node_with_one_sandbox(core)
    run(core, [release("s1", T0 + 1000), log.drained("s1", T0 + 2000, {"ep1": 41, "ep2": 9}),
               ack("s1", "ep1", 30)])
    busy = [node_report("n1", T0 + k * 500, cpu=8, mem=16_384, cpu_free=0, mem_free=0)
            for k in range(5, 62)]
    assert run(core, [*busy, tick(T0 + 1000 + 29_999)]) == []
    out = run(core, [tick(T0 + 1000 + 30_000)])
    (loss,) = decisions(out)  # the node still shows the old sandbox's usage: not offered yet
    assert loss.decision == "RECYCLE_WITH_LOSS" and loss.details["lost"] == "ep1:31-41,ep2:0-9"
    assert loss.time_ms == T0 + 31_000
    out = run(core, [node_report("n1", T0 + 31_500, cpu=8, mem=16_384)])
    assert kinds(out) == ["ADMIT", "PLACE"]


def test_grace_window_expiry_without_drained_event_and_without_ticks() -> None:
    core = SchedulerCore()
    _full_node_with_one_sandbox(core)
    run(core, [release("s1", T0 + 1000), ack("s1", "ep1", 3)])
    out = run(core, [node_report("n1", T0 + 40_000, cpu=8, mem=16_384, cpu_free=0, mem_free=0)])
    assert kinds(out)[0] == "RECYCLE_WITH_LOSS"
    d = decisions(out)[0]
    assert d.details["drained"] == "false" and d.details["acked"] == "ep1:3"
    assert d.time_ms == T0 + 31_000


def test_incomplete_drain_recycles_with_loss_of_the_unflushed_events() -> None:
    core, log = SchedulerCore(), Log()
    active_sandbox(core, log, "s1", T0)
    run(core, [release("s1", T0 + 1000), ack("s1", "ep1", 5)])
    out = run(core, [log.drained("s1", T0 + 2000, {"ep1": 5}, complete=False, unflushed=12)])
    (d,) = decisions(out)
    assert d.decision == "RECYCLE_WITH_LOSS" and d.details["lost"] == "unflushed:12"


def test_sandbox_reporting_recycled_early_does_not_free_its_slot() -> None:
    core, log = SchedulerCore(), Log()
    _full_node_with_one_sandbox(core)
    run(core, [log.lifecycle("s1", T0 + 10, "PROVISIONING"), release("s1", T0 + 1000)])
    assert run(core, [log.lifecycle("s1", T0 + 1500, "RECYCLED")]) == []
    assert sbx(core, "s1").state == "DRAINING"
    assert sbx(core, "s1").reported_recycled
    assert core.queued("acme")


# -- 5. placement ---------------------------------------------------------------------------
def test_best_fit_prefers_least_leftover_and_reports_the_score_breakdown() -> None:
    core = SchedulerCore()
    run(core, [node_report("big", T0, cpu=64, mem=262_144), node_report("small", T0, cpu=8,
                                                                         mem=16_384)])
    (d,) = decisions(run(core, [request("s1", T0 + 1, cpu=4, mem=8192)]))
    assert d.node == "small"
    assert set(d.scores) >= {"fit", "affinity", "total"}
    assert d.scores["leftover_cpu"] == 0.5 and d.scores["affinity"] == 0.0


def test_data_affinity_cached_bonus_and_remote_penalty() -> None:
    core = SchedulerCore()
    run(core, [node_report("big", T0, cpu=64, mem=262_144, datasets=["swe-bench"]),
               node_report("small", T0, cpu=8, mem=16_384)])
    (d,) = decisions(run(core, [request("s1", T0 + 1, cpu=4, mem=8192, dataset="swe-bench")]))
    assert d.node == "big" and d.scores["affinity"] == 50.0 and d.details["affinity"] == "cached"
    (d2,) = decisions(run(core, [request("s2", T0 + 2, cpu=2, mem=2048, dataset="other")]))
    assert d2.node == "small" and d2.scores["affinity"] == -30.0


def test_reservations_not_yet_in_a_report_are_not_double_counted_nor_forgotten() -> None:
    core = SchedulerCore()
    run(core, [node_report("n1", T0, cpu=8, mem=65_536)])
    assert kinds(run(core, [request(f"s{i}", T0 + 1, cpu=2, mem=1024) for i in range(4)])) \
        == ["PLACE"] * 4
    assert kinds(run(core, [request("s4", T0 + 2, cpu=2, mem=1024)])) == ["QUEUE"]
    # the node now reports the four sandboxes: still full, nothing counted twice
    run(core, [node_report("n1", T0 + 500, cpu=8, mem=65_536, cpu_free=0, mem_free=61_440)])
    assert nodex(core, "n1").free_cpu() == 0
    # a stale report (older than the last) is ignored; a report showing outside usage counts
    run(core, [node_report("n1", T0 + 400, cpu=8, mem=65_536)])
    assert nodex(core, "n1").free_cpu() == 0


def test_outside_usage_seen_in_the_report_reduces_headroom() -> None:
    core = SchedulerCore()
    run(core, [node_report("n1", T0, cpu=8, mem=65_536, cpu_free=3)])
    assert kinds(run(core, [request("s1", T0 + 1, cpu=4, mem=1024)])) == ["QUEUE"]
    # the daemon goes away: the report frees capacity and the queue head is admitted
    assert kinds(run(core, [node_report("n1", T0 + 500, cpu=8, mem=65_536)])) == \
        ["ADMIT", "PLACE"]


def test_stale_nodes_are_not_offered() -> None:
    core = SchedulerCore(node_stale_ms=5_000)
    run(core, [node_report("old", T0, cpu=64, mem=262_144)])
    assert kinds(run(core, [request("s1", T0 + 6_000, cpu=1, mem=10)])) == ["QUEUE"]
    assert kinds(run(core, [node_report("old", T0 + 6_500)])) == ["ADMIT", "PLACE"]


def test_released_gpu_share_comes_back_through_the_cooldown() -> None:
    core = SchedulerCore(SchedulerSettings(gpu_cooldown_per_s=0.5))  # burst 0.5 share
    log = Log()
    run(core, [node_report("g1", T0, cpu=32, mem=65_536, gpu=1.0)])
    assert kinds(run(core, [request("s1", T0 + 1, gpu=1.0, cpu=1, mem=10)])) == ["PLACE"]
    assert kinds(run(core, [request("s2", T0 + 2, gpu=1.0, cpu=1, mem=10)])) == ["QUEUE"]
    out = run(core, [release("s1", T0 + 10), log.drained("s1", T0 + 20, {})])
    assert kinds(out) == ["DRAIN", "RECYCLE"]  # 0.5 back at once, 0.5 still cooling
    assert nodex(core, "g1").gpu_cooling == pytest.approx(0.5)
    assert run(core, [tick(T0 + 999)]) == []
    out = run(core, [tick(T0 + 1020)])  # one second later the whole card is back
    assert kinds(out) == ["ADMIT", "PLACE"]


# -- 6. tenant credit -----------------------------------------------------------------------
def test_requests_beyond_credit_queue_with_positions_and_admit_as_credit_frees() -> None:
    core, log = SchedulerCore(SchedulerSettings(tenant_burst_max_ms=10**9), {"acme": 8.0}), Log()
    run(core, [node_report(f"n{i}", T0, cpu=64, mem=262_144) for i in range(3)])
    out = run(core, [request(f"s{i}", T0 + i, cpu=4, mem=1024) for i in range(5)])
    # credit 8, burst 1.5x = 12 CPU: three placed, the rest queued in order
    assert kinds(out) == ["PLACE", "PLACE", "PLACE", "QUEUE", "QUEUE"]
    assert [d.details["position"] for d in decisions(out, "QUEUE")] == ["1", "2"]
    assert decisions(out, "QUEUE")[0].details["cause"] == "credit"
    assert decisions(out, "QUEUE")[1].details["cause"] == "fifo"
    assert decisions(out, "PLACE")[2].details["burst"] == "true"
    out = run(core, [release("s0", T0 + 1000), log.drained("s0", T0 + 1001, {})])
    assert kinds(out) == ["DRAIN", "RECYCLE", "ADMIT", "PLACE"]
    assert decisions(out)[3].sandbox == "s3"
    assert core.status()["queued_by_tenant"]["acme"]["queued"] == 1


def test_sustained_overuse_is_demoted_and_demotion_lifts_below_credit() -> None:
    s = SchedulerSettings(tenant_burst_max_ms=60_000)
    core, log = SchedulerCore(s, {"acme": 8.0}), Log()
    run(core, [node_report(f"n{i}", T0 + k * 500, cpu=64, mem=262_144)
               for k in range(2) for i in range(2)])
    run(core, [request(f"s{i}", T0 + 1000, cpu=4, mem=1024) for i in range(3)])  # 12 > 8
    assert run(core, [tick(T0 + 60_999)]) == []  # burst tolerated for a minute
    (d,) = decisions(run(core, [tick(T0 + 61_000)]))
    assert d.decision == "DEMOTE" and d.tenant == "acme" and d.details["excess_cpu"] == "4.0"
    # while demoted: only up to 1.0x credit
    run(core, [release("s0", T0 + 62_000), log.drained("s0", T0 + 62_001, {})])  # usage 8
    assert core.status()["queued_by_tenant"]["acme"]["demoted"] is False  # back at credit
    out = run(core, [node_report("n0", T0 + 62_100, cpu=64, mem=262_144),
                     request("s9", T0 + 62_200, cpu=2, mem=1)])
    assert kinds(out)[-1] == "PLACE"  # burst allowed again


def test_demoted_tenant_is_limited_to_its_credit_and_yields_to_others() -> None:
    s = SchedulerSettings(tenant_burst_max_ms=1_000)
    core = SchedulerCore(s, {"hog": 8.0, "nice": 8.0})
    run(core, [node_report("n1", T0, cpu=16, mem=262_144)])
    run(core, [request("h1", T0 + 1, "hog", cpu=6, mem=1), request("h2", T0 + 2, "hog", cpu=6,
                                                                   mem=1)])
    assert kinds(run(core, [tick(T0 + 1_002)])) == ["DEMOTE"]
    out = run(core, [request("h3", T0 + 1_003, "hog", cpu=1, mem=1)])
    assert decisions(out)[0].decision == "QUEUE" and decisions(out)[0].details["cause"] == \
        "credit"
    assert kinds(run(core, [request("x1", T0 + 1_004, "nice", cpu=4, mem=1)])) == ["PLACE"]


def test_request_larger_than_the_credit_line_is_rejected_as_anomaly() -> None:
    core = SchedulerCore(None, {"tiny": 2.0})
    run(core, [node_report("n1", T0, cpu=64, mem=262_144)])
    (d,) = decisions(run(core, [request("s1", T0, "tiny", cpu=4, mem=1)]))
    assert d.decision == "ANOMALY" and "credit line" in d.reason


def test_queued_request_can_be_withdrawn_by_the_trainer() -> None:
    core = SchedulerCore(None, {"acme": 4.0})
    run(core, [node_report("n1", T0, cpu=64, mem=262_144)])
    run(core, [request("s1", T0, cpu=4, mem=1), request("s2", T0, cpu=4, mem=1)])
    (d,) = decisions(run(core, [release("s2", T0 + 5)]))
    assert d.decision == "RECYCLE" and d.details["queued"] == "true"
    assert core.queued("acme") == []


def test_redelivered_request_is_ignored_and_a_reused_sandbox_id_is_an_anomaly() -> None:
    core = SchedulerCore()
    run(core, [node_report("n1", T0, cpu=64, mem=262_144)])
    k, r = request("s1", T0)
    assert kinds(run(core, [(k, r), (k, r)])) == ["PLACE"]
    assert kinds(run(core, [request("s1", T0 + 1, rid="other")])) == ["ANOMALY"]


def test_thousand_requests_on_fifty_nodes_place_what_fits_and_queue_the_rest() -> None:
    rng = random.Random(7)
    credit = {"a": 200.0, "b": 400.0, "c": 64.0, "d": 2000.0}
    core = SchedulerCore(SchedulerSettings(tenant_burst_max_ms=10**9), credit)
    nodes = []
    for i in range(50):
        gpu = 1.0 if i % 5 == 0 else 0.0
        nodes.append(node_report(f"node{i:02d}", T0, cpu=32, mem=131_072, gpu=gpu,
                                 datasets=["ds1"] if i % 3 == 0 else []))
    run(core, nodes)
    reqs = []
    for i in range(1000):
        reqs.append(request(
            f"sb{i:04d}", T0 + 1 + i // 10, tenant=rng.choice("abcd"),
            cpu=rng.choice([1.0, 2.0, 4.0]), mem=rng.choice([2048, 4096, 8192]),
            gpu=0.25 if rng.random() < 0.1 else 0.0, dataset=rng.choice([None, "ds1", "ds2"])))
    out = run(core, reqs)
    by_req = {d.request_id: d for d in decisions(out)}
    assert len(by_req) == 1000 and len(decisions(out)) == 1000
    placed = decisions(out, "PLACE")
    queued = decisions(out, "QUEUE")
    assert len(placed) + len(queued) == 1000 and placed and queued
    # no node is ever overcommitted
    for i in range(50):
        n = core.node(f"node{i:02d}")
        assert n is not None and n.res_cpu <= 32 and n.res_mem <= 131_072
        assert n.res_gpu <= (1.0 if i % 5 == 0 else 0.0) + 1e-9
    # no tenant beyond 1.5x its credit, and each queue is blocked at its head for a reason
    for tenant, c in credit.items():
        t = core.tenant(tenant)
        assert t is not None and t.usage <= 1.5 * c + 1e-9
        positions = [int(d.details["position"]) for d in queued if d.tenant == tenant]
        assert positions == list(range(1, len(positions) + 1))
        if t.queue:
            head = t.queue[0]
            credit_blocked = t.usage + head["cpu"] > 1.5 * c
            assert credit_blocked or not core.can_place_now(head["cpu"], head["mem"],
                                                            head["gpu"])
    # the small-credit tenant is credit-bound, the big one capacity-bound
    assert any(d.details["cause"] == "credit" for d in queued if d.tenant == "c")
    assert any(d.details["cause"] == "capacity" for d in queued if d.tenant == "d")
    assert sum(n["sandboxes"] for n in core.status()["nodes_by_headroom"]) == len(placed)


# -- determinism and recovery ---------------------------------------------------------------
def mixed_log(seed: int, n_sandboxes: int = 60) -> list[tuple[str, dict[str, Any]]]:
    """A fleet: nodes reporting, requests from three tenants, lifecycles, heartbeats (some
    stop), probes, releases, watchdog alerts, drains and acks, ticks; in event-time order."""
    rng = random.Random(seed)
    log = Log()
    global _ids
    _ids = itertools.count()  # event ids are part of the inputs: make them reproducible
    ev: list[tuple[int, int, tuple[str, dict[str, Any]]]] = []
    k = itertools.count()

    def add(t: int, e: tuple[str, dict[str, Any]]) -> None:
        ev.append((t, next(k), e))

    for step in range(0, 40 * MIN, 500):
        for i in range(8):
            if step % 5000 == 0:
                add(T0 + step, node_report(f"n{i}", T0 + step, cpu=16, mem=65_536,
                                           gpu=1.0 if i < 2 else 0.0, datasets=["ds"]
                                           if i % 2 else []))
        if step % 10_000 == 0:
            add(T0 + step, tick(T0 + step))
    for s in range(n_sandboxes):
        sb = f"s{s:03d}"
        t = T0 + 1000 + rng.randrange(0, 15 * MIN)
        add(t, request(sb, t, tenant=rng.choice(["a", "b", "c"]), cpu=rng.choice([2.0, 4.0]),
                       mem=4096, gpu=0.5 if rng.random() < 0.2 else 0.0,
                       dataset=rng.choice([None, "ds"])))
        t += 2000
        add(t, log.lifecycle(sb, t, "PROVISIONING"))
        add(t + 1000, log.lifecycle(sb, t + 1000, "ACTIVE"))
        fate = rng.choice(["release", "silent", "probe", "loop"])
        for b in range(1, 4):
            if fate != "silent":
                add(t + b * 5 * MIN, log.heartbeat(sb, t + b * 5 * MIN))
            add(t + b * 60_000, log.probe(sb, t + b * 60_000, fate != "probe"))
        for j in range(4, 7):
            add(t + j * 60_000, log.probe(sb, t + j * 60_000, fate != "probe"))
        end = t + 8 * MIN
        if fate == "release":
            add(end, release(sb, end))
        if fate == "loop":
            add(end, alert(sb, end))
        if rng.random() < 0.7:
            add(end + 5000, log.drained(sb, end + 5000, {"e": 30}))
            last = 30 if rng.random() < 0.7 else 20
            add(end + 6000, ack(sb, "e", last, end + 6000))
    ev.sort(key=lambda x: (x[0], x[1]))
    return [e for _, _, e in ev]


def encoded(out: list[Output]) -> list[bytes]:
    return [o.to_model().encode() if isinstance(o, DecisionOut) else repr(o).encode()
            for o in out]


def test_same_inputs_twice_give_identical_decisions_byte_for_byte() -> None:
    first = encoded(run(SchedulerCore(None, {"a": 12.0}), mixed_log(3)))
    second = encoded(run(SchedulerCore(None, {"a": 12.0}), mixed_log(3)))
    assert first == second
    kinds_seen = {getattr(decode_event(b), "decision").value  # noqa: B009
                  for b in first if not b.startswith(b"DeadLetterOut")}
    assert {"PLACE", "QUEUE", "DRAIN", "RECLAIM", "TERMINATE", "RECYCLE",
            "RECYCLE_WITH_LOSS", "ADMIT"} <= kinds_seen


def test_restart_from_the_changelog_resumes_with_identical_decisions() -> None:
    events = mixed_log(5)
    ref = SchedulerCore(None, {"a": 12.0})
    expected = encoded(run(ref, events))
    changelog: dict[str, bytes | None] = {}
    got: list[Output] = []
    core = SchedulerCore(None, {"a": 12.0})
    for i, (kind, rec) in enumerate(events):
        got += core.handle(kind, rec)
        if i % 97 == 0:
            changelog.update(core.take_dirty())
        if i in (len(events) // 3, 2 * len(events) // 3):  # crash and restart
            changelog.update(core.take_dirty())
            core = SchedulerCore(None, {"a": 12.0})
            for key in sorted(changelog, reverse=True):  # any order
                core.restore(key, changelog[key])
    assert encoded(got) == expected
    assert core.snapshot() == ref.snapshot()


def test_decision_becomes_an_avro_event_with_a_stable_id() -> None:
    core = SchedulerCore()
    run(core, [node_report("n1", T0)])
    (d,) = decisions(run(core, [request("s1", T0 + 1)]))
    m = d.to_model()
    back = decode_event(m.encode())
    assert back == m and m.header.event_id == d.event_id and m.header.sandbox == "s1"
    assert m.scores["total"] == d.scores["total"]


def test_status_shows_states_expiring_leases_queues_and_nodes() -> None:
    core, log = SchedulerCore(None, {"acme": 4.0}), Log()
    run(core, [node_report("n1", T0, cpu=8, mem=65_536), node_report("n2", T0, cpu=4,
                                                                      mem=65_536)])
    run(core, [request("s1", T0, cpu=4, mem=1), request("s2", T0, cpu=4, mem=1)])
    run(core, [log.lifecycle("s1", T0 + 1, "PROVISIONING"), tick(T0 + 9 * MIN + 30_000)])
    st_ = core.status()
    assert st_["sandboxes_by_state"]["PROVISIONING"] == 1
    assert [e["sandbox"] for e in st_["leases_expiring"]] == ["s1"]
    assert st_["queued_by_tenant"]["acme"]["queued"] == 1
    assert [n["node"] for n in st_["nodes_by_headroom"]] == ["n1", "n2"]
    assert st_["nodes_by_headroom"][0]["fresh"] is False  # no report for 9.5 minutes


def test_cpu_only_work_keeps_off_gpu_nodes_unless_nothing_else_fits() -> None:
    core = SchedulerCore()
    run(core, [node_report("gpu", T0, cpu=8, mem=16_384, gpu=1.0),
               node_report("cpu", T0, cpu=64, mem=262_144)])
    (d,) = decisions(run(core, [request("s1", T0 + 1, cpu=60, mem=1024)]))
    assert d.node == "cpu" and d.scores["gpu_reserve"] == 0.0
    (d2,) = decisions(run(core, [request("s2", T0 + 2, cpu=8, mem=1024)]))
    assert d2.node == "gpu" and d2.scores["gpu_reserve"] < 0  # the only node with room


# -- 7. edges: lease deadline, queued sandboxes (issue 14, finding 4) -------------------------
@pytest.mark.parametrize("with_ticks", [False, True])
def test_heartbeat_exactly_at_the_lease_deadline_renews_it(with_ticks: bool) -> None:
    """The lease covers its deadline: one beat missed, the next arriving exactly at the
    deadline keeps the sandbox; only a moment strictly after the deadline reclaims it."""
    core, log = SchedulerCore(), Log()
    active_sandbox(core, log, "s1", T0)
    deadline = sbx(core, "s1").lease_deadline  # ACTIVE at T0 + 1000 renewed it: + 10 min
    assert deadline == T0 + 1000 + 10 * MIN
    events = [tick(deadline)] if with_ticks else []  # the beat at deadline - 5 min is missed
    assert run(core, [*events, log.heartbeat("s1", deadline)]) == []
    assert sbx(core, "s1").state == "ACTIVE"
    assert sbx(core, "s1").lease_deadline == deadline + 10 * MIN
    assert run(core, [tick(deadline + 10 * MIN)]) == []  # at the new deadline: still leased
    (d,) = decisions(run(core, [tick(deadline + 10 * MIN + 1)]))
    assert (d.decision, d.time_ms) == ("RECLAIM", deadline + 10 * MIN + 1)
    assert "missed 2 heartbeats" in d.reason and d.details["missed_heartbeats"] == "2"


@pytest.mark.parametrize(("ttl", "missed_to_reclaim", "missed"), [
    (10 * MIN, 2, 2),  # the reference: two 5-minute beats missed
    (7 * MIN, 2, 1),   # a 7-minute lease runs out after one missed beat
    (3_000, 2, 0),     # a lease shorter than the heartbeat interval: no beat was due yet
    (20 * MIN, 3, 3),  # three missed beats configured
])
def test_reclaim_reason_gives_the_real_number_of_missed_heartbeats(
        ttl: int, missed_to_reclaim: int, missed: int) -> None:
    s = SchedulerSettings(lease_ttl_ms=ttl, missed_heartbeats_to_reclaim=missed_to_reclaim)
    core, log = SchedulerCore(s), Log()
    run(core, [log.lifecycle("s1", T0, "PROVISIONING", node="n1")])  # adopted: renewed at T0
    window = min(ttl, missed_to_reclaim * 5 * MIN)
    assert run(core, [tick(T0 + window)]) == []
    (d,) = decisions(run(core, [tick(T0 + window + 1)]))
    assert d.decision == "RECLAIM" and d.details["missed_heartbeats"] == str(missed)
    noun = "heartbeat" if missed == 1 else "heartbeats"
    assert f"missed {missed} {noun}" in d.reason, d.reason
    assert d.details["last_renewal_ms"] == str(T0)


def _queued_s2(core: SchedulerCore) -> None:
    """n1 holds one 8-CPU sandbox: s1 placed, s2 queued for capacity."""
    _full_node_with_one_sandbox(core)
    assert core.queued("acme")[0]["sandbox"] == "s2"


def test_heartbeats_and_probes_of_a_queued_sandbox_are_not_dead_letters() -> None:
    """A queued sandbox is known: its heartbeats and probes are counted and otherwise ignored
    (it holds no lease yet, so there is nothing to renew or drain); its lease starts when it
    is placed."""
    core, log = SchedulerCore(), Log()
    _queued_s2(core)
    before = core.snapshot()
    out = run(core, [log.heartbeat("s2", T0 + 5 * MIN), log.probe("s2", T0 + 5 * MIN + 1, False),
                     log.probe("s2", T0 + 5 * MIN + 2, False),
                     log.probe("s2", T0 + 5 * MIN + 3, False)])
    assert out == []
    assert core.stats["queued_heartbeat"] == 1 and core.stats["queued_probe"] == 3
    assert {k: v for k, v in core.snapshot().items() if k != "meta"} == \
        {k: v for k, v in before.items() if k != "meta"}
    assert core.sandbox("s2") is None and core.queued("acme")[0]["sandbox"] == "s2"
    # s1 recycles: s2 is placed, with a full lease from its placement
    t = T0 + 6 * MIN
    out = run(core, [release("s1", t), log.drained("s1", t + 1, {}),
                     node_report("n1", t + 2, cpu=8, mem=16_384)])
    assert kinds(out) == ["DRAIN", "RECYCLE", "ADMIT", "PLACE"]
    assert sbx(core, "s2").lease_deadline == t + 2 + 10 * MIN


def _queued_sandbox_leaves(log: Log, how: str, t: int) -> list[tuple[str, dict[str, Any]]]:
    if how == "reports DRAINING":
        return [log.lifecycle("s2", t, "DRAINING", reason="recycle")]
    if how == "reports RECYCLED":
        return [log.lifecycle("s2", t, "RECYCLED")]
    if how == "sends Drained":
        return [log.drained("s2", t, {})]
    if how == "is released":
        return [release("s2", t)]
    assert how == "is caught looping"
    return [alert("s2", t)]


_LEAVES = ["reports DRAINING", "reports RECYCLED", "sends Drained", "is released",
           "is caught looping"]


@pytest.mark.parametrize("how", _LEAVES)
def test_a_sandbox_that_ends_while_queued_leaves_the_queue_and_is_never_placed(
        how: str) -> None:
    core, log = SchedulerCore(), Log()
    _queued_s2(core)
    out = run(core, _queued_sandbox_leaves(log, how, T0 + 1000))
    closing = decisions(out)[-1]
    assert closing.decision == "RECYCLE" and closing.sandbox == "s2"
    assert closing.details["queued"] == "true" and closing.request_id == "r-s2"
    assert not [o for o in out if isinstance(o, DeadLetterOut)]
    assert core.queued("acme") == []
    assert sbx(core, "s2").state == "RECYCLED" and sbx(core, "s2").node is None
    if how == "is caught looping":
        assert kinds(out) == ["TERMINATE", "RECYCLE"] and closing.suspicious
    else:
        assert kinds(out) == ["RECYCLE"]
    # s1 recycles: the freed slot is not given to s2; nothing is reserved for it
    out = run(core, [release("s1", T0 + 2000), log.drained("s1", T0 + 2001, {}),
                     node_report("n1", T0 + 2002, cpu=8, mem=16_384), tick(T0 + 3000)])
    assert kinds(out) == ["DRAIN", "RECYCLE"]
    n = nodex(core, "n1")
    assert (n.res_cpu, n.res_mem, n.sandboxes) == (0.0, 0, set())
    acme = core.tenant("acme")
    assert acme is not None and acme.usage == 0.0
    # the rest of its ending, as it reports it afterwards, and a redelivered request, are
    # recognised and change nothing
    rest = {"reports DRAINING": ["Drained", "RECYCLED"], "reports RECYCLED": [],
            "sends Drained": ["RECYCLED"]}.get(how, ["DRAINING", "Drained", "RECYCLED"])
    late = [log.drained("s2", T0 + 4000 + i, {}) if step == "Drained" else
            log.lifecycle("s2", T0 + 4000 + i, step) for i, step in enumerate(rest)]
    assert run(core, [*late, request("s2", T0 + 4010)]) == []
    assert core.stats["duplicate"] == 1  # the request
    assert core.queued("acme") == [] and sbx(core, "s2").state == "RECYCLED"


def test_a_sandbox_running_before_its_placement_is_an_anomaly_but_its_drain_withdraws_it(
) -> None:
    """An open-loop runtime (it starts a queued sandbox anyway): PROVISIONING and ACTIVE while
    queued are anomalies; heartbeats and probes are tolerated; its own drain ends the
    request -- it is never placed afterwards, and every reservation comes back."""
    core, log = SchedulerCore(), Log()
    _queued_s2(core)
    story = [log.lifecycle("s2", T0 + 100, "PROVISIONING", node="n1"),
             log.lifecycle("s2", T0 + 200, "ACTIVE"), log.heartbeat("s2", T0 + 300),
             log.probe("s2", T0 + 400, True), log.lifecycle("s2", T0 + 500, "DRAINING"),
             log.drained("s2", T0 + 600, {"e0": 4}), log.lifecycle("s2", T0 + 700, "RECYCLED")]
    out = run(core, story)
    assert kinds(out) == ["ANOMALY", "ANOMALY", "RECYCLE"]
    assert not [o for o in out if isinstance(o, DeadLetterOut)]
    out = run(core, [release("s1", T0 + 1000), log.drained("s1", T0 + 1001, {}),
                     node_report("n1", T0 + 1002, cpu=8, mem=16_384)])
    assert kinds(out) == ["DRAIN", "RECYCLE"]
    assert nodex(core, "n1").res_cpu == 0.0


def test_withdrawn_queued_sandbox_survives_a_restart_from_the_changelog() -> None:
    core, log = SchedulerCore(), Log()
    _queued_s2(core)
    run(core, [log.lifecycle("s2", T0 + 1000, "DRAINING")])
    changelog = core.take_dirty()
    core2 = SchedulerCore()
    core2.restore_snapshot(changelog)
    assert core2.snapshot() == core.snapshot()
    out = run(core2, [log.lifecycle("s2", T0 + 2000, "RECYCLED"), request("s2", T0 + 2001)])
    assert out == [] and core2.queued("acme") == []


def _fleet_invariants(core: SchedulerCore, names: list[str]) -> None:
    """Every node's ledger and every tenant's usage is exactly what its placed, not yet
    recycled sandboxes hold."""
    live = [sb for sb in map(core.sandbox, names)
            if sb is not None and sb.state != "RECYCLED" and sb.node is not None]
    for node in core.status()["nodes_by_headroom"]:
        n = nodex(core, node["node"])
        mine = [sb for sb in live if sb.node == n.node]
        assert n.res_cpu == pytest.approx(sum(sb.cpu for sb in mine), abs=1e-6), n.node
        assert n.sandboxes == {sb.sandbox for sb in mine}
    for name in core.status()["queued_by_tenant"]:
        t = core.tenant(name)
        assert t is not None
        assert t.usage == pytest.approx(sum(sb.cpu for sb in live if sb.tenant == name),
                                        abs=1e-6)


def _fleet(seed: int, n: int, closed_loop: bool) -> tuple[SchedulerCore, list[Output]]:
    """A fleet of ``n`` sandboxes from two tenants whose credit admits 3 at a time each, on
    two nodes reporting every 5 s, ticks every second. Closed loop: a sandbox starts
    (lifecycle, heartbeats every 5 min, probes every minute, then its own drain) when it is
    placed. Open loop: it starts at its request, placed or not. Runs until every request is
    closed; returns the core and every output."""
    import heapq

    rng = random.Random(seed)
    log = Log()
    core = SchedulerCore(SchedulerSettings(tenant_burst_max_ms=10**9), {"a": 8.0, "b": 8.0})
    pending: list[tuple[int, int, tuple[str, dict[str, Any]]]] = []
    k = itertools.count()

    def at(t: int, e: tuple[str, dict[str, Any]]) -> None:
        heapq.heappush(pending, (t, next(k), e))

    def script(sb: str, t: int) -> None:
        at(t + 100, log.lifecycle(sb, t + 100, "PROVISIONING", node="n0"))
        at(t + 600, log.lifecycle(sb, t + 600, "ACTIVE"))
        end = t + 600 + rng.randrange(1, 17) * MIN
        for b in range(1, (end - t) // (5 * MIN) + 1):
            at(t + b * 5 * MIN, log.heartbeat(sb, t + b * 5 * MIN))
        for p in range(1, (end - t) // MIN + 1):
            at(t + p * MIN, log.probe(sb, t + p * MIN, rng.random() < 0.9))
        at(end, log.lifecycle(sb, end, "DRAINING", reason="recycle"))
        at(end + 1000, log.drained(sb, end + 1000, {}))
        at(end + 2000, log.lifecycle(sb, end + 2000, "RECYCLED"))

    names = [f"s{i:03d}" for i in range(n)]
    for sb in names:
        t = T0 + 1000 + rng.randrange(0, 5 * MIN)
        at(t, request(sb, t, tenant=rng.choice("ab"), cpu=2.5, mem=1024))
        if not closed_loop:
            script(sb, t)
    at(T0, tick(T0))
    closed: set[str] = set()
    out: list[Output] = []
    while pending:
        t, _, (kind, rec) = heapq.heappop(pending)
        if kind == "Tick" and len(closed) < n and t < T0 + 12 * 60 * MIN:
            # the clock runs while requests are open (bounded: a stuck fleet fails below)
            at(t + 1000, tick(t + 1000))
            if (t - T0) % 5000 == 0:
                for i in range(2):
                    at(t, node_report(f"n{i}", t, cpu=8, mem=65_536))
        got = core.handle(kind, rec)
        out += got
        for d in decisions(got):
            assert d.sandbox is not None
            if d.decision == "PLACE" and closed_loop:
                script(d.sandbox, d.time_ms)
            if d.decision.startswith("RECYCLE"):
                closed.add(d.sandbox)
        if kind != "Tick":
            _fleet_invariants(core, names)
    return core, out


@pytest.mark.parametrize("seed", [1, 2])
def test_closed_loop_fleet_ends_every_lifecycle_cleanly(seed: int) -> None:
    """Sandboxes that wait for their placement (as a real runtime does): no dead letter, no
    anomaly, and every sandbox PLACE -> DRAIN -> RECYCLE exactly once, some after queueing;
    at the end nothing is reserved."""
    core, out = _fleet(seed, 24, closed_loop=True)
    assert [o for o in out if isinstance(o, DeadLetterOut)] == []
    assert decisions(out, "ANOMALY") == []
    by_sb: dict[str, list[str]] = {}
    for d in decisions(out):
        if d.sandbox is not None:
            by_sb.setdefault(d.sandbox, []).append(d.decision)
    assert len(by_sb) == 24
    for sb, ks in by_sb.items():
        assert [x for x in ks if x not in ("QUEUE", "ADMIT")] == ["PLACE", "DRAIN", "RECYCLE"], sb
    assert sum("QUEUE" in ks for ks in by_sb.values()) >= 5
    for i in range(2):
        n = nodex(core, f"n{i}")
        assert (n.res_cpu, n.sandboxes) == (0.0, set())


@pytest.mark.parametrize("seed", [1, 2])
def test_open_loop_fleet_never_places_a_sandbox_that_already_ended(seed: int) -> None:
    """Sandboxes that run whether placed or not (the old simulator): no dead letters, no
    placement after the sandbox's own drain, and in the end every request is closed, every
    reservation released."""
    core, out = _fleet(seed, 24, closed_loop=False)
    assert [o for o in out if isinstance(o, DeadLetterOut)] == []
    ended: set[str] = set()
    for o in out:
        if isinstance(o, DecisionOut) and o.sandbox is not None:
            if o.decision == "PLACE":
                assert o.sandbox not in ended, o.sandbox
            if o.decision in ("DRAIN", "RECYCLE", "RECYCLE_WITH_LOSS"):
                ended.add(o.sandbox)
    assert len(decisions(out, "RECYCLE")) + len(decisions(out, "RECYCLE_WITH_LOSS")) == 24
    for i in range(2):
        n = nodex(core, f"n{i}")
        assert (n.res_cpu, n.sandboxes) == (0.0, set())
    assert core.queued("a") == [] and core.queued("b") == []
