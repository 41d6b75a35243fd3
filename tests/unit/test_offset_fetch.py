"""A group's committed offsets are never read as "none" while its coordinator cannot answer
(bus/offset_fetch.py): OffsetFetch v2+ says "loading" / "not the coordinator" as a
request-level error with no partitions, which aiokafka alone read as "no committed offset"
(the consumer then restarted the partition from auto_offset_reset; the trainer client took
a partition over as never committed and delivered acknowledged episodes again)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from aiokafka import TopicPartition, errors
from aiokafka.consumer.group_coordinator import GroupCoordinator
from aiokafka.protocol.commit import OffsetFetchResponse_v3
from aiokafka.structs import OffsetAndMetadata

from trajbus.bus.offset_fetch import install

pytestmark = pytest.mark.timeout(30)

TP = TopicPartition("t", 0)
LOADING = OffsetFetchResponse_v3(0, [], errors.GroupLoadInProgressError.errno)
NOT_COORDINATOR = OffsetFetchResponse_v3(0, [], errors.NotCoordinatorForGroupError.errno)
COMMITTED = OffsetFetchResponse_v3(0, [("t", [(0, 246, "r1:meta", 0)])], 0)


class Coordinator:
    """What aiokafka's GroupCoordinator methods under test use of ``self``: the coordinator
    node answers ``responses`` in turn."""

    def __init__(self, *responses: Any) -> None:
        self.responses = list(responses)
        self.group_id = "g"
        self.coordinator_id = 1
        self._retry_backoff_ms = 10
        self.marked_dead = 0
        self.sent = 0
        coordinator = self

        class Client:
            async def send(self, node_id: int, request: Any, group: Any = None) -> Any:
                coordinator.sent += 1
                return coordinator.responses.pop(0)

        self._client = Client()

    def coordinator_dead(self) -> None:
        self.marked_dead += 1

    async def ensure_coordinator_known(self) -> None:
        return None

    async def _send_req(self, request: Any) -> Any:
        return await GroupCoordinator._send_req(self, request)

    async def _do_fetch_commit_offsets(self, partitions: list[TopicPartition]) -> Any:
        return await GroupCoordinator._do_fetch_commit_offsets(self, partitions)


def fetch(coordinator: Coordinator) -> dict[TopicPartition, OffsetAndMetadata]:
    install()
    return asyncio.run(GroupCoordinator.fetch_committed_offsets(coordinator, [TP]))


def test_a_loading_coordinator_is_asked_again_not_read_as_no_commit() -> None:
    c = Coordinator(LOADING, LOADING, COMMITTED)
    assert fetch(c) == {TP: OffsetAndMetadata(246, "r1:meta")}
    assert c.sent == 3


def test_not_the_coordinator_marks_it_dead_and_asks_again() -> None:
    c = Coordinator(NOT_COORDINATOR, COMMITTED)
    assert fetch(c) == {TP: OffsetAndMetadata(246, "r1:meta")}
    assert c.marked_dead == 1


def test_a_partition_without_a_commit_is_still_none() -> None:
    c = Coordinator(OffsetFetchResponse_v3(0, [("t", [(0, -1, "", 0)])], 0))
    assert fetch(c) == {}


def test_a_request_level_error_that_is_not_retriable_is_raised() -> None:
    denied = OffsetFetchResponse_v3(0, [], errors.GroupAuthorizationFailedError.errno)
    with pytest.raises(errors.GroupAuthorizationFailedError):
        fetch(Coordinator(denied))


def test_the_admin_clients_group_offsets_raise_while_the_coordinator_loads() -> None:
    from aiokafka.admin import AIOKafkaAdminClient

    class Admin:
        def __init__(self, *responses: Any) -> None:
            self.responses = list(responses)

            class Client:
                async def send(inner, node_id: int, request: Any) -> Any:
                    return self.responses.pop(0)

            self._client = Client()

        async def _send_request(self, request: Any, node_id: int | None = None) -> Any:
            return await AIOKafkaAdminClient._send_request(self, request, node_id)

    install()
    admin = Admin(LOADING, COMMITTED)
    with pytest.raises(errors.GroupLoadInProgressError):
        asyncio.run(AIOKafkaAdminClient.list_consumer_group_offsets(admin, "g", 1))
    assert asyncio.run(AIOKafkaAdminClient.list_consumer_group_offsets(admin, "g", 1)) == {
        TP: OffsetAndMetadata(246, "r1:meta")}
