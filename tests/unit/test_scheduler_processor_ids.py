"""The scheduler stage judges a sandbox event's ids as the reorder stage does: a path in a
sandbox id is ``invalid_id`` (permanent) in both, never the scheduler's ``unknown_sandbox``
(transient), which made ``deadletters redrive`` send the record back (operators' drill,
2026-12-05)."""

from __future__ import annotations

from trajbus.bus.settings import Settings
from trajbus.bus.topics import Topics
from trajbus.consumers.engine.processors import ReorderProcessor, SchedulerProcessor
from trajbus.consumers.engine.runner import InRecord
from trajbus.schemas import models as m
from trajbus.schemas.codec import default_codec

T = 1_764_000_000_000


def _verdicts(processor: ReorderProcessor | SchedulerProcessor, value: bytes,
              topic: str) -> list[str]:
    codec = default_codec()
    outs = processor.handle(InRecord(topic, 0, 7, b"sb-x", value, T))
    return [codec.decode(o.value).record["reason_code"] for o in outs
            if o.topic == Topics(processor.settings).deadletter]


def test_a_heartbeat_with_a_path_in_its_sandbox_id_is_invalid_id_in_both_stages() -> None:
    settings = Settings()
    topic = Topics(settings).sandbox_events
    for sandbox in ("sb/../../etc", "../x", "a b"):
        hb = m.Heartbeat(header=m.Envelope(event_id="e1", task="web-shop", sandbox=sandbox,
                                           seq=0, event_time_ms=T, producer_id="test"))
        assert _verdicts(SchedulerProcessor(settings), hb.encode(), topic) == ["invalid_id"]
        assert _verdicts(ReorderProcessor(settings), hb.encode(), topic) == ["invalid_id"]


def test_a_valid_heartbeat_of_an_unknown_sandbox_stays_unknown_sandbox() -> None:
    settings = Settings()
    topic = Topics(settings).sandbox_events
    hb = m.Heartbeat(header=m.Envelope(event_id="e2", task="web-shop", sandbox="sb-new",
                                       seq=0, event_time_ms=T, producer_id="test"))
    assert _verdicts(SchedulerProcessor(settings), hb.encode(), topic) == ["unknown_sandbox"]
