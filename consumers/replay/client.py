"""The trainer client: subscribe to replay topics and receive each episode in order, once.

Guarantees
----------
* **Order**: segments of an episode arrive in sequence order (the reorder processor publishes
  them keyed by ``sandbox/episode``, so one episode lives in one partition, in order).
* **Once**: the client drops any event whose (sandbox, episode, seq) it has already delivered
  (a re-derived or zombie-duplicated segment), trimming partly overlapping segments.
* **Commit after acknowledgement**: a Kafka offset is committed only when the trainer has
  acknowledged that segment *and every earlier one in the partition* (offsets that hold no
  record for this reader -- the worker's transaction markers, aborted records -- count as
  passed, learnt from the offsets skipped between records read in order). Offsets acknowledged
  beyond that point are stored in the commit's metadata, so nothing acknowledged is lost,
  in either commit style below.
* **Coalesced commits** (the default, ``commit_every_ms=100``): ``ack`` returns at once and
  what is acknowledged is committed at most once per N ms, one commit in flight; a crash
  re-delivers at most the acknowledgements made since the last commit. The ack that finds a
  commit due starts it (and gives it a few turns of the event loop, once per commit), so a
  loop that trains without awaiting still commits every N ms; a committer task commits the
  last acknowledgements. ``await client.commit()`` returns once everything acknowledged so
  far is committed (before saving a checkpoint, say); ``stop()`` commits too, and so does a
  rebalance that takes partitions away.
  What cannot be committed cannot be kept: an acknowledgement ``ack`` returned True for that
  no commit carried before the partition left this member -- the group dropped the member
  (a broker outage, then a loop blocked beyond the session timeout before it could commit)
  or ``stop()``'s last commit failed (the broker away) -- is delivered again to the
  partition's next reader; each is counted (``stats["acks_lost_in_rebalance"]``,
  ``stats["acks_lost_at_stop"]``) and logged (WARNING), never silent.
* **Per-ack commits** (``commit_every_ms=0``): every :meth:`ReplayClient.ack` returns once
  its commit is done; a trainer that crashes and resumes sees neither a gap nor a second copy
  of what it acknowledged. Each ``ack`` costs a commit round trip: catching up on live-sized
  (one-event) segments is many times slower than with coalesced commits (the README's
  trainer section has the figures).
* **Through rebalances** (a broker outage longer than the session timeout makes the consumer
  rejoin; a trainer joins or leaves the group): a commit refused meanwhile is made again once
  the group has settled (for up to :data:`REBALANCE_COMMIT_TIMEOUT_S`, then the call raises;
  the group settles only while the trainer iterates, so a trainer step between two fetches
  must stay under aiokafka's ``max_poll_interval_ms``, 300 s, or the member is taken out of
  the group and an ``ack()`` with per-ack commits waits, then raises ``CommitFailedError``);
  a segment handed out but not acknowledged is never committed as consumed, even when the
  rejoin makes the consumer read it again; a partition that moved to another member is read
  on by that member from the group's commit (what was acknowledged here but not yet committed
  is delivered there again).
* **A group of trainers** (one ``group_id``, members joining and leaving): an acknowledged
  episode is never delivered again to another member. :meth:`ReplayClient.ack` returns
  True when the acknowledgement is the group's (per-ack: committed; coalesced: the
  partition is still this member's, its commits carry it), False when the partition went
  to another member since the item was handed out (that member delivers it again, whole).
  The commit's metadata names every run of offsets acknowledged beyond the commit point
  (compactly: thousands of live segments fit), and a member taking a partition reads it;
  the commit point never passes the first segment of an episode not acknowledged, so a
  partition moved mid-episode never yields a fragment. ``Episode.complete`` is False
  (``fragment_reason``) for an episode read from after its first segment (a start
  position inside it, retention) or missing one.
* **Leaving a loop early** (``break`` after a batch of episodes, an exception in the loop):
  the next iterator of the client reads again what the last one had fetched from Kafka but
  not handed out -- the segments of episodes it had not completed, the rest of its last
  fetch -- so a trainer that takes N episodes per step loses nothing and its commits go on.
  One iterator at a time per client.
* **Start positions** (``start="earliest"``, ``"latest"``, a time): applied to a partition
  the first time this client is assigned it; if the broker cannot answer then, the partition
  waits, paused, until it can (``stats["start_positions_retried"]``) -- never read from the
  group's commit instead.
* **Flow control** (``max_in_flight``, default 256 segments): the iterator does not read
  on while the segments handed out and not acknowledged that the trainer *can acknowledge
  while the iterator waits* reach ``max_in_flight``; so no loop shape waits on itself:

  - segments handed out by an *earlier* iterator of the client (a loop left with ``break``)
    always count: a batch loop acknowledges its batch after its training step, before it
    asks for the next one; a trainer that trains on one batch while the next is collected
    acknowledges it from another task, and the new loop waits for that;
  - the segments the *current* iterator handed out count once one of them has been
    acknowledged while the iterator was fetching or waiting: something beside the loop (a
    task, a thread) acknowledges them, and the loop waits for it. Until then they do not
    count -- a loop that collects a batch of any size before acknowledging it, or never
    acknowledges, could not release them while it waits for the next one. (A loop that
    hands its episodes to tasks thus gets backpressure from their first acknowledgement
    on; before it, it can run up to a fetch past ``max_in_flight``.)
  - the segments ``episodes()`` holds for episodes not complete yet never count (they are
    not the trainer's, and waiting on them could never end).

  At the limit the iterator waits for acknowledgements (``stats["flow_control_waits"]``).
  Without one for 10 s it logs a WARNING naming ``max_in_flight`` and what holds it, then
  every 30 s; after ``flow_control_timeout_s`` (default 300 s: aiokafka's
  ``max_poll_interval_ms``, after which a member that has not fetched is taken out of the
  group anyway; None: never) it raises :class:`FlowControlError` (a ``RuntimeError``). What
  a loop holds beyond the limit is committed only once acknowledged: a loop that never
  acknowledges gets everything, and a restarted trainer reads it all again.
* **Staleness** (``max_staleness`` with ``current_policy_version``): an episode whose oldest
  event's policy version is more than ``max_staleness`` behind the trainer's when it
  completes is dropped whole -- acknowledged, never handed out (``segments()``: each
  segment on its own), counted in ``stats["stale_episodes_dropped"]`` /
  ``["stale_segments_dropped"]`` (``["stale_dropped"]``: their events). ``max_staleness``
  without ``current_policy_version`` is a ``ValueError``.

* **Waits and outages** (``notices.py``, ``ratelimit.py``): a named task still without a
  replay topic after 30 s, a new group, a wait of more than 3 s to join the group are each
  logged (WARNING) with what to do; during a broker outage the Kafka client's own messages
  are held back: one line when it starts failing, a summary every 30 s, one when it works
  again. :meth:`ReplayClient.stop` / :meth:`SyncReplayClient.close` never raise (but the
  caller's own cancellation); the last commit is given up after
  :data:`STOP_COMMIT_TIMEOUT_S`.

Subscription and start position
-------------------------------
* **Which tasks**: names, :data:`ALL_TASKS` (every task, present and future, except the
  operators' ``debug-*`` republish topics) and/or ``task_pattern`` (a regex over task names).
  The client subscribes by topic pattern: a task whose replay topic does not exist yet is
  waited for (a trainer is often started before the fleet) and picked up within 5 s of its
  creation. :func:`list_tasks` says which tasks exist.
* **Where to start** (``start=``): ``"resume"`` (the default) continues from the group's
  committed offsets, from the beginning for partitions it never committed; ``"earliest"``
  re-reads everything retained; ``"latest"`` only what is written after :meth:`start`; a
  time (aware datetime, epoch ms, ISO-8601 or ``"-1h"``) starts each partition at its first
  record written at or after it (Kafka's offsets-for-times). A position other than resume is
  applied the first time this client is assigned each partition, and the next commit makes
  it the group's position: it *resets the group*. Give it to one member (or use a fresh
  group): a second member started with ``"earliest"`` would re-read the partitions it takes
  over. Restart a crashed trainer with ``"resume"``.

Use :class:`ReplayClient` from asyncio, :class:`SyncReplayClient` from plain Python.

Where the code lives: this module is the client's import path and its specification.
:class:`ReplayClient` is one mixin per concern over :mod:`.state` (the fields they share):
:mod:`.lifecycle` (start, stop), :mod:`.iteration` (``segments()``, ``episodes()``),
:mod:`.fetching` (the fetch loop, flow control), :mod:`.decoding` (records to segments,
staleness), :mod:`.acks` (``ack()``, partitions lost), :mod:`.commits` and :mod:`.positions`
(start positions, the group's commits read); :mod:`.config` holds the subscription and the
options' defaults and checks. The names the rooms define stay importable from here (the
``name as name`` imports below are explicit re-exports).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

from trajbus.bus.positions import StartPosition, parse_start
from trajbus.bus.settings import Settings, get_settings
from trajbus.bus.topics import Topics
from trajbus.consumers.replay.acks import AcksMixin
from trajbus.consumers.replay.commits import _COMMIT_TURN_WAIT_S as _COMMIT_TURN_WAIT_S
from trajbus.consumers.replay.commits import _COMMITTER_TURN_S as _COMMITTER_TURN_S
from trajbus.consumers.replay.commits import CommitsMixin
from trajbus.consumers.replay.config import (
    ALL_TASKS,
    DEFAULT_COMMIT_EVERY_MS,
    FLOW_CONTROL_TIMEOUT_S,
    check_options,
    list_tasks,
    replay_topic_pattern,
)
from trajbus.consumers.replay.decoding import _REMEMBERED as _REMEMBERED
from trajbus.consumers.replay.decoding import DecodingMixin
from trajbus.consumers.replay.fetching import _FLOW_WARN_AFTER_S as _FLOW_WARN_AFTER_S
from trajbus.consumers.replay.fetching import _FLOW_WARN_EVERY_S as _FLOW_WARN_EVERY_S
from trajbus.consumers.replay.fetching import FetchingMixin
from trajbus.consumers.replay.items import Episode, FlowControlError, Segment, fragment_reason
from trajbus.consumers.replay.iteration import IterationMixin
from trajbus.consumers.replay.iteration import _count_delivered as _count_delivered
from trajbus.consumers.replay.lifecycle import STOP_COMMIT_TIMEOUT_S, LifecycleMixin
from trajbus.consumers.replay.positions import (
    COMMITTED_AT_START_TIMEOUT_S as COMMITTED_AT_START_TIMEOUT_S,
)
from trajbus.consumers.replay.positions import PositionsMixin
from trajbus.consumers.replay.progress import _PartitionProgress as _PartitionProgress
from trajbus.consumers.replay.progress import encode_acked_beyond, parse_acked_beyond
from trajbus.consumers.replay.rebalance import _GroupRebalancing as _GroupRebalancing
from trajbus.consumers.replay.rebalance import _StartAt as _StartAt
from trajbus.consumers.replay.state import _REBALANCE_RETRY_S as _REBALANCE_RETRY_S
from trajbus.consumers.replay.state import REBALANCE_COMMIT_TIMEOUT_S
from trajbus.consumers.replay.state import _Read as _Read
from trajbus.schemas.codec import Codec, default_codec

if TYPE_CHECKING:
    from trajbus.consumers.replay.sync import SyncReplayClient


class ReplayClient(LifecycleMixin, IterationMixin, FetchingMixin, DecodingMixin,
                   AcksMixin, CommitsMixin, PositionsMixin):
    """Async trainer client over ``trajbus.replay.<task>`` topics."""

    def __init__(
        self,
        tasks: Iterable[str] | str,
        group_id: str,
        settings: Settings | None = None,
        *,
        task_pattern: str | None = None,
        start: StartPosition = "resume",
        max_in_flight: int = 256,
        drop_truncated: bool = False,
        drop_gappy: bool = False,
        max_staleness: int | None = None,
        current_policy_version: Callable[[], int] | None = None,
        codec: Codec | None = None,
        commit_every_ms: float = DEFAULT_COMMIT_EVERY_MS,
        flow_control_timeout_s: float | None = FLOW_CONTROL_TIMEOUT_S,
        group_instance_id: str | None = None,
    ) -> None:
        """``tasks``: task names (one name as a plain string is fine), or :data:`ALL_TASKS`
        (``"*"``) for every task; ``task_pattern``: also every task whose whole name matches
        this regex. The subscription is a topic pattern, so replay topics created after the
        client started are picked up (within ``metadata_max_age_ms``, 5 s) and a task whose
        topic does not exist yet is simply waited for.

        ``start``: ``"resume"`` (default), ``"earliest"``, ``"latest"`` or a time; see
        "Subscription and start position" in the module docstring.

        ``commit_every_ms`` (default :data:`DEFAULT_COMMIT_EVERY_MS`, 100) commits what is
        acknowledged at most once per that interval (``ack`` does not wait), at the price of
        re-delivering up to that interval's acknowledged segments after a crash;
        :meth:`commit` waits for everything acknowledged. ``0`` commits at every
        acknowledgement (``ack`` returns once it is committed): after a crash the trainer
        resumes exactly after its last acknowledgement.

        ``group_instance_id``: static group membership (Kafka's ``group.instance.id``): a
        trainer restarted with the same id takes its previous run's place in the group at
        once, instead of waiting for that run's session to time out (10 s). Unique per
        trainer process of the group. A member with one sends no LeaveGroup when it stops: its
        partitions wait for it for the session timeout.

        ``max_in_flight`` / ``flow_control_timeout_s``: see "Flow control" in the module
        docstring. A loop held at the limit logs a WARNING naming it while it waits, and
        raises :class:`FlowControlError` after ``flow_control_timeout_s`` without an
        acknowledgement (None: it waits, warning, for ever).

        ``max_staleness`` (with ``current_policy_version``, a callable returning the
        trainer's policy version now): an episode (``segments()``: a segment) whose oldest
        event's ``policy_version`` is more than ``max_staleness`` behind is dropped whole:
        acknowledged, never handed out, counted in ``stats`` (``stale_episodes_dropped``,
        ``stale_segments_dropped``; ``stale_dropped`` counts their events). Events without a
        policy version are never stale."""
        check_options(max_in_flight, flow_control_timeout_s, max_staleness,
                      current_policy_version)
        self.settings = settings or get_settings()
        topics = Topics(self.settings)
        self.pattern = replay_topic_pattern(self.settings, tasks, task_pattern)
        named = [tasks] if isinstance(tasks, str) else list(tasks)
        self.tasks = [t for t in named if t != ALL_TASKS]
        self.topics = [topics.replay(t) for t in self.tasks]
        self.group_id = group_id
        self.start_position = parse_start(start)
        self.max_in_flight = max_in_flight
        self.flow_control_timeout_s = flow_control_timeout_s
        self.drop_truncated = drop_truncated
        self.drop_gappy = drop_gappy
        self.max_staleness = max_staleness
        self.current_policy_version = current_policy_version
        self.codec = codec or default_codec()
        self.stats = {"segments": 0, "events": 0, "duplicates_dropped": 0, "stale_dropped": 0,
                      "stale_episodes_dropped": 0, "stale_segments_dropped": 0,
                      "flow_control_waits": 0,
                      "skipped_already_acked": 0, "undecodable": 0,
                      "commits_retried_after_rebalance": 0, "acks_after_partition_moved": 0,
                      "acks_lost_in_rebalance": 0, "acks_lost_at_stop": 0,
                      "acks_beyond_metadata_cut": 0,
                      "records_read_again_after_early_exit": 0, "start_positions_retried": 0}
        self.strict_commits = commit_every_ms <= 0
        self.commit_every_s = max(0.0, commit_every_ms) / 1000
        self.group_instance_id = group_instance_id
        super().__init__()  # the bookkeeping every room works on (state.ClientState)


def __getattr__(name: str) -> Any:
    # SyncReplayClient lives in sync.py, which imports this module: loaded on first use
    if name == "SyncReplayClient":
        from trajbus.consumers.replay.sync import SyncReplayClient

        return SyncReplayClient
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

__all__ = [
    "ALL_TASKS", "DEFAULT_COMMIT_EVERY_MS", "FLOW_CONTROL_TIMEOUT_S", "REBALANCE_COMMIT_TIMEOUT_S",
    "STOP_COMMIT_TIMEOUT_S", "Episode", "FlowControlError", "ReplayClient", "Segment",
    "SyncReplayClient", "encode_acked_beyond", "fragment_reason", "list_tasks",
    "parse_acked_beyond", "replay_topic_pattern",
]
