"""The S3 store rides out transient outages (bug C): retries with capped backoff for up to
``retry_s`` seconds of outage, raises at once on errors that waiting cannot mend, and gives up
with a message naming the setting. Time is injected: these tests never sleep."""

from __future__ import annotations

import pytest
from boto3.exceptions import S3UploadFailedError
from botocore.exceptions import (
    ClientError,
    EndpointConnectionError,
    NoCredentialsError,
    ReadTimeoutError,
)

from trajbus.archive.storage import StoreUnavailableError, call_with_retries, is_transient


def client_error(code: str, status: int) -> ClientError:
    return ClientError({"Error": {"Code": code, "Message": code},
                        "ResponseMetadata": {"HTTPStatusCode": status}}, "PutObject")


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0
        self.waits: list[float] = []

    def clock(self) -> float:
        return self.now

    def sleep(self, s: float) -> None:
        self.waits.append(s)
        self.now += s


def failing(times: int, exc: Exception, value: str = "ok"):
    calls = {"n": 0}

    def fn() -> str:
        calls["n"] += 1
        if calls["n"] <= times:
            raise exc
        return value

    return fn, calls


@pytest.mark.parametrize("exc", [
    EndpointConnectionError(endpoint_url="http://127.0.0.1:1"),
    ReadTimeoutError(endpoint_url="http://127.0.0.1:1"),
    client_error("SlowDown", 503),
    client_error("InternalError", 500),
    client_error("RequestTimeout", 400),
    ConnectionResetError("reset"),
    S3UploadFailedError("Failed to upload x: An error occurred (ServiceUnavailable) ..."),
])
def test_transient_failures_are_retried(exc: Exception) -> None:
    assert is_transient(exc)


@pytest.mark.parametrize("exc", [
    NoCredentialsError(),
    client_error("AccessDenied", 403),
    client_error("NoSuchBucket", 404),
    client_error("InvalidAccessKeyId", 403),
    S3UploadFailedError("Failed to upload x: An error occurred (AccessDenied) when calling"),
    ValueError("a bug, not an outage"),
])
def test_permanent_failures_are_not_retried(exc: Exception) -> None:
    assert not is_transient(exc)


def test_an_outage_shorter_than_the_budget_is_ridden_out_with_growing_capped_waits() -> None:
    t = FakeClock()
    fn, calls = failing(12, EndpointConnectionError(endpoint_url="http://s3"))
    assert call_with_retries("put k", fn, retry_s=600, sleep=t.sleep, clock=t.clock) == "ok"
    assert calls["n"] == 13
    assert len(t.waits) == 12
    assert t.waits[0] <= 0.5 * 1.2
    assert all(w <= 10.0 * 1.2 for w in t.waits)  # capped (with jitter)
    assert max(t.waits) >= 10.0 * 0.8  # and it did grow to the cap
    assert 30 < t.now - 1000.0 < 600


def test_an_outage_longer_than_the_budget_raises_naming_the_setting() -> None:
    t = FakeClock()
    fn, calls = failing(10_000, EndpointConnectionError(endpoint_url="http://s3"))
    with pytest.raises(StoreUnavailableError, match="TRAJBUS_ARCHIVE__STORE_RETRY_S") as err:
        call_with_retries("upload a/b.parquet", fn, retry_s=60, sleep=t.sleep, clock=t.clock)
    assert "upload a/b.parquet" in str(err.value)
    assert isinstance(err.value.__cause__, EndpointConnectionError)
    # it waited the budget out, and not much more
    assert 60 <= t.now - 1000.0 <= 60 + 10 * 1.2
    assert calls["n"] > 5


def test_permanent_error_raises_at_once_without_waiting() -> None:
    t = FakeClock()
    fn, calls = failing(1, client_error("AccessDenied", 403))
    with pytest.raises(ClientError):
        call_with_retries("put k", fn, retry_s=600, sleep=t.sleep, clock=t.clock)
    assert calls["n"] == 1 and t.waits == []


def test_no_budget_means_no_retry() -> None:
    t = FakeClock()
    fn, calls = failing(1, EndpointConnectionError(endpoint_url="http://s3"))
    with pytest.raises(EndpointConnectionError):
        call_with_retries("put k", fn, retry_s=0, sleep=t.sleep, clock=t.clock)
    assert calls["n"] == 1 and t.waits == []
