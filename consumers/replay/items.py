"""What a trainer receives from the replay client: :class:`Segment` (a contiguous run of one
episode's events), :class:`Episode` (an episode's segments: whole, or a fragment that says
why), and :class:`FlowControlError`, what a loop held at ``max_in_flight`` raises."""

from __future__ import annotations

from dataclasses import dataclass, field

from trajbus.schemas.codec import Decoded


@dataclass(frozen=True)
class Segment:
    """A contiguous run of one episode's events, decoded, in sequence order."""

    task: str
    sandbox: str
    episode: str
    index: int
    first_seq: int
    last_seq: int
    events: list[Decoded]
    gap: tuple[int, int] | None
    is_first: bool
    is_last: bool
    is_terminal: bool
    topic: str
    partition: int
    offset: int
    timestamp_ms: int = 0
    """The replay record's Kafka timestamp: when the reorder worker wrote the segment."""
    _tenure: int = field(default=0, repr=False, compare=False)
    # which tenure of its partition by this client handed it out (its ack counts only in it)

    @property
    def truncated(self) -> bool:
        return self.is_last and not self.is_terminal


@dataclass
class Episode:
    """An episode assembled from its segments, handed out once its last segment arrived.

    ``complete``: it holds the episode from its first segment (seq 0, EpisodeStart) to its
    last, none missing -- the usual case. Otherwise it is a *fragment*, and
    ``fragment_reason`` says why: ``"started_mid_episode"`` (the client began reading the
    partition after the episode's first segment: a ``start=`` time or ``"latest"`` fell
    inside it, or retention deleted its beginning) or ``"missing_segments"`` (a segment
    between its first and last is not there). A member that takes a partition over from
    another never makes fragments: it reads from the group's commit, which never passes the
    first segment of an episode not acknowledged. ``gaps`` (events the reorder engine
    declared lost upstream) and ``truncated`` (ended without a TERMINAL EpisodeEnd) are about
    the episode's content, not its delivery: a complete episode may have either."""

    task: str
    sandbox: str
    episode: str
    events: list[Decoded] = field(default_factory=list)
    segments: list[Segment] = field(default_factory=list)
    gaps: list[tuple[int, int]] = field(default_factory=list)
    is_terminal: bool = False

    @property
    def truncated(self) -> bool:
        return not self.is_terminal

    @property
    def complete(self) -> bool:
        """Every segment from the episode's first to its last is here (see the class)."""
        return self.fragment_reason is None

    @property
    def fragment_reason(self) -> str | None:
        """None for a complete episode; else why it is a fragment (see the class)."""
        return fragment_reason(self.segments)


def fragment_reason(segments: list[Segment]) -> str | None:
    """Why ``segments`` (one episode's, in order) are not the whole episode from its first
    segment to its last, or None. Sequences are followed, events and declared gaps alike: each
    segment must start at or before the seq after the previous one's last."""
    if not segments or not segments[0].is_first:
        return "started_mid_episode"
    expected = 0
    for seg in segments:
        lo = seg.gap[0] if seg.gap else seg.first_seq if seg.events else None
        if lo is not None and lo > expected:
            return "missing_segments"
        if seg.gap:
            expected = max(expected, seg.gap[1] + 1)
        if seg.events:
            expected = max(expected, seg.last_seq + 1)
    if not segments[-1].is_last:
        return "missing_segments"
    return None


class FlowControlError(RuntimeError):
    """A loop waited ``flow_control_timeout_s`` at ``max_in_flight`` for acknowledgements that
    did not come: the segments handed out and not acknowledged hold the limit."""
