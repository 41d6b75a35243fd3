"""The replay client's fetch loop and flow control: read the replay topics, turn each record
into a segment for the iterator, and hold back while the trainer holds ``max_in_flight``
segments it can acknowledge.

Guarantees: a record handed out and not acknowledged is not handed out again by this member
(read again after a rejoin, it is skipped), nor is one the commit's metadata says is
acknowledged; a batch fetched while a rebalance runs, or across one, is read again from where
the rebalance left each partition, never taken half; a partition whose start position is not
known yet is not read. Flow control is as "Flow control" in :mod:`~.client` says: a wait
without an acknowledgement is logged (WARNING) after ``_FLOW_WARN_AFTER_S``, then at most
every ``_FLOW_WARN_EVERY_S``, and raises :class:`FlowControlError` after
``flow_control_timeout_s``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncGenerator

from trajbus.consumers.replay.items import FlowControlError, Segment
from trajbus.consumers.replay.state import _REBALANCE_RETRY_S, ClientState, _Read

log = logging.getLogger("trajbus.consumers.replay.client")

# A loop held at ``max_in_flight`` logs a WARNING after this long without an acknowledgement,
# then again at most this often (see ReplayClient._wait_for_acks).
_FLOW_WARN_AFTER_S = 10.0
_FLOW_WARN_EVERY_S = 30.0


class FetchingMixin(ClientState):
    """The fetch loop and flow control (see the module docstring)."""

    async def _read_segments(self, read: _Read, idle_timeout: float | None,
                             drop_stale: bool = False) -> AsyncGenerator[Segment, None]:
        assert self._consumer is not None, "call start() first"
        loop = asyncio.get_running_loop()
        idle_since = loop.time()
        unhandled = read.unhandled
        while True:
            # backpressure on what the trainer can acknowledge while this loop waits (see
            # _held); the segments of episodes still open wait for the rest of their
            # episodes, which must be read to complete them
            await self._wait_for_acks(read)
            if self._unpositioned and not self._rebalancing:
                await self._position_pending()
            batch = await self._consumer.getmany(
                timeout_ms=200, max_records=max(1, self.max_in_flight - self._held(read)[0]))
            if batch and self._rebalancing:
                # fetched from the new assignment while its callback still runs (aiokafka
                # wakes getmany first): its open episodes may yet be dropped -- read these
                # again once it is done
                assigned = self._consumer.assignment()
                for tp, msgs in batch.items():
                    if msgs and tp in assigned:
                        self._consumer.seek(tp, msgs[0].offset)
                # (bounded: should the group never settle, the fetch is simply tried again)
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(self._settled.wait(), _REBALANCE_RETRY_S * 5)
                continue
            # counted only for a fetch that is handled: one put back above must not make a
            # later release take positions the assignment is still resetting for its own
            read.revocations_at_fetch = self._revocations
            if not batch:
                if idle_timeout is not None and loop.time() - idle_since > idle_timeout:
                    return
                continue
            idle_since = loop.time()
            unhandled.clear()  # the last batch was handled, or left for a re-read
            unhandled.update({tp: msgs[0].offset for tp, msgs in batch.items() if msgs})
            for tp, msgs in batch.items():
                if tp not in self._consumer.assignment():
                    unhandled.pop(tp, None)
                    continue  # taken by another member since this batch came: it reads them
                progress = await self._progress_for(tp)
                if read.revocations_at_fetch != self._revocations:
                    unhandled.clear()  # a rebalance during that await: see below
                    break
                if tp not in self._consumer.assignment():
                    self._lose([tp])
                    unhandled.pop(tp, None)
                    continue
                handed = self._handed_out.setdefault(tp, {})
                for msg in msgs:
                    unhandled[tp] = msg.offset
                    progress.note_read(msg.offset)
                    if progress.skip_on_restart(msg.offset):
                        self.stats["skipped_already_acked"] += 1
                        continue
                    if msg.offset in handed:
                        continue  # read again after a rejoin: its first delivery is unacked
                    seg = self._to_segment(tp, msg.offset, msg.value, msg.timestamp,
                                           progress.epoch)
                    if seg is None:
                        if progress.ack(msg.offset):  # nothing new in it: consumed
                            self._dirty = True
                        continue
                    if drop_stale and self._too_stale(seg.events):
                        self.stats["stale_segments_dropped"] += 1
                        self.stats["stale_dropped"] += len(seg.events)
                        if progress.ack(msg.offset):  # consumed: committed with the next
                            self._dirty = True
                        continue
                    handed[msg.offset] = read.serial
                    self._in_flight += 1
                    read.own += 1
                    unhandled[tp] = msg.offset + 1  # handed out, even if the loop ends here
                    yield seg
                    if read.released:  # a newer iterator has taken over: it reads the rest
                        return
                    if read.revocations_at_fetch != self._revocations:
                        break  # a rebalance while the trainer had it: see below
                else:
                    unhandled.pop(tp, None)
                    continue
                # A rebalance since this batch was fetched put every partition this member
                # kept back to the group's commit, which none of the batch's unhandled
                # records is past: they are read again, so the rest of the batch is left (a
                # partition that moved away and came back must not have its records taken
                # for duplicates of the episodes dropped with it).
                unhandled.clear()
                break
            await self._maybe_commit()

    def _held(self, read: _Read) -> tuple[int, int]:
        """What counts against ``max_in_flight`` for ``read``, and of that what earlier
        iterators handed out: the segments the trainer can acknowledge while ``read`` waits.
        Those an earlier loop handed out always count (the trainer had them before it asked
        again). Those this loop handed out count only once one of them was acknowledged
        while it waited (something beside the loop acknowledges): a loop that collects a
        batch before acknowledging could never release them while it waits for the next
        one. The segments of episodes it holds open never count (they are not the
        trainer's)."""
        earlier = self._in_flight - read.own
        if read.acked_beside:
            return earlier + read.own - read.open_segments, earlier
        return earlier, earlier

    async def _wait_for_acks(self, read: _Read) -> None:
        """Wait while ``read`` is held at ``max_in_flight`` (see :meth:`_held`). A wait
        without an acknowledgement is logged (WARNING) after ``_FLOW_WARN_AFTER_S``, then at
        most every ``_FLOW_WARN_EVERY_S``, and raised (:class:`FlowControlError`) after
        ``flow_control_timeout_s``."""
        if not read.acked_beside and read.own - read.open_segments >= self.max_in_flight:
            # beyond the limit on its own segments: first let a task (or thread) that is
            # ready to acknowledge one do so, which tells what counts (fetches of records
            # already buffered would not give it a turn)
            await asyncio.sleep(0)
            if not read.acked_beside and not self._told_own_beyond_limit:
                self._told_own_beyond_limit = True
                log.info("replay client %s: this loop holds %d segments it handed out and "
                         "that are not acknowledged, more than max_in_flight=%d; it is not "
                         "held back by them (it could not acknowledge them while it waits for "
                         "the next one); they are committed once acknowledged",
                         self.group_id, read.own - read.open_segments, self.max_in_flight)
        counted, earlier = self._held(read)
        if counted < self.max_in_flight:
            return
        self.stats["flow_control_waits"] += 1
        loop = asyncio.get_running_loop()
        last_ack = loop.time()
        warn_at = last_ack + _FLOW_WARN_AFTER_S
        timeout = self.flow_control_timeout_s
        while True:
            self._acked_event.clear()
            wake = warn_at if timeout is None else min(warn_at, last_ack + timeout)
            try:
                await asyncio.wait_for(self._acked_event.wait(), max(0.0, wake - loop.time()))
                last_ack = loop.time()
            except TimeoutError:
                pass
            counted, earlier = self._held(read)
            if counted < self.max_in_flight:
                return
            now = loop.time()
            held = (f"{counted} segments handed out and not acknowledged hold "
                    f"max_in_flight={self.max_in_flight} ({earlier} by earlier loops of this "
                    f"client, {counted - earlier} by this one); none was acknowledged for "
                    f"{now - last_ack:.0f} s")
            advice = ("ack() them (a loop left after a batch acknowledges the batch before "
                      "asking for the next) or raise max_in_flight")
            if timeout is not None and now - last_ack >= timeout:
                raise FlowControlError(f"replay client {self.group_id}: {held}; {advice}")
            if now >= warn_at:
                log.warning("replay client %s: waiting: %s; %s", self.group_id, held, advice)
                warn_at = now + _FLOW_WARN_EVERY_S
