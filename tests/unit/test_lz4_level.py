"""aiokafka's producers compress lz4 at the configured level (default 1), not its built-in 9.

aiokafka has no compression-level option; ``bus.producer.set_lz4_level`` points its record
batch builders at ``lz4_encode(..., level=N)``. These tests check that the builder aiokafka
actually uses goes through that function, and that its batches still read back."""

from __future__ import annotations

from typing import Any

import pytest
from aiokafka.record import default_records as py_records

from trajbus.bus.producer import producer_options, set_lz4_level
from trajbus.bus.settings import KafkaSettings

try:
    from aiokafka.record._crecords import default_records as c_records
except ImportError:  # pragma: no cover - aiokafka without its C extension
    c_records = None

CODEC_LZ4 = 3
BUILDERS = [m for m in (c_records, py_records) if m is not None]
# the pure-Python module re-exports the C classes when the extension is there: its own are these
_BUILDER = {py_records: "_DefaultRecordBatchBuilderPy"}
_READER = {py_records: "_DefaultRecordBatchPy"}


def _batch(module: Any, values: list[bytes]) -> bytes:
    b = getattr(module, _BUILDER.get(module, "DefaultRecordBatchBuilder"))(
        magic=2, compression_type=CODEC_LZ4, is_transactional=0, producer_id=-1,
        producer_epoch=-1, base_sequence=-1, batch_size=1 << 22)
    for i, v in enumerate(values):
        b.append(i, timestamp=None, key=None, value=v, headers=[])
    return bytes(b.build())


@pytest.mark.parametrize("module", BUILDERS, ids=lambda m: m.__name__.rsplit(".", 2)[-2])
def test_the_record_builder_compresses_at_the_configured_level(module: Any) -> None:
    assert set_lz4_level(1)
    calls: list[dict[str, Any]] = []
    configured = module.lz4_encode
    assert configured.keywords == {"level": 1}

    def spy(data: Any) -> bytes:
        calls.append(dict(configured.keywords))
        return configured(data)

    module.lz4_encode = spy
    try:
        values = [(f"event {i} " * 20).encode() for i in range(500)]
        batch = _batch(module, values)
    finally:
        module.lz4_encode = configured
    assert calls == [{"level": 1}]  # the builder in use called it, with the level
    reader = getattr(module, _READER.get(module, "DefaultRecordBatch"))(batch)
    assert [r.value for r in reader] == values  # and its batch reads back


def test_producer_options_apply_the_setting() -> None:
    producer_options(KafkaSettings(lz4_level=4))
    assert all(m.lz4_encode.keywords == {"level": 4} for m in BUILDERS)
    producer_options(KafkaSettings())  # the default, for the rest of the session
    assert all(m.lz4_encode.keywords == {"level": 1} for m in BUILDERS)
