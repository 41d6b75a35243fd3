"""Secret hygiene: redact credentials from tool args, results and trace bytes before they leave
the sandbox.

Guarantees:

- A :class:`Redactor` is built from *one sandbox's own* environment (an explicit dict, never
  ``os.environ`` implicitly), so one sandbox's secret values are only ever searched for -- and
  known -- inside that sandbox's emitter. Values of the variables named in
  ``settings.producer.redact_env`` (plus any variable whose *name* looks secret: ``*TOKEN*``,
  ``*SECRET*``, ``*PASSWORD*``, ``*API_KEY*``, ``*PRIVATE_KEY*``) are redacted wherever they
  appear, as do common credential shapes (rules below), even with an empty environment.
- Every redaction is counted by rule (``Redactor.counts``); env-value rules are named
  ``env:<VAR>`` (the variable's name, never its value).
- :meth:`Redactor.redact_bytes` preserves length (the secret is overwritten in place by a mask of
  the same length), so trace byte offsets stay valid; :meth:`Redactor.redact_text` and
  :meth:`Redactor.redact_value` replace with ``[REDACTED:<rule>]``.

Not covered: secrets split across two trace chunks (the tailer cuts chunks at line ends to make
this rare), and secrets re-encoded (base64, URL-encoding) before they were written.
"""

from __future__ import annotations

import re
import weakref
from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

#: Environment variables whose *name* matches this are treated as secret too.
SECRET_NAME_RE = re.compile(r"(TOKEN|SECRET|PASSWORD|PASSWD|API_KEY|APIKEY|PRIVATE_KEY|CREDENTIAL)",
                            re.IGNORECASE)
#: Dict keys whose value is redacted whole in structured tool args/results.
SENSITIVE_KEY_RE = re.compile(
    r"^(password|passwd|secret|token|api[_-]?key|access[_-]?token|refresh[_-]?token|"
    r"authorization|client[_-]?secret|private[_-]?key|aws_secret_access_key)$",
    re.IGNORECASE,
)
#: Env values shorter than this are not searched for (would redact "1", "true", ...).
MIN_ENV_VALUE_LEN = 6



@dataclass(frozen=True)
class Rule:
    """A credential shape. ``pattern`` starts with a literal (so ``re`` scans fast); a named
    group ``M`` marks the part to mask (else the whole match). ``hints``: literals, one of which
    must occur for the rule to run at all. ``fold``: match against the lower-cased text."""

    name: str
    pattern: str
    hints: tuple[str, ...]
    fold: bool = False


_KW_VALUE = r"[\"']?\s*[:=]\s*[\"']?(?P<M>[^\s\"',;&]{4,})"
RULES: list[Rule] = [
    Rule("private_key", r"-----begin [a-z0-9 ]*private key-----[\s\S]*?"
         r"-----end [a-z0-9 ]*private key-----", ("private key",), fold=True),
    Rule("anthropic_key", r"sk-ant-(?<![A-Za-z0-9]sk-ant-)[A-Za-z0-9_\-]{16,}", ("sk-ant-",)),
    Rule("openai_key", r"sk-(?<![A-Za-z0-9]sk-)(?!ant-)[A-Za-z0-9_\-]{20,}", ("sk-",)),
    Rule("aws_access_key", r"(?:AKIA|ASIA)(?<![A-Za-z0-9]AKIA)(?<![A-Za-z0-9]ASIA)[0-9A-Z]{16}"
         r"(?![0-9A-Za-z])", ("AKIA", "ASIA")),
    Rule("github_token", r"gh[pousr]_[A-Za-z0-9]{30,}", ("gh",)),
    Rule("github_token", r"github_pat_[A-Za-z0-9_]{30,}", ("github_pat_",)),
    Rule("hf_token", r"hf_(?<![A-Za-z0-9]hf_)[A-Za-z0-9]{30,}", ("hf_",)),
    Rule("slack_token", r"xox[abprs]-[A-Za-z0-9\-]{10,}", ("xox",)),
    Rule("jwt", r"eyJ[A-Za-z0-9_\-]{8,}\.eyJ[A-Za-z0-9_\-]{8,}\.[A-Za-z0-9_\-]{8,}", ("eyJ",)),
    Rule("bearer_token", r"bearer\s+(?P<M>[a-z0-9._~+/\-]{12,}=*)", ("bearer",), fold=True),
    Rule("url_password", r"://[^:/@\s\"'<>]+:(?P<M>[^@/\s\"'<>]+)@", ("://",)),
] + [
    Rule("password_assignment", kw + _KW_VALUE, (kw,), fold=True)
    for kw in ("password", "passwd", "pwd", "secret", "api_key", "apikey")
]


