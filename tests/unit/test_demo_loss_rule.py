"""The demo's (and the soak's) check of a RECYCLE_WITH_LOSS on a sandbox that did not crash.

Such a verdict is the platform's rule at work only when the log shows it: downstream's
confirmation of the final seqs (or the sandbox's Drained report) is in the log after the drain
grace window ended. A confirmation logged before the window's end means the scheduler judged by
a clock ahead of its inputs, and the check must fail. Soak run 9 at 2131e1e (RELIABILITY.md)
failed on the old rule, which looked only at the longest broker outage.
"""

from __future__ import annotations

from trajbus.pipeline_demo import Faults, ReplayTopics, _unexplained_loss

END = 1_000_000  # the grace window's end (log time, ms)


def _replay(*confirmations: tuple[int, int]) -> ReplayTopics:
    replay = ReplayTopics()
    replay.confirmations[("sb-1", "ep-1")] = list(confirmations)
    return replay


def _window_ended(lost: str) -> dict[str, str]:
    return {"drained": "true", "lost": lost, "grace_ended_ms": str(END)}


def test_confirmation_logged_after_the_window_explains_the_loss() -> None:
    replay = _replay((5, END - 10_000), (9, END + 4_000))
    assert _unexplained_loss("sb-1", _window_ended("ep-1:6-9"), replay, Faults()) is None


def test_confirmation_logged_before_the_window_ended_is_a_bug() -> None:
    replay = _replay((9, END - 1), (9, END + 4_000))  # re-confirmed later: the first one counts
    why = _unexplained_loss("sb-1", _window_ended("ep-1:6-9"), replay, Faults())
    assert why is not None and "confirmed seq 9 at 999999" in why


def test_a_confirmation_exactly_at_the_window_end_came_in_time() -> None:
    replay = _replay((9, END))
    assert _unexplained_loss("sb-1", _window_ended("ep-1:6-9"), replay, Faults()) is not None


def test_only_a_confirmation_reaching_the_final_seq_counts() -> None:
    replay = _replay((8, END - 5_000), (9, END + 1))
    assert _unexplained_loss("sb-1", _window_ended("ep-1:6-9"), replay, Faults()) is None
    replay = _replay((8, END + 1))
    why = _unexplained_loss("sb-1", _window_ended("ep-1:6-9"), replay, Faults())
    assert why is not None and "never confirmed seq 9" in why


def test_every_lost_episode_must_be_explained() -> None:
    replay = _replay((9, END + 1))
    replay.confirmations[("sb-1", "ep-2")] = [(3, END - 1)]
    why = _unexplained_loss("sb-1", _window_ended("ep-1:6-9,ep-2:2-3"), replay, Faults())
    assert why is not None and "ep-2:2-3" in why


def test_a_missing_drained_report_is_explained_only_by_one_logged_after_the_window() -> None:
    details = {"drained": "false", "grace_ended_ms": str(END),
               "lost": "unknown: no Drained event; events after the acked seqs"}
    replay = ReplayTopics()
    replay.sandbox_stream["sb-1"] = {0: ("SandboxLifecycle", END - 20_000),
                                     1: ("Drained", END - 10_000)}
    assert _unexplained_loss("sb-1", details, replay, Faults()) is not None
    # the report waits (the sandbox's stream is put back in seq order) for a late seq 0
    replay.sandbox_stream["sb-1"][0] = ("SandboxLifecycle", END + 2_000)
    assert _unexplained_loss("sb-1", details, replay, Faults()) is None
    assert _unexplained_loss("sb-1", details, ReplayTopics(), Faults()) is not None


def test_an_emitter_that_could_not_flush_needs_a_broker_outage() -> None:
    details = {"drained": "true", "lost": "unflushed:3"}  # the emitter's own report
    assert _unexplained_loss("sb-1", details, ReplayTopics(), Faults()) is not None
    assert _unexplained_loss("sb-1", details, ReplayTopics(),
                             Faults(longest_outage_s=12.0)) is None
