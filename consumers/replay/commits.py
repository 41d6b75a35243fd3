"""The replay client's commits: what the trainer acknowledged is committed to the group, the
offsets acknowledged beyond the commit point in the commit's metadata.

Guarantees: with per-ack commits (``commit_every_ms=0``) every commit the trainer asks for is
made before its call returns; with coalesced commits what is acknowledged is committed at most
once per ``commit_every_ms``, one commit in flight (the ack that finds one due drives it for a
few turns of the event loop; a background committer commits the last acknowledgements), and a
background commit's failure is raised by the trainer's next call. A commit the group refuses
because it rebalanced is made again once the group has settled, for up to
:data:`~.state.REBALANCE_COMMIT_TIMEOUT_S`, then raised. Nothing is committed during a
rebalance; a partition read but no longer assigned has its progress dropped, never committed.
"""

from __future__ import annotations

import asyncio
import logging

from aiokafka.errors import CommitFailedError, IllegalStateError
from aiokafka.structs import OffsetAndMetadata

from trajbus.consumers.replay.rebalance import _GroupRebalancing
from trajbus.consumers.replay.state import (
    _REBALANCE_RETRY_S,
    REBALANCE_COMMIT_TIMEOUT_S,
    ClientState,
)

log = logging.getLogger("trajbus.consumers.replay.client")

_COMMITTER_TURN_S = 0.001  # coalesced commits: an ack yields to the committer this often
_COMMIT_TURN_WAIT_S = 0.005  # ... and waits this long, once per commit, for one under way


