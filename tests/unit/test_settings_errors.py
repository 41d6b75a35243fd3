"""A wrong ``TRAJBUS_*`` variable: the command says which variable and why, exits 1, and never
prints a secret. pydantic's own message quoted the inputs, and for a rule over several fields
the whole group: a heartbeat interval set too high printed ``'sasl_password': '...'`` in
clear. Settings read by the library (``get_settings``) raise the same message as
:class:`SettingsError`, a ``ValueError``, with pydantic's message not chained to it."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from pydantic import BaseModel, ValidationError
from support import REPO

from trajbus.bus.errors import UserError
from trajbus.bus.settings import SettingsError, read_settings, settings_error_message

SECRET = "hunter2-do-not-print"


def _trajbus(*args: str, **env: str) -> subprocess.CompletedProcess[str]:
    full = {k: v for k, v in os.environ.items() if not k.startswith("TRAJBUS_")}
    full.update(env)
    return subprocess.run([sys.executable, "-m", "trajbus", *args], env=full, cwd=REPO,
                          capture_output=True, text=True, timeout=60)


def test_a_rule_over_the_kafka_group_names_the_group_and_never_prints_the_sasl_password() -> None:
    got = _trajbus("topics", "list", TRAJBUS_KAFKA__SASL_PASSWORD=SECRET,
                   TRAJBUS_KAFKA__SASL_USERNAME="svc", TRAJBUS_KAFKA__HEARTBEAT_INTERVAL_MS="5000")
    assert got.returncode == 1
    assert SECRET not in got.stdout + got.stderr
    assert "Traceback" not in got.stderr
    assert got.stderr.startswith(
        "trajbus: error: invalid settings: TRAJBUS_KAFKA__*: heartbeat_interval_ms (5000) must "
        "be at most a third of session_timeout_ms (10000)"), got.stderr


def test_each_wrong_variable_is_named_with_its_value_and_the_reason() -> None:
    got = _trajbus("config", TRAJBUS_KAFKA__SESSION_TIMEOUT_MS="12",
                   TRAJBUS_TOPICS__PARTITIONS="six")
    assert got.returncode == 1 and "Traceback" not in got.stderr
    first = got.stderr.splitlines()[0]
    assert "TRAJBUS_KAFKA__SESSION_TIMEOUT_MS='12': Input should be greater than or equal to " \
           "6000" in first
    assert "TRAJBUS_TOPICS__PARTITIONS='six': Input should be a valid integer" in first
    assert "errors.pydantic.dev" not in got.stderr


def test_the_library_raises_a_settings_error_without_pydantics_message_chained(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRAJBUS_KAFKA__SASL_PASSWORD", SECRET)
    monkeypatch.setenv("TRAJBUS_KAFKA__HEARTBEAT_INTERVAL_MS", "5000")
    with pytest.raises(SettingsError) as caught:
        read_settings()
    exc = caught.value
    assert isinstance(exc, ValueError) and isinstance(exc, UserError)
    assert exc.__cause__ is None and exc.__context__ is None
    assert SECRET not in str(exc)


def test_a_secret_looking_fields_value_is_never_shown() -> None:
    class Creds(BaseModel):
        api_token: int
        port: int

    with pytest.raises(ValidationError) as caught:
        Creds(api_token=SECRET, port="x")  # type: ignore[arg-type]
    message = settings_error_message(caught.value)
    assert SECRET not in message
    assert "TRAJBUS_API_TOKEN: Input should be a valid integer" in message
    assert "TRAJBUS_PORT='x': Input should be a valid integer" in message


@pytest.mark.parametrize(("env", "expected"), [
    # a variable holding JSON that does not parse (pydantic-settings' own error before)
    ({"TRAJBUS_PRODUCER__REDACT_ENV": "notjson"},
     "TRAJBUS_PRODUCER__REDACT_ENV: a value that must be JSON (a list or an object) does not "
     "parse"),
    # an item of a list is named as an item, not as a variable
    ({"TRAJBUS_PRODUCER__REDACT_ENV": '["A", 5]'},
     "TRAJBUS_PRODUCER__REDACT_ENV (item 1)=5: Input should be a valid string"),
    # a group given as one string: not shown (it may be a URL with credentials)
    ({"TRAJBUS_ARCHIVE": '"s3://AKIA:' + SECRET + '@bucket/p"'},
     "TRAJBUS_ARCHIVE: Input should be a valid dictionary or instance of ArchiveSettings"),
    # the real secret field, given a wrong type through the group's JSON
    ({"TRAJBUS_KAFKA": '{"sasl_password": 123456}'},
     "TRAJBUS_KAFKA__SASL_PASSWORD: Input should be a valid string"),
])
def test_every_kind_of_mistake_names_its_variable_without_a_secret(
        env: dict[str, str], expected: str) -> None:
    got = _trajbus("config", **env)
    assert got.returncode == 1 and "Traceback" not in got.stderr
    assert got.stderr.splitlines()[0] == f"trajbus: error: invalid settings: {expected}"
    assert SECRET not in got.stderr and "123456" not in got.stderr


def test_a_typo_in_a_tasks_watchdog_override_is_refused_when_the_settings_are_read() -> None:
    """TRAJBUS_WATCHDOG__PER_TASK goes through the watchdog's own rules builder when the
    settings are read: ``trajbus config`` refuses a typo, naming the variable and the task,
    instead of a worker failing at start."""
    typo = _trajbus("config", TRAJBUS_WATCHDOG__PER_TASK='{"browser": {"loop_min_repeat": 40}}')
    assert typo.returncode == 1 and "Traceback" not in typo.stderr
    assert typo.stderr.startswith(
        "trajbus: error: invalid settings: TRAJBUS_WATCHDOG__PER_TASK: task 'browser': unknown "
        "watchdog setting(s): ['loop_min_repeat']"), typo.stderr
    too_few = _trajbus("config", TRAJBUS_WATCHDOG__PER_TASK='{"web": {"loop_min_repeats": 1}}')
    assert too_few.returncode == 1
    assert "TRAJBUS_WATCHDOG__PER_TASK: task 'web': loop_min_repeats must be >= 2" in (
        too_few.stderr)
    good = _trajbus("config", TRAJBUS_WATCHDOG__PER_TASK='{"web": {"loop_min_repeats": 40}}')
    assert good.returncode == 0, good.stderr
    assert '"loop_min_repeats": 40' in good.stdout


def test_config_shows_a_url_but_never_its_credentials() -> None:
    got = _trajbus("config", TRAJBUS_ARCHIVE__URL="s3://AKIAEXAMPLE:s3cr3tkey@bucket/prefix",
                   TRAJBUS_ARCHIVE__S3_ENDPOINT_URL="http://minio:m1n1opass@127.0.0.1:9000")
    assert got.returncode == 0, got.stderr
    for secret in ("AKIAEXAMPLE", "s3cr3tkey", "m1n1opass"):
        assert secret not in got.stdout
    archive = json.loads(got.stdout)["archive"]
    assert archive["url"] == "s3://***@bucket/prefix"
    assert archive["s3_endpoint_url"] == "http://***@127.0.0.1:9000"


def test_a_urls_user_info_is_masked_wherever_it_is_quoted() -> None:
    from trajbus.bus.settings import mask_url_credentials

    assert mask_url_credentials(
        'cannot reach S3 for s3://k:s@b/p (EndpointConnectionError: Could not connect to the '
        'endpoint URL: "https://tok@host:9000/b"); set ...') == (
        'cannot reach S3 for s3://***@b/p (EndpointConnectionError: Could not connect to the '
        'endpoint URL: "https://***@host:9000/b"); set ...')
    for plain in ("s3://bucket/prefix", "http://127.0.0.1:9000/a@b", ".trajbus/archive",
                  "user@example.com"):
        assert mask_url_credentials(plain) == plain


def test_a_misspelled_variable_is_refused_naming_the_nearest_valid_one() -> None:
    """Issue 37 item 5: a typo was silently ignored and the default used (a worker pointed at
    127.0.0.1:9092 instead of the cluster)."""
    got = _trajbus("config", TRAJBUS_KAFKA__BOOTSTRAP_SERVER="kafka-1:9092",
                   TRAJBUS_ARCHIVE_URL="s3://b/p")
    assert got.returncode == 1 and "Traceback" not in got.stderr
    first = got.stderr.splitlines()[0]
    assert first == (
        "trajbus: error: unknown settings: TRAJBUS_ARCHIVE_URL: no such setting; did you mean "
        "TRAJBUS_ARCHIVE__URL?; TRAJBUS_KAFKA__BOOTSTRAP_SERVER: no such setting; did you "
        "mean TRAJBUS_KAFKA__BOOTSTRAP_SERVERS?"), got.stderr


def test_every_trajbus_variable_the_repo_uses_is_known() -> None:
    """The variables the README, Makefile, CI, infra, bench and tests set are settings or on
    the allow-list of variables read elsewhere (bus.settings.OTHER_VARIABLES), so the check
    refuses typos only."""
    import re

    from trajbus.bus.settings import OTHER_VARIABLES, setting_variables

    names, open_prefixes = setting_variables()
    used: set[str] = set()
    for path in [REPO / "README.md", REPO / "Makefile", *(REPO / ".ci").glob("*"),
                 *(REPO / "infra").rglob("*.yml"), *(REPO / "bench").rglob("*.py"),
                 *(REPO / "tests").glob("*.py"), *(REPO / "trajbus").glob("*.py")]:
        if path.is_file():
            used |= set(re.findall(r"\bTRAJBUS_[A-Z0-9_]*[A-Z0-9]\b", path.read_text()))
    # names a test sets on purpose to show an error (bad values, typos), and group prefixes
    shown_wrong = {"TRAJBUS_API_TOKEN", "TRAJBUS_PORT", "TRAJBUS_ARCHIVE_URL",
                   "TRAJBUS_KAFKA__BOOTSTRAP_SERVER"}
    unknown = sorted(n for n in used - shown_wrong if n not in names | OTHER_VARIABLES
                     and not any(n.startswith(p) for p in open_prefixes))
    assert not unknown, unknown


def test_variables_read_elsewhere_and_mapping_keys_are_accepted() -> None:
    got = _trajbus("config", TRAJBUS_WORKER_ID="w9", TRAJBUS_DEBUG="",
                   TRAJBUS_LOG_FORMAT="json")
    assert got.returncode == 0, got.stderr
    assert json.loads(got.stdout)["log_format"] == "json"
