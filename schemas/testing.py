"""Hypothesis strategies that generate valid records for any Avro schema (test support).

Used by the codec property tests and the schema-compatibility test. Imports hypothesis lazily
so the runtime package does not depend on it.
"""

from __future__ import annotations

from typing import Any


def records(schema: Any, named: dict[str, Any] | None = None) -> Any:
    """A strategy of Python values valid for the (parsed or raw JSON) Avro ``schema``."""
    from hypothesis import strategies as st

    named = {} if named is None else named

    def strat(s: Any, ns: str = "") -> Any:
        if isinstance(s, str):
            prim = {
                "null": st.none(),
                "boolean": st.booleans(),
                "int": st.integers(-(2**31), 2**31 - 1),
                "long": st.integers(-(2**63), 2**63 - 1),
                "float": st.floats(allow_nan=False, width=32),
                "double": st.floats(allow_nan=False),
                "bytes": st.binary(max_size=64),
                "string": st.text(max_size=24),
            }
            if s in prim:
                return prim[s]
            full = s if "." in s or not ns else f"{ns}.{s}"
            target = named.get(full) or named.get(s)
            if target is None:
                raise KeyError(f"unknown named type {s}")
            return st.deferred(lambda: strat(target, ns))
        if isinstance(s, list):
            return st.one_of(*[strat(b, ns) for b in s])
        t = s["type"]
        if t in ("record", "enum", "fixed"):
            name = s["name"]
            space = s.get("namespace", ns)
            full = name if "." in name else (f"{space}.{name}" if space else name)
            named[full] = s
            ns = full.rsplit(".", 1)[0] if "." in full else ns
        if t == "record":
            fields = {f["name"]: strat(f["type"], ns) for f in s["fields"]}
            return st.fixed_dictionaries(fields)
        if t == "enum":
            return st.sampled_from(s["symbols"])
        if t == "fixed":
            return st.binary(min_size=s["size"], max_size=s["size"])
        if t == "array":
            return st.lists(strat(s["items"], ns), max_size=3)
        if t == "map":
            return st.dictionaries(st.text(max_size=8), strat(s["values"], ns), max_size=3)
        return strat(t, ns)

    return strat(schema)