class CommitsMixin(ClientState):
    """Committing what is acknowledged (see the module docstring)."""

    async def commit(self) -> None:
        """Commit every acknowledgement made so far; returns once the broker has it (a
        background commit under way is waited for). Raises what a background commit raised.

        A commit the group refuses because it rebalanced meanwhile (a broker outage longer
        than the session timeout makes the consumer rejoin; a member joined or left) is made
        again once this member has its partitions back -- for those it still holds -- for up
        to :data:`REBALANCE_COMMIT_TIMEOUT_S`. Only then does it raise."""
        await self._commit_acknowledged(retry_rebalance=True)

    async def _commit_acknowledged(self, retry_rebalance: bool) -> None:
        self._raise_commit_error()  # a background commit's failure is final: not retried
        loop = asyncio.get_running_loop()
        started = loop.time()
        retried = False
        while True:
            try:
                await self._commit_once()
            except (CommitFailedError, IllegalStateError, _GroupRebalancing) as exc:
                if not retry_rebalance:
                    raise
                if loop.time() - started >= REBALANCE_COMMIT_TIMEOUT_S:
                    log.error("replay client %s: giving up a commit after %.0f s of rebalancing",
                              self.group_id, REBALANCE_COMMIT_TIMEOUT_S)
                    raise CommitFailedError(
                        f"group {self.group_id!r} kept rebalancing for "
                        f"{REBALANCE_COMMIT_TIMEOUT_S:.0f} s: the acknowledgements since the "
                        f"last commit are not committed ({exc}); a restarted trainer receives "
                        f"them again") from exc
                if not retried:
                    self.stats["commits_retried_after_rebalance"] += 1
                    log.warning("replay client %s: the group rebalanced under a commit (%s); "
                                "committing again once this member has its partitions back",
                                self.group_id, type(exc).__name__)
                    retried = True
                await asyncio.sleep(_REBALANCE_RETRY_S)  # not holding the commit lock: the
                # revocation's own commit (coalesced commits) must not wait for this one
                continue
            if retried:
                log.info("replay client %s: committed after %.1f s of rebalancing",
                         self.group_id, loop.time() - started)
            return

    async def _commit_once(self) -> None:
        for p in self._progress.values():
            if p.advance():
                self._dirty = True
        async with self._commit_lock:
            if self._dirty:
                self._dirty = False
                try:
                    await self._commit()
                except BaseException:
                    self._dirty = True
                    raise
                self._last_commit = asyncio.get_running_loop().time()

    async def _maybe_commit(self) -> None:
        self._raise_commit_error()
        if any([p.advance() for p in self._progress.values()]):
            self._dirty = True
        if not self._dirty:
            return
        if self.strict_commits:
            await self.commit()
            return
        self._commit_wanted.set()
        if self._committer is None:
            self._committer = asyncio.create_task(self._commit_in_background())
        await self._commit_in_turn()

    async def _commit_in_turn(self) -> None:
        """Coalesced commits, from the trainer's ack: the ack that finds a commit due starts
        it, and drives it for up to ``_COMMIT_TURN_WAIT_S`` (the few turns of the event loop
        its I/O takes -- not a round trip per ack: once per commit); while it is under way,
        an ack gives it a turn at most every ``_COMMITTER_TURN_S``: a loop that hands out
        records already fetched and trains without awaiting still commits every N ms. The
        background committer commits what is acknowledged last."""
        loop = asyncio.get_running_loop()
        now = loop.time()
        task = self._commit_task
        if ((task is None or task.done()) and not self._commit_lock.locked()
                and now >= self._last_commit + self.commit_every_s):
            task = self._commit_task = asyncio.ensure_future(self._commit_for_ack())
        if task is None or task.done():
            return
        if task is not self._waited_on:
            self._waited_on = task
            self._last_turn = now
            await asyncio.wait({task}, timeout=_COMMIT_TURN_WAIT_S)
        elif now - self._last_turn >= _COMMITTER_TURN_S:
            self._last_turn = now
            await asyncio.sleep(0)

    async def _commit_for_ack(self) -> None:
        try:
            await self.commit()
        except Exception as exc:  # handed to the trainer's next call, as the committer's
            self._commit_error = exc

    async def _commit_in_background(self) -> None:
        """Commit what is acknowledged whenever there is something new, one commit at a time
        and at most one per ``commit_every_ms``; a failure is raised by the next ``ack``."""
        loop = asyncio.get_running_loop()
        try:
            while True:
                await self._commit_wanted.wait()
                self._commit_wanted.clear()
                wait = self._last_commit + self.commit_every_s - loop.time()
                if wait > 0:
                    await asyncio.sleep(wait)
                started = self._commit_task
                if started is not None and not started.done():  # an ack's (_commit_in_turn)
                    await asyncio.wait({started})
                    self._commit_wanted.set()  # then what was acknowledged meanwhile
                    continue
                await self.commit()
        except Exception as exc:  # handed to the trainer's next call
            self._commit_error = exc

    def _raise_commit_error(self) -> None:
        if self._commit_error is not None:
            raise self._commit_error

    async def _commit(self) -> None:
        """Commit the progress of the partitions read that this member holds. During a
        rebalance (revoked, not yet assigned; or no partition assigned while some were read:
        a subscription change is starting one) nothing can be committed: raises
        :class:`_GroupRebalancing`. Outside one, a partition read but not assigned went to
        another member: its progress is dropped (that member reads on from the group's
        commit)."""
        if self._consumer is None or not self._progress:
            return
        if self._rebalancing:
            raise _GroupRebalancing("partitions revoked, not yet assigned again")
        assigned = self._consumer.assignment()
        if not assigned:
            raise _GroupRebalancing("no partition assigned now")
        self._lose([tp for tp in self._progress if tp not in assigned])
        held = list(self._progress.items())
        offsets = {tp: OffsetAndMetadata(p.committed, p.metadata()) for tp, p in held}
        acks = [p.acks for _, p in held]  # what this commit carries
        for _, p in held:
            if p.metadata_cut:
                self.stats["acks_beyond_metadata_cut"] += p.metadata_cut
                log.warning("replay client %s: %d run(s) of acknowledged offsets beyond the "
                            "commit point do not fit the commit's metadata; a restart or the "
                            "partition's next owner delivers them again", self.group_id,
                            p.metadata_cut)
        if offsets:
            if log.isEnabledFor(logging.DEBUG):
                log.debug("replay client %s: committing %s", self.group_id,
                          {f"{tp.topic}[{tp.partition}]": (p.committed, p.beyond()[:20])
                           for tp, p in held})
            await self._consumer.commit(offsets)
            for (tp, p), n in zip(held, acks, strict=True):
                p.durable = max(p.durable, n)
                p.last_committed = (offsets[tp].offset, offsets[tp].metadata)
