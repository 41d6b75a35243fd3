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


def _full_spans(r: Redactor, data: object) -> list[tuple[int, int, str]]:
    """The rule loop alone, without the short-input prefilter (data made long enough)."""
    pad = ("\n" if isinstance(data, str) else b"\n") * 5000
    rules = r._text_rules if isinstance(data, str) else r._byte_rules
    return [s for s in r._spans(data + pad, rules)  # type: ignore[operator]
            if s[0] < len(data)]  # type: ignore[arg-type]


def test_fast_paths_agree_with_the_full_rule_scan() -> None:
    """The short-input prefilter and redact_value's joined-strings fast path never skip a
    secret the full scan would find (fuzzed with fragments of every rule and env value)."""
    import random

    r = Redactor.for_env({"SVC_TOKEN": "Zz-Secret-Valu3", "U_SECRET": "aΣσΣπίτιΣ-xyz"})
    frags = ["sk-", "sk-ant-", "AKIA", "ASIA", "ghp_", "github_pat_", "hf_", "xoxb-", "eyJ",
             "://u:", "@h", "BEARER ", "Bearer ", "password=", "PassWd: ", "pwd=", "secret:",
             "API_KEY=", "apikey ", "-----BEGIN RSA PRIVATE KEY-----",
             "-----END RSA PRIVATE KEY-----", "Zz-Secret-Valu3", "zz-secret-valu3",
             "aΣσΣπίτιΣ-xyz", "Σ", "K", "İ", "ab", "0123456789",
             "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdef", " ", "\n", "'", '"', ".", "/", "é"]
    rng = random.Random(7)
    for _ in range(4000):
        text = "".join(rng.choice(frags) for _ in range(rng.randint(0, 8)))
        full = _full_spans(r, text)
        assert (r._spans(text, r._text_rules) == full), text
        raw = text.encode()
        assert r._spans(raw, r._byte_rules) == _full_spans(r, raw), text
        value = {"k": text, "n": [1, 2.5, None, True, {"z": text[::-1]}], text[:5]: "x"}
        assert r.redact_value(value) == r._redact_value(value), text


def test_sandboxes_with_the_same_secrets_share_compiled_rules_never_others_secrets():
    """Compiled rules are shared (1,000 emitters of one node touch one copy), keyed by the
    secrets themselves: a redactor never searches for -- or knows -- another sandbox's
    secret, and counts stay per sandbox."""
    a = Redactor.for_env({"SERVICE_TOKEN": "tok-alpha-000111"})
    b = Redactor.for_env({"SERVICE_TOKEN": "tok-alpha-000111"})
    c = Redactor.for_env({"SERVICE_TOKEN": "tok-bravo-222333"})
    plain1, plain2 = Redactor.for_env(None), Redactor.for_env({"HOME": "/root"})
    assert a._rules is b._rules and plain1._rules is plain2._rules
    assert c._rules is not a._rules and plain1._rules is not a._rules
    assert a.redact_text("use tok-alpha-000111") == "use [REDACTED:env:SERVICE_TOKEN]"
    assert c.redact_text("use tok-alpha-000111") == "use tok-alpha-000111"
    assert plain1.redact_text("use tok-alpha-000111") == "use tok-alpha-000111"
    assert a.counts == {"env:SERVICE_TOKEN": 1} and not b.counts and not c.counts
