"""JSON schema checks that run before a schema reaches the grammar engine.

A schema must be valid JSON Schema (jsonschema's meta-schema check), and must not lean on keywords the grammar
engine cannot enforce: xgrammar accepts them but ignores them, so the output would look constrained and yet
break the schema. Those are refused by name instead.
"""
from __future__ import annotations

import json
import subprocess
import sys
from typing import Any

from pagedserve.config import json_object

# Keywords xgrammar 0.2 does not turn into grammar rules.
UNSUPPORTED_KEYWORDS = ("not", "if", "then", "else", "uniqueItems", "contains", "minContains", "maxContains",
                        "patternProperties", "propertyNames", "dependentRequired", "dependentSchemas",
                        "dependencies", "unevaluatedProperties", "unevaluatedItems", "multipleOf")
# Where a schema holds subschemas: keyword -> how (one schema, a list, or a name -> schema map).
_ONE = ("items", "additionalProperties", "additionalItems")
_LIST = ("anyOf", "oneOf", "allOf", "prefixItems")
_MAP = ("properties", "$defs", "definitions")


# Deeper schemas are refused before anything walks them: jsonschema's and xgrammar's walks recurse, and a
# schema nested thousands deep would end in a RecursionError (a crash, not the client's error).
MAX_JSON_DEPTH = 100


def load_schema(schema: str | dict) -> dict:
    return check_json_value(json_object(schema, "the JSON schema"), "the JSON schema")


def check_json_value(value: Any, what: str) -> Any:
    """value, once its nesting depth is at most MAX_JSON_DEPTH and its keys and strings are valid Unicode."""
    stack = [(value, 1)]
    while stack:  # iterative: the point is not to recurse on a client's nesting
        node, depth = stack.pop()
        if isinstance(node, str):
            try:
                node.encode("utf-8")
            except UnicodeEncodeError:
                raise ValueError(f"{what} holds a lone surrogate in {node[:40]!r}") from None
            continue
        if not isinstance(node, (dict, list)):
            continue
        if depth > MAX_JSON_DEPTH:
            raise ValueError(f"{what} is nested more than {MAX_JSON_DEPTH} levels deep")
        items = [*node.keys(), *node.values()] if isinstance(node, dict) else node
        stack.extend((item, depth + 1) for item in items)
    return value


# The meta-schema check is pure Python and holds the GIL for as long as it runs, which grows with the schema.
# In a server thread a big schema starves the engine thread, which needs the GIL between its torch ops
# (measured: a nested oneOf schema of ~3 MB stalled an 8-token request for 35 s on 2 cores). Schemas longer
# than this many characters of JSON are checked in a child process at low priority instead (~0.2 s to start,
# killed at the compile timeout); shorter ones take milliseconds in the thread.
IN_THREAD_CHECK_CHARS = 32 * 1024
_CHILD = """
import json, os, sys
os.nice(19)
import jsonschema
schema = json.load(sys.stdin)
try:
    jsonschema.validators.validator_for(schema).check_schema(schema)
except jsonschema.SchemaError as e:
    json.dump(["/".join(str(p) for p in e.absolute_path) or "(root)", e.message], sys.stdout)
"""


def check_schema(schema: dict, text: str | None = None, timeout_s: float | None = None) -> None:
    # text: schema as JSON, when the caller has it (its length picks where the meta-schema check runs).
    error = _meta_schema_error(schema, text, timeout_s)
    if error is not None:
        raise ValueError(f"invalid JSON schema at {error[0]}: {error[1]}")
    _check_supported(schema, "#")


def _meta_schema_error(schema: dict, text: str | None, timeout_s: float | None) -> tuple[str, str] | None:
    text = json.dumps(schema) if text is None else text
    if len(text) > IN_THREAD_CHECK_CHARS:
        try:
            out = subprocess.run([sys.executable, "-c", _CHILD], input=text, capture_output=True, text=True,
                                 timeout=timeout_s, check=True).stdout
        except subprocess.TimeoutExpired:
            raise ValueError(f"the JSON schema could not be checked within {timeout_s:g}s; simplify it") from None
        except subprocess.CalledProcessError as e:  # e.g. nesting past the recursion limit: still the client's schema
            last = (e.stderr.strip().splitlines() or ["no output"])[-1]
            raise ValueError(f"the JSON schema could not be checked: {last}") from None
        return tuple(json.loads(out)) if out else None
    import jsonschema

    try:
        jsonschema.validators.validator_for(schema).check_schema(schema)
    except jsonschema.SchemaError as e:
        return "/".join(str(p) for p in e.absolute_path) or "(root)", e.message
    return None


def _check_supported(node: Any, where: str) -> None:
    if not isinstance(node, dict):
        return  # true / false schemas
    for key in UNSUPPORTED_KEYWORDS:
        if key in node:
            raise ValueError(f"the JSON schema uses '{key}' at {where}, which structured outputs do not support "
                             "(the grammar engine cannot enforce it)")
    for key in _ONE:
        if isinstance(node.get(key), dict):
            _check_supported(node[key], f"{where}/{key}")
    for key in _LIST:
        for i, sub in enumerate(node.get(key) or ()):
            _check_supported(sub, f"{where}/{key}/{i}")
    for key in _MAP:
        for name, sub in (node.get(key) or {}).items():
            _check_supported(sub, f"{where}/{key}/{name}")
