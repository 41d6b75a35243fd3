"""Redactor unit cases: shapes, env values, counts by rule, length preservation for bytes."""

from __future__ import annotations

from trajbus.producers.redact import Redactor


def test_shapes_and_env_values_are_redacted_and_counted():
    r = Redactor.for_env({"MY_SERVICE_TOKEN": "tok-abcdef-123", "HOME": "/root", "X": "short"},
                         redact_env=[])
    text = ("tok-abcdef-123 sk-abcdefghijklmnopqrstuvwx AKIAIOSFODNN7EXAMPLE "
            "https://u:p4ssw0rd@h/ Authorization: Bearer abcdefghijklmnop")
    out = r.redact_text(text)
    for s in ("tok-abcdef-123", "sk-abcdefghijklmnopqrstuvwx", "AKIAIOSFODNN7EXAMPLE",
              "p4ssw0rd", "abcdefghijklmnop"):
        assert s not in out
    assert r.counts == {"env:MY_SERVICE_TOKEN": 1, "openai_key": 1, "aws_access_key": 1,
                        "url_password": 1, "bearer_token": 1}
    assert "/root" not in [v for _, v in r.env_secrets]  # HOME is not secret


def test_bytes_keep_length_and_plain_text_is_untouched():
    r = Redactor.for_env({"OPENAI_API_KEY": "zz-secret-value"}, ["OPENAI_API_KEY"])
    data = b"line zz-secret-value\n-----BEGIN PRIVATE KEY-----\nabc\n-----END PRIVATE KEY-----\n"
    out = r.redact_bytes(data)
    assert len(out) == len(data) and b"zz-secret-value" not in out and b"abc" not in out
    plain = b"nothing to see here, task-1234 ok\n" * 100
    assert r.redact_bytes(plain) is plain
    assert r.redact_value({"password": "x", "nested": ["zz-secret-value"]}) == {
        "password": "[REDACTED:sensitive_key]", "nested": ["[REDACTED:env:OPENAI_API_KEY]"]}


def test_one_sandbox_never_knows_another_sandboxes_secrets():
    a = Redactor.for_env({"OPENAI_API_KEY": "aaaa-secret-a"}, ["OPENAI_API_KEY"])
    b = Redactor.for_env({"OPENAI_API_KEY": "bbbb-secret-b"}, ["OPENAI_API_KEY"])
    assert [v for _, v in a.env_secrets] == ["aaaa-secret-a"]
    assert [v for _, v in b.env_secrets] == ["bbbb-secret-b"]
