"""The compaction manifest: which objects are live, switched by one pointer object.

The archiver only ever *adds* objects (under deterministic keys). Compaction replaces many
small objects by a few large ones; readers must see the old set or the new set, never both and
never neither. The rule that guarantees it:

* ``_manifest/CURRENT`` (one small object, replaced atomically) names the current generation
  file ``_manifest/g-GGGGGGGG.json``, which lists the *superseded* object keys (with the time
  they were superseded) of every compaction up to that generation.
* An archiver object is live iff it is not superseded. A compacted object
  (``compacted-gG-...``) is live iff ``G <= generation`` and it is not superseded.
* Compaction writes its objects under generation ``g+1`` (invisible: ``g+1 > generation``),
  writes ``g-(g+1).json`` (superseding the inputs), then replaces CURRENT. The single PUT of
  CURRENT switches readers from the old set to the new set.
* Superseded objects are deleted only ``grace`` later (a reader that resolved the old
  generation may still be listing or reading them), and only then dropped from the list.

Readers resolve the manifest once per query (:func:`read_manifest`), then list and filter
(:func:`live_objects`). One compactor at a time per archive (an operator job, not a daemon).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field

from trajbus.archive import layout
from trajbus.archive.storage import ObjectInfo, ObjectNotFoundError, ObjectStore

CURRENT = f"{layout.MANIFEST_DIR}CURRENT"


def generation_key(generation: int) -> str:
    return f"{layout.MANIFEST_DIR}g-{generation:08d}.json"


@dataclass(frozen=True)
class Manifest:
    generation: int = 0
    superseded: dict[str, int] = field(default_factory=dict)  # key -> superseded at (ms)
    created_ms: int = 0

    def is_live(self, path: layout.ObjectPath) -> bool:
        """Is the data object (``events/`` key) live in this generation?"""
        if path.compacted_generation is not None and path.compacted_generation > \
                self.generation:
            return False
        return path.events_key not in self.superseded

    def to_json(self) -> bytes:
        return json.dumps({"generation": self.generation, "created_ms": self.created_ms,
                           "superseded": self.superseded}, sort_keys=True).encode()

    @classmethod
    def from_json(cls, data: bytes) -> Manifest:
        d = json.loads(data)
        return cls(int(d["generation"]), {str(k): int(v) for k, v in d["superseded"].items()},
                   int(d.get("created_ms", 0)))


def read_manifest(store: ObjectStore) -> Manifest:
    """The current manifest (generation 0, nothing superseded, when none was written)."""
    try:
        pointer = json.loads(store.get_bytes(CURRENT))
    except ObjectNotFoundError:
        return Manifest()
    return Manifest.from_json(store.get_bytes(pointer["manifest"]))


def switch_manifest(store: ObjectStore, manifest: Manifest) -> None:
    """Publish ``manifest``: write its generation file, then replace the pointer (atomic)."""
    key = generation_key(manifest.generation)
    store.put_bytes(key, manifest.to_json())
    store.put_bytes(CURRENT, json.dumps({"generation": manifest.generation, "manifest": key,
                                         "switched_ms": int(time.time() * 1000)}).encode())


def live_objects(store: ObjectStore, manifest: Manifest, area: str = "events",
                 task: str | None = None,
                 dates: tuple[str | None, str | None] = (None, None)) -> list[
                     tuple[layout.ObjectPath, ObjectInfo]]:
    """Live objects of a data ``area`` (``events``, a context area such as ``decisions``,
    ``conflicts``), or the index files of live objects (``index``, ``decisions_index``, ...),
    optionally for one task and an inclusive date range."""
    out: list[tuple[layout.ObjectPath, ObjectInfo]] = []
    if area not in (*layout.DATA_AREAS, *layout.INDEX_AREAS, "conflicts"):
        raise ValueError(f"unknown archive area {area!r}")
    prefix = f"{area}/"
    lo, hi = dates
    if lo is not None and lo == hi:
        prefix += f"date={lo}/"
        if area in layout.INDEX_AREAS and task is not None:
            prefix += f"task={task}/"
    for info in store.list(prefix):
        p = layout.parse_object_key(info.key)
        if p is None or p.area != area:
            continue
        if task is not None and p.task != task:
            continue
        if (lo is not None and p.date < lo) or (hi is not None and p.date > hi):
            continue
        if manifest.is_live(p):
            out.append((p, info))
    return out
