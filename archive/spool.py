"""A disk spool per (topic, partition): bounded memory while a batch is open.

Rows accumulate in memory up to ``chunk_rows`` / ``chunk_bytes``, then go to an Arrow IPC
stream file in the spool directory (uncompressed: cheap to append, cheap to read back).
:meth:`Spool.take` returns the rows up to an offset as one table and keeps the rest.

Trade-off (also in archive/README.md): the final object must be sorted by
(sandbox, episode, seq), so at flush time one batch (<= ``target_object_bytes`` of rows plus
Arrow overhead) is read back into memory and sorted. Peak memory is therefore about two
batches, independent of the number of partitions; the alternative, an external merge sort,
would allow objects larger than memory but is not needed at the 64 MiB default.

Spool files are scratch: on start the archiver deletes them (uncommitted records are simply
re-consumed from Kafka).
"""

from __future__ import annotations

import os
import shutil
import uuid
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc

from trajbus.archive.rows import ARCHIVE_SCHEMA, Row, row_nbytes, rows_to_table


class Spool:
    """Rows of one (topic, partition), in offset order."""

    def __init__(self, directory: str | os.PathLike[str], name: str,
                 chunk_rows: int = 10_000, chunk_bytes: int = 8 * 1024 * 1024) -> None:
        self.dir = Path(directory)
        self.name = name
        self.chunk_rows = chunk_rows
        self.chunk_bytes = chunk_bytes
        self._pending: list[Row] = []
        self._pending_bytes = 0
        self._carry: pa.Table | None = None  # rows kept back by take(), offset > upto
        self._path: Path | None = None
        self._sink: pa.OSFile | None = None
        self._writer: pa.ipc.RecordBatchStreamWriter | None = None
        self.rows = 0

    def append(self, row: Row, nbytes: int | None = None) -> None:
        """Add a row (``nbytes``: its :func:`row_nbytes`, when the caller has it already)."""
        self._pending.append(row)
        self._pending_bytes += row_nbytes(row) if nbytes is None else nbytes
        self.rows += 1
        if len(self._pending) >= self.chunk_rows or self._pending_bytes >= self.chunk_bytes:
            self._spill()

    def _spill(self) -> None:
        if not self._pending:
            return
        table = rows_to_table(self._pending)
        self._pending = []
        self._pending_bytes = 0
        if self._writer is None:
            self.dir.mkdir(parents=True, exist_ok=True)
            self._path = self.dir / f"{self.name}-{uuid.uuid4().hex[:8]}.arrows"
            self._sink = pa.OSFile(str(self._path), "wb")
            self._writer = pa.ipc.new_stream(self._sink, ARCHIVE_SCHEMA)
        self._writer.write_table(table)

    def take(self, upto_offset: int) -> pa.Table:
        """All spooled rows with ``kafka_offset <= upto_offset`` (offset order); later rows
        stay in the spool."""
        parts: list[pa.Table] = []
        if self._carry is not None:
            parts.append(self._carry)
            self._carry = None
        if self._writer is not None and self._sink is not None and self._path is not None:
            self._writer.close()
            self._sink.close()
            with pa.memory_map(str(self._path), "r") as src:
                parts.append(pa.ipc.open_stream(src).read_all())
            self._path.unlink(missing_ok=True)
            self._writer = self._sink = self._path = None
        if self._pending:
            parts.append(rows_to_table(self._pending))
            self._pending = []
            self._pending_bytes = 0
        table = pa.concat_tables(parts) if parts else ARCHIVE_SCHEMA.empty_table()
        if table.num_rows:
            offsets = table.column("kafka_offset")
            keep = pc.greater(offsets, upto_offset)
            if pc.any(keep).as_py():
                self._carry = table.filter(keep)
                table = table.filter(pc.invert(keep))
        table = table.combine_chunks()
        self.rows = self._carry.num_rows if self._carry is not None else 0
        return table

    def discard(self) -> None:
        if self._writer is not None and self._sink is not None:
            self._writer.close()
            self._sink.close()
        if self._path is not None:
            self._path.unlink(missing_ok=True)
        self._writer = self._sink = self._path = None
        self._pending = []
        self._pending_bytes = 0
        self._carry = None
        self.rows = 0


def clear_spool_dir(directory: str | os.PathLike[str]) -> None:
    """Delete leftover spool files (the records they held were never committed)."""
    d = Path(directory)
    if d.is_dir():
        for p in d.glob("*.arrows"):
            p.unlink(missing_ok=True)
    else:
        shutil.rmtree(d, ignore_errors=True)
        d.mkdir(parents=True, exist_ok=True)
