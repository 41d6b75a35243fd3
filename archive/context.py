"""The decision context of episodes: how each one ended, from the archive alone (pure).

No I/O here: :mod:`~trajbus.archive.query` reads the rows (the sandboxes' lifecycle streams
from ``events/``, the ``decisions/`` and ``alerts/`` areas) and :func:`context_facts` turns
them into :class:`ContextFacts`; :func:`episode_ending` decides one episode's outcome.

An episode's ``ending``:

* ``terminated``: a ``TERMINATE`` decision names it: its ``header.episode`` is the episode
  (the watchdog's decision), or one of its ``cause_event_ids`` is an alert about the episode
  (the scheduler's decision, taken on the watchdog's LOOP alert). It wins over the episode's
  own end: the loop was the reason the sandbox was stopped. ``terminate_decision_id`` is the
  decision the sandbox runtime acknowledged (a ``DecisionAck`` naming it), else the
  earliest matching one (the scheduler's first on a tie); ``terminate_decided_by`` who
  produced it (``scheduler`` / ``watchdog``), ``terminate_ack`` the runtime's answer
  (``DONE`` / ``FAILED``; null when it did not answer).
* ``complete``: its ``EpisodeEnd`` says ``TERMINAL``.
* ``truncated``: it ended early; ``truncated_by`` says how:

  - ``runtime``: its ``EpisodeEnd`` says ``TRUNCATED`` (the runtime's reason, e.g. "agent
    process crashed", is the EpisodeEnd's ``reason`` in ``events``);
  - ``recycle``: no ``EpisodeEnd``, and the sandbox went away with the episode open on its own
    (its lifecycle shows ``Drained`` or ``RECYCLED``, or the scheduler recycled it) -- the
    agent or its runtime crashed;
  - ``drain`` / ``reclaim`` / ``terminate``: no ``EpisodeEnd``, and the scheduler's first
    decision that drained the sandbox was a ``DRAIN`` (failed liveness probes, trainer
    release; not the DRAIN answering the sandbox's own DRAINING report, which is
    ``recycle``), a ``RECLAIM`` (missed heartbeats) or a ``TERMINATE`` not about this
    episode.

* ``in_progress``: none of these yet: no end, and the sandbox has not been drained, recycled,
  reclaimed or terminated (sandboxes are one-shot: once gone, every open episode of theirs
  is truncated, so a crashed episode leaves ``in_progress`` as soon as its sandbox's ending
  is archived).

Scheduling decisions come from two producers, told apart by their producer id
(:func:`decided_by`): the scheduler (``trajbus.scheduler``) and the watchdog
(``trajbus.watchdog``; its TERMINATE on a loop).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

ENDINGS = ("complete", "truncated", "terminated", "in_progress")
TRUNCATED_BY = ("runtime", "recycle", "drain", "reclaim", "terminate")
STREAM_KINDS = ("SandboxLifecycle", "Drained", "DecisionAck")
"""The kinds of a sandbox's lifecycle stream the outcome depends on."""


def decided_by(producer_id: str | None) -> str:
    """Who produced a decision: its producer id without the ``trajbus.`` prefix
    (``scheduler``, ``watchdog``); the whole id for other producers."""
    pid = producer_id or ""
    return pid.removeprefix("trajbus.") or "unknown"


def payload(row: Mapping[str, Any]) -> dict[str, Any]:
    """The ``payload_json`` fields of an archive row (``{}`` when it has none)."""
    text = row.get("payload_json")
    if not text:
        return {}
    value = json.loads(text)
    return value if isinstance(value, dict) else {}


@dataclass(frozen=True, slots=True)
class Terminate:
    """A TERMINATE decision, as the outcome needs it."""

    decision_id: str
    time_ms: int
    decided_by: str
    episode: str | None
    causes: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class Cut:
    """A scheduler decision that starts a sandbox's drain (DRAIN, RECLAIM, TERMINATE)."""

    time_ms: int
    kind: str  # "drain" | "reclaim" | "terminate"
    causes: tuple[str, ...]
    decision_id: str


@dataclass
class SandboxFacts:
    """What the archive knows of one sandbox's end and the decisions about it."""

    gone: bool = False  # Drained / RECYCLED seen, or the scheduler recycled it
    cuts: list[Cut] = field(default_factory=list)
    own_ids: set[str] = field(default_factory=set)  # its own lifecycle reports' event ids
    terminates: list[Terminate] = field(default_factory=list)
    acks: dict[str, str] = field(default_factory=dict)  # decision id -> DONE | FAILED

    def cut_by(self) -> str | None:
        """What ended the sandbox if the scheduler did: the kind of its first drain-starting
        decision, unless that was a DRAIN answering the sandbox's own DRAINING report (then
        the sandbox went away on its own: None)."""
        if not self.cuts:
            return None
        first = min(self.cuts, key=lambda c: (c.time_ms, c.decision_id))
        if first.kind == "drain" and self.own_ids.intersection(first.causes):
            return None
        return first.kind


