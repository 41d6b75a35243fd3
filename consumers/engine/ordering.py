"""Ordered mode: records of every input partition released in one deterministic order, merged
by record timestamp (the order ``trajbus replay explain`` re-creates from the log)."""

from __future__ import annotations

import logging
import time
from typing import Any

from aiokafka import TopicPartition

from trajbus.consumers.engine.state import RunnerState

log = logging.getLogger("trajbus.runner")

_MAX_IDLE_S = 10.0


class OrderedReleaseMixin(RunnerState):
    """The runner's ordered release (see the module docstring)."""

    def _release(self) -> list[tuple[TopicPartition, Any]]:
        """Ordered mode: pop records in (timestamp, topic rank, topic, partition) order of the
        partition heads, but only while every assigned input partition has a head — its next
        record could otherwise be older. Ticks in every input partition guarantee progress;
        a partition silent for longer than ``_MAX_IDLE_S`` stops blocking (logged)."""
        assert self._consumer is not None
        rank = {t: i for i, t in enumerate(self.spec.input_topics)}
        blocking = [tp for tp in self._consumer.assignment() if tp.topic in rank]
        now = time.monotonic()
        out: list[tuple[TopicPartition, Any]] = []
        while True:
            empty = [tp for tp in blocking if not self._pending.get(tp)]
            if empty:
                for tp in empty:
                    self._empty_since.setdefault(tp, now)
                if all(now - self._empty_since[tp] < _MAX_IDLE_S for tp in empty):
                    break
                silent = [tp for tp in empty if tp not in self._warned_silent
                          and now - self._empty_since[tp] >= _MAX_IDLE_S]
                if silent:  # once per silence, not once per record released meanwhile
                    self._warned_silent.update(silent)
                    newly = sorted(f"{tp.topic}[{tp.partition}]" for tp in silent)
                    log.warning("%s: no record (not even a tick) from %s for %.0f s; ordering "
                                "without waiting for them (a broker restart or a stopped "
                                "ticker; it resumes by itself when they speak again)",
                                self.spec.name, ", ".join(newly),
                                max(now - self._empty_since[tp] for tp in silent))
            heads = [tp for tp, q in self._pending.items() if q]
            if not heads:
                break
            tp = min(heads, key=lambda t: (self._pending[t][0].timestamp,
                                           rank.get(t.topic, len(rank)), t.topic, t.partition))
            out.append((tp, self._pending[tp].popleft()))
            self._warned_silent.discard(tp)
            if self._pending[tp]:
                self._empty_since.pop(tp, None)
            else:
                self._empty_since[tp] = now
        return out
