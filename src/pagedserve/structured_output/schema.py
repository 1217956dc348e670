"""JSON schema checks that run before a schema reaches the grammar engine.

A schema must be valid JSON Schema (jsonschema's meta-schema check), and must not lean on keywords the grammar
engine cannot enforce: xgrammar accepts them but ignores them, so the output would look constrained and yet
break the schema. Those are refused by name instead.
"""
from __future__ import annotations

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


def load_schema(schema: str | dict) -> dict:
    return json_object(schema, "the JSON schema")


def check_schema(schema: dict) -> None:
    import jsonschema

    try:
        jsonschema.validators.validator_for(schema).check_schema(schema)
    except jsonschema.SchemaError as e:
        where = "/".join(str(p) for p in e.absolute_path) or "(root)"
        raise ValueError(f"invalid JSON schema at {where}: {e.message}") from e
    _check_supported(schema, "#")


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