def _mask(rule: str, length: int) -> str:
    """A mask of exactly ``length`` characters naming the rule when there is room."""
    label = f"[REDACTED:{rule}]"
    if len(label) <= length:
        return label + "*" * (length - len(label))
    return "#" * length


def _hint_filter(hints: Iterable[str], as_bytes: bool) -> Callable[[Any], bool]:
    """A prefilter for short inputs: False only when no hint (of any rule) can occur in the
    text or in its lower-cased form, so no rule can run. ASCII hints are looked for
    lower-cased, as substrings of the lower-cased input (a hint that occurs in the text occurs
    lower-cased in the lower-cased text; a hint containing another is dropped): one
    ``__contains__`` per hint, iterated in C -- several times faster than one regex
    alternation of them (``re`` tries the alternation at every position whose character starts
    some hint, and ``a``, ``e``, ``p``, ``s`` do; docs/decisions/0008-shared-redaction-rules.md).
    The rest (non-ASCII env values, where lower-casing may depend on context) by plain
    substring checks on the input and on its lower-cased form."""
    ascii_: set[str] = set()
    other: list[Any] = []
    for h in hints:
        if h.isascii():
            ascii_.add(h.lower())
        else:
            other.append(h.encode() if as_bytes else h)
    kept = sorted(h for h in ascii_ if not any(o != h and o in h for o in ascii_))
    lowered = tuple(h.encode() for h in kept) if as_bytes else tuple(kept)
    others = tuple(other)

    def hinted(data: Any) -> bool:
        low = data.lower()
        if any(map(low.__contains__, lowered)):
            return True
        return any(h in data or h in low for h in others)

    return hinted


class _CompiledRules:
    """The compiled rules of one set of env secrets (every rule's pattern, the hint
    prefilters, a cache of which dict keys look sensitive). Shared by the redactors of the
    sandboxes with exactly these secrets -- on a node, mostly the many with none of their
    own: 1,000 emitters then touch one set of rule objects instead of 1,000 copies, which
    saves CPU on every emit (docs/decisions/0008-shared-redaction-rules.md). A redactor never
    holds another sandbox's secrets: the key is the secrets themselves."""

    def __init__(self, env_secrets: tuple[tuple[str, str], ...]) -> None:
        rules = [Rule(f"env:{n}", re.escape(v), (v,)) for n, v in env_secrets] + RULES
        self.text_rules = [(r, re.compile(r.pattern), r.hints) for r in rules]
        # Short inputs: one scan for any hint decides whether to look closer.
        all_hints = [h for r in rules for h in r.hints]
        self.text_hinted = _hint_filter(all_hints, as_bytes=False)
        self.bytes_hinted = _hint_filter(all_hints, as_bytes=True)
        self.key_sensitive: dict[str, bool] = {}  # dict key -> SENSITIVE_KEY_RE matches
        # short free texts these rules leave unchanged (tool names, content types repeat on
        # every event): exact for every redactor with these rules (the emitter fills it)
        self.clean_texts: set[str] = set()
        self.byte_rules = [
            (r, re.compile(r.pattern.encode()), tuple(h.encode() for h in r.hints)) for r in rules
        ]


# Alive while a redactor uses them: a closed sandbox's secrets are not kept here.
_compiled: weakref.WeakValueDictionary[tuple[tuple[str, str], ...], _CompiledRules] = (
    weakref.WeakValueDictionary())


def _compiled_rules(env_secrets: tuple[tuple[str, str], ...]) -> _CompiledRules:
    rules = _compiled.get(env_secrets)
    if rules is None:
        rules = _compiled[env_secrets] = _CompiledRules(env_secrets)
    return rules