@dataclass
class ContextFacts:
    """Per (task, sandbox): :class:`SandboxFacts`; per alert id: its (sandbox, episode)."""

    sandboxes: dict[tuple[str, str], SandboxFacts] = field(default_factory=dict)
    alert_episode: dict[str, tuple[str, str | None]] = field(default_factory=dict)

    def of(self, task: str, sandbox: str) -> SandboxFacts | None:
        return self.sandboxes.get((task, sandbox))


_CUTS = {"DRAIN": "drain", "RECLAIM": "reclaim", "TERMINATE": "terminate"}
_GONE = {"RECYCLE", "RECYCLE_WITH_LOSS"}


def context_facts(stream: Iterable[Mapping[str, Any]],
                  decisions: Iterable[Mapping[str, Any]],
                  alerts: Iterable[Mapping[str, Any]]) -> ContextFacts:
    """Facts from archive rows (dicts of archive columns: ``task, sandbox, episode, kind,
    state, event_id, event_time_ms, producer_id, outcome, payload_json``): ``stream`` the
    sandboxes' lifecycle rows (:data:`STREAM_KINDS`), ``decisions`` and ``alerts`` the rows of
    those areas. Order does not matter."""
    facts = ContextFacts()

    def sb(row: Mapping[str, Any]) -> SandboxFacts:
        key = (str(row["task"]), str(row["sandbox"]))
        f = facts.sandboxes.get(key)
        if f is None:
            f = facts.sandboxes[key] = SandboxFacts()
        return f

    for row in stream:
        kind = row.get("kind")
        if kind == "SandboxLifecycle" and row.get("event_id"):
            sb(row).own_ids.add(str(row["event_id"]))
        if kind == "Drained" or (kind == "SandboxLifecycle" and row.get("state") == "RECYCLED"):
            sb(row).gone = True
        elif kind == "DecisionAck":
            p = payload(row)
            if p.get("decision_event_id"):
                sb(row).acks[str(p["decision_event_id"])] = str(row.get("outcome") or "FAILED")
    for row in alerts:
        if row.get("event_id"):
            facts.alert_episode[str(row["event_id"])] = (str(row["sandbox"]), row.get("episode"))
    for row in decisions:
        p = payload(row)
        kind = p.get("decision")
        t = int(row.get("event_time_ms") or 0)
        f = sb(row)
        if kind in _GONE:
            f.gone = True
        causes = tuple(str(c) for c in p.get("cause_event_ids") or ())
        by = decided_by(row.get("producer_id"))
        cut = _CUTS.get(str(kind))
        if cut is not None and by != "watchdog":  # the watchdog asks; the scheduler cuts
            f.cuts.append(Cut(t, cut, causes, str(row.get("event_id") or "")))
        if kind == "TERMINATE":
            f.terminates.append(Terminate(str(row.get("event_id") or ""), t, by,
                                          row.get("episode"), causes))
    return facts


@dataclass(frozen=True, slots=True)
class Ending:
    ending: str
    truncated_by: str | None = None
    terminate_decision_id: str | None = None
    terminate_decided_by: str | None = None
    terminate_ack: str | None = None


def episode_ending(facts: ContextFacts, task: str, sandbox: str, episode: str,
                   has_end: bool, outcome: str | None) -> Ending:
    """How one episode ended (see the module docstring)."""
    f = facts.of(task, sandbox)
    if f is not None and f.terminates:
        mine = [d for d in f.terminates
                if d.episode == episode or any(
                    facts.alert_episode.get(c) == (sandbox, episode) for c in d.causes)]
        if mine:
            acked = [d for d in mine if d.decision_id in f.acks]
            pick = min(acked or mine, key=lambda d: (d.time_ms, d.decided_by != "scheduler",
                                                     d.decision_id))
            return Ending("terminated", None, pick.decision_id, pick.decided_by,
                          f.acks.get(pick.decision_id))
    if has_end:
        if outcome == "TRUNCATED":
            return Ending("truncated", "runtime")
        return Ending("complete")
    cut = f.cut_by() if f is not None else None
    if cut is not None:
        return Ending("truncated", cut)
    if f is not None and f.gone:
        return Ending("truncated", "recycle")
    return Ending("in_progress")
