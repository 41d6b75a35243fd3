"""Reading claim-checked blobs: the bytes behind a reference, verified.

Guarantee: :func:`fetch_blob` never returns bytes that differ from what the producer hashed
(size and sha256 are checked: :class:`~trajbus.bus.blobref.BlobIntegrityError`). Stores
opened for absolute references are kept, one per location and endpoint, for the process.
"""

from __future__ import annotations

import threading

from trajbus.archive.storage import ObjectStore, open_store
from trajbus.bus.blobref import blob_key, is_archive_relative, split_uri, verify
from trajbus.bus.settings import get_settings
from trajbus.schemas.models import BlobRef

_stores: dict[tuple[str, str | None], ObjectStore] = {}
_stores_lock = threading.Lock()


def fetch_blob(ref: BlobRef, endpoint_url: str | None = None,
               archive: ObjectStore | None = None) -> bytes:
    """The bytes behind ``ref``, verified against its size and sha256.

    An absolute reference (``file:///.../blobs/sha256/...``, ``s3://bucket/prefix/blobs/...``)
    is read from the store it names. A reference relative to an archive root
    (:func:`~trajbus.bus.blobref.is_archive_relative`) is read from ``archive``, the archive's
    store, which must then be given."""
    if is_archive_relative(ref.uri):
        if archive is None:
            raise ValueError(f"blob reference {ref.uri!r} is relative to an archive root: "
                             "read it with the archive's store (ArchiveReader.fetch_blob)")
        data = archive.get_bytes(blob_key(ref.uri.rsplit("/", 1)[-1]))
    else:
        root, key = split_uri(ref.uri)
        if endpoint_url is None and root.startswith("s3://"):
            endpoint_url = get_settings().archive.s3_endpoint_url
        with _stores_lock:
            store = _stores.get((root, endpoint_url))
            if store is None:
                store = open_store(root, endpoint_url, create=False)
                _stores[(root, endpoint_url)] = store
        data = store.get_bytes(key)
    return verify(ref.uri, data, ref.size, ref.sha256)
