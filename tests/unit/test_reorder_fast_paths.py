"""The reorder core's fast path (the next expected event of an open episode with nothing
buffered) and stall path (a plain event that starts, extends or releases an episode's buffer)
are shortcuts of its full transition: a core that takes neither gives the same outputs,
changelog, snapshot and counters on the same log. Random logs of shuffled, duplicated,
conflicting and missing events, ends, recycles, drains, held events, bad input and ticks.
Pure: no broker."""

from __future__ import annotations

import random
from typing import Any

import pytest

from trajbus.bus.settings import ReplaySettings
from trajbus.consumers.replay.core import InEvent, Output, ReorderCore


class FullTransitionOnly(ReorderCore):
    """Every event through ``_slow``: :meth:`ReorderCore.handle` without its shortcuts."""

    def handle(self, ev: InEvent, origin: tuple[Any, ...] | None = None) -> list[Output]:
        if self._restored or self._restored_held:
            self._arm_restored()
        try:
            t, log_t = ev.event_time_ms, ev.log_time_ms
            ep = None
            if type(t) is int:
                if t > self._clock and self._event_clock:
                    self._clock = t
                self._now = log_t if log_t > self._clock else self._clock
                ep = self._eps.get((ev.sandbox, ev.episode))  # type: ignore[arg-type]
            else:
                self._now = self._clock
            out: list[Output] = []
            self._slow(ev, ep, out, origin)
            if self._clock >= self._next_due:
                self._fire(out)
            return out
        except Exception as exc:
            return [self._dl(ev, "internal_error", f"{type(exc).__name__}: {exc}")]


def _log(rng: random.Random) -> list[tuple[str, Any]]:
    streams = []
    n_sb = rng.randrange(1, 5)
    for i in range(rng.randrange(3, 25)):
        sb, ep = f"sb{rng.randrange(n_sb)}", f"e{i}"
        length = rng.randrange(1, 30)
        evs = []
        for s in range(length):
            kind, outcome = ("EpisodeStart" if s == 0 else "ToolCall"), None
            if s == length - 1 and rng.random() < 0.7:
                kind, outcome = "EpisodeEnd", rng.choice(["TERMINAL", "TRUNCATED"])
            evs.append([sb, ep, s, kind, f"{sb}|{ep}|{s}".encode() + b"x" * rng.randrange(99),
                        outcome])
        evs = [e for e in evs if rng.random() > 0.05]  # gaps
        evs += [list(e) for e in evs if rng.random() < 0.05]  # exact duplicates
        evs += [[*e[:4], e[4] + b"!", e[5]] for e in evs if rng.random() < 0.02]  # conflicts
        for j in range(len(evs)):  # displaced within a few positions
            if rng.random() < 0.2:
                k = min(len(evs) - 1, j + rng.randint(1, 6))
                evs[j], evs[k] = evs[k], evs[j]
        streams.append(evs)
    log: list[tuple[str, Any]] = []
    t = 1_000
    while any(streams):
        sb, ep, s, kind, raw, outcome = rng.choice([x for x in streams if x]).pop(0)
        t += rng.randrange(50)
        log.append(("ev", InEvent("t", sb, ep, s, t + rng.randrange(-99, 99), kind, raw, outcome,
                                  log_time_ms=t + rng.choice([0, 0, rng.randrange(5_000)]))))
        r = rng.random()
        if r < 0.03:
            log.append(("tick", t + rng.randrange(4_000)))
        elif r < 0.04:
            sb = f"sb{rng.randrange(n_sb)}"
            log.append(("ev", InEvent("t", sb, None, -1, t, "SandboxLifecycle", b"r",
                                      state="RECYCLED", log_time_ms=t)))
        elif r < 0.05:
            sb = f"sb{rng.randrange(n_sb)}"
            finals = tuple((f"e{rng.randrange(25)}", rng.randrange(30)) for _ in range(2))
            log.append(("ev", InEvent("t", sb, None, -1, t, "Drained", b"d", final_seqs=finals,
                                      log_time_ms=t + rng.randrange(3_000))))
        elif r < 0.055:
            log.append(("ev", InEvent("t", "sb0", "e0", rng.choice([-2, 3]), t, "ToolCall",
                                      rng.choice([b"b", "not bytes"]))))  # type: ignore[arg-type]
    log.append(("tick", t + 10_000_000))
    return log


@pytest.mark.parametrize("seed", range(60))
def test_the_shortcuts_give_what_the_full_transition_gives(seed: int) -> None:
    rng = random.Random(seed)
    settings = ReplaySettings(
        gap_timeout_ms=rng.choice([0, 500, 2_000]),
        max_buffered_per_episode=rng.choice([3, 10, 10_000]),
        max_buffered_total=rng.choice([8, 50, 2_000_000]),
        max_open_episodes_per_sandbox=rng.choice([0, 1, 2, 64]))
    kw: dict[str, Any] = dict(
        dedupe_window=rng.choice([4, 64]), idle_timeout_ms=rng.choice([None, 3_000]),
        max_segment_events=rng.choice([None, 3]), event_time_clock=rng.random() < 0.8,
        max_buffered_bytes_per_episode=rng.choice([None, 700]))
    fast, full = ReorderCore(settings, **kw), FullTransitionOnly(settings, **kw)
    for i, (what, x) in enumerate(_log(rng)):
        if what == "tick":
            assert fast.tick(x) == full.tick(x), i
        else:
            assert fast.handle(x, ("topic", 0, i, None)) == full.handle(x, ("topic", 0, i, None)), i
        if i % 7 == 0:
            assert fast.take_dirty() == full.take_dirty(), i
    assert fast.snapshot() == full.snapshot()
    assert fast.counters() == full.counters()
