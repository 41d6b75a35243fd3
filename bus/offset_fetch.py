"""A group's committed offsets are never read as "none" while its coordinator cannot say.

Kafka's OffsetFetch v2 and later report a coordinator that cannot answer yet -- loading the
group's offsets after a restart or a failover (``COORDINATOR_LOAD_IN_PROGRESS``), not the
coordinator (``NOT_COORDINATOR``), unavailable -- as a *request-level* error code with an
empty list of partitions. aiokafka 0.14 reads only the per-partition entries, so such an
answer came back as "no committed offset" for every partition asked about: a consumer then
took its start position from ``auto_offset_reset`` (reading the partition again from its
beginning) and the trainer client took a partition over as if the group had never
committed it -- delivering again what another member had acknowledged beyond the commit
point. librdkafka#5586 describes the same response shape.

With :func:`install`, an OffsetFetch answer with a request-level error raises that error
from the coordinator's request: aiokafka's ``fetch_committed_offsets`` retries the
retriable ones after ``retry_backoff_ms`` (re-discovering the coordinator for
``NOT_COORDINATOR`` / ``COORDINATOR_NOT_AVAILABLE``) for as long as the coordinator cannot
answer -- callers that must not wait for ever bound it -- and raises the others. The admin
client's ``list_consumer_group_offsets`` (the same blind spot: a loading coordinator read
as a group without commits) raises it to its caller, who retries to a deadline. Guarantee
(OffsetFetch v2 and later, what Kafka 4 negotiates): a committed offset is reported as
absent only when the coordinator said so per partition.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

log = logging.getLogger("trajbus.kafka")

_install_lock = threading.Lock()
_installed = False


def install() -> None:
    """Apply the check to every aiokafka group coordinator of this process (idempotent)."""
    global _installed
    if _installed:
        return
    with _install_lock:
        if not _installed:
            _wrap_send_req()
            _wrap_admin_send_request()
            _installed = True


def request_level_error(request: Any, response: Any) -> type[Exception] | None:
    """The error class of an OffsetFetch ``response``'s request-level error code, or None
    (another request, a version without that field, or no error)."""
    from aiokafka import errors
    from aiokafka.protocol.commit import OffsetFetchRequest

    if not isinstance(request, OffsetFetchRequest):
        return None
    code = getattr(response, "error_code", 0)
    if not code:
        return None
    return errors.for_code(code)


def _wrap_send_req() -> None:
    from aiokafka import errors
    from aiokafka.consumer.group_coordinator import GroupCoordinator

    original = getattr(GroupCoordinator, "_send_req", None)
    if not callable(original):
        log.warning("aiokafka has no GroupCoordinator._send_req: OffsetFetch's request-level "
                    "errors are not checked (a coordinator that is loading may be read as "
                    "'no committed offset')")
        return

    async def _send_req(self: Any, request: Any) -> Any:
        response = await original(self, request)
        error = request_level_error(request, response)
        if error is not None:
            if error in (errors.NotCoordinatorForGroupError,
                         errors.GroupCoordinatorNotAvailableError):
                self.coordinator_dead()
            log.debug("OffsetFetch for group %s answered %s", self.group_id, error.__name__)
            raise error()
        return response

    _send_req.__wrapped__ = original  # type: ignore[attr-defined]
    GroupCoordinator._send_req = _send_req


def _wrap_admin_send_request() -> None:
    from aiokafka.admin import AIOKafkaAdminClient

    original = getattr(AIOKafkaAdminClient, "_send_request", None)
    if not callable(original):
        log.warning("aiokafka has no AIOKafkaAdminClient._send_request: OffsetFetch's "
                    "request-level errors are not checked for admin clients")
        return

    async def _send_request(self: Any, request: Any, node_id: int | None = None) -> Any:
        response = await original(self, request, node_id)
        error = request_level_error(request, response)
        if error is not None:
            raise error(f"OffsetFetch answered {error.__name__}")
        return response

    _send_request.__wrapped__ = original  # type: ignore[attr-defined]
    AIOKafkaAdminClient._send_request = _send_request