@dataclass
class Redactor:
    """Redacts one sandbox's secrets. Build with :meth:`for_env`."""

    env_secrets: list[tuple[str, str]] = field(default_factory=list)  # (var name, value)
    counts: Counter[str] = field(default_factory=Counter)

    def __post_init__(self) -> None:
        # Longest values first so a value containing another is masked whole.
        self.env_secrets.sort(key=lambda nv: -len(nv[1]))
        compiled = self._rules = _compiled_rules(tuple(self.env_secrets))
        self._text_rules = compiled.text_rules
        self._text_hinted = compiled.text_hinted
        self._bytes_hinted = compiled.bytes_hinted
        self._key_sensitive = compiled.key_sensitive
        self._byte_rules = compiled.byte_rules
        self.clean_texts = compiled.clean_texts

    def _spans(self, data: Any, rules: list[tuple[Rule, Any, tuple[Any, ...]]]
               ) -> list[tuple[int, int, str]]:
        """Non-overlapping (start, end, rule) spans to mask, in order."""
        if len(data) <= 4096 and not (
                self._text_hinted if isinstance(data, str) else self._bytes_hinted)(data):
            return []
        folded = None
        found: list[tuple[int, int, str]] = []
        for rule, pattern, hints in rules:
            if rule.fold:
                if folded is None:
                    folded = data.lower()
                text = folded
            else:
                text = data
            if not any(h in text for h in hints):
                continue
            for m in pattern.finditer(text):
                g = "M" if "M" in pattern.groupindex and m.start("M") >= 0 else 0
                start, end = m.span(g)
                if end > start:
                    found.append((start, end, rule.name))
        if len(found) > 1:
            found.sort()
            merged: list[tuple[int, int, str]] = []
            for span in found:
                if merged and span[0] < merged[-1][1]:
                    last = merged[-1]
                    if span[1] > last[1]:
                        merged[-1] = (last[0], span[1], last[2])
                    continue
                merged.append(span)
            found = merged
        return found

    @classmethod
    def for_env(cls, env: Mapping[str, str] | None, redact_env: Iterable[str] = ()) -> Redactor:
        """A redactor for one sandbox: ``env`` is *that sandbox's* environment."""
        names = set(redact_env)
        secrets: list[tuple[str, str]] = []
        for name, value in (env or {}).items():
            if not isinstance(value, str) or len(value) < MIN_ENV_VALUE_LEN:
                continue
            if name in names or SECRET_NAME_RE.search(name):
                secrets.append((name, value))
        return cls(env_secrets=secrets)

    # -- text ---------------------------------------------------------------------------------
    def redact_text(self, text: str) -> str:
        """Replace every secret in ``text`` with ``[REDACTED:<rule>]`` (length may change)."""
        spans = self._spans(text, self._text_rules)
        if not spans:
            return text
        out: list[str] = []
        pos = 0
        for start, end, rule in spans:
            out.append(text[pos:start])
            out.append(f"[REDACTED:{rule}]")
            pos = end
            self.counts[rule] += 1
        out.append(text[pos:])
        return "".join(out)

    # -- bytes (length-preserving) ------------------------------------------------------------
    def redact_bytes(self, data: bytes) -> bytes:
        """Overwrite every secret in ``data`` with a same-length mask (offsets stay valid)."""
        spans = self._spans(data, self._byte_rules)
        if not spans:
            return data
        buf = bytearray(data)
        for start, end, rule in spans:
            buf[start:end] = _mask(rule, end - start).encode()
            self.counts[rule] += 1
        return bytes(buf)

    # -- structured values --------------------------------------------------------------------
    def _collect(self, value: Any, out: list[str]) -> bool:
        """Append every string (keys too) of a plain JSON value -- dicts, lists, str, int,
        float, bool, None -- to ``out``. False when it holds anything else (bytes, tuples,
        other mappings...) or a key that looks sensitive: then the full walk decides."""
        t = type(value)
        if t is str:
            out.append(value)
            return True
        if t is dict:
            sensitive = self._key_sensitive
            for k, v in value.items():
                if type(k) is not str:
                    return False
                hit = sensitive.get(k)
                if hit is None:
                    hit = SENSITIVE_KEY_RE.match(k) is not None
                    if len(sensitive) < 4096:
                        sensitive[k] = hit
                if hit:
                    return False
                out.append(k)
                if not self._collect(v, out):
                    return False
            return True
        if t is list:
            return all(self._collect(v, out) for v in value)
        return t is int or t is float or t is bool or value is None

    def redact_value(self, value: Any) -> Any:
        """Redact strings anywhere inside JSON-like ``value`` (dicts, lists, tuples, str, bytes);
        a dict entry whose key looks sensitive (``password``, ``token``...) is replaced whole.
        A plain JSON value (dicts, lists, scalars) with nothing to redact is returned as is
        (not copied)."""
        if type(value) is dict or type(value) is list:
            # Fast path: one hint scan over all its strings joined. Joining keeps every
            # substring of every string, so no hint -> no rule can match any of them.
            strings: list[str] = []
            if self._collect(value, strings) and (
                    not strings or not self._text_hinted("\x00".join(strings))):
                return value
        return self._redact_value(value)

    def _redact_value(self, value: Any) -> Any:
        if isinstance(value, str):
            return self.redact_text(value)
        if isinstance(value, bytes | bytearray):
            return self.redact_bytes(bytes(value))
        if isinstance(value, Mapping):
            out: dict[Any, Any] = {}
            for k, v in value.items():
                key = self.redact_text(k) if isinstance(k, str) else k
                if isinstance(k, str) and SENSITIVE_KEY_RE.match(k) and v not in (None, "", 0):
                    self.counts["sensitive_key"] += 1
                    out[key] = "[REDACTED:sensitive_key]"
                else:
                    out[key] = self._redact_value(v)
            return out
        if isinstance(value, list | tuple):
            return [self._redact_value(v) for v in value]
        return value

    @property
    def total(self) -> int:
        return sum(self.counts.values())
