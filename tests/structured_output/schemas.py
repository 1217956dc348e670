"""A seeded generator of JSON schemas whose every valid instance has a known maximum length.

Each schema comes with the length, in characters, of its longest compact serialization. Under a grammar every
token writes at least one character, so max_tokens = that bound + 1 (the stop token) lets every output finish:
a length cut-off would then be a bug, not an artifact of the test.
"""
from __future__ import annotations

import json
import random

MAX_BOUND = 160  # characters; keeps the batch's decode short on 2 CPU cores
_WORDS = ["store", "date", "hour", "count", "name", "city", "open", "zone", "tags", "kind", "level", "id"]
_PATTERNS = [("^[a-z]{1,6}$", 6), ("^[A-Z][0-9]{2}$", 3), ("^[0-9]{4}-[0-9]{2}-[0-9]{2}$", 10), ("^(yes|no)$", 3)]
# Separators as xgrammar writes compact JSON: ", " and ": ".
_COMMA, _COLON = 2, 2
# A character of a free string may be written as a \uXXXX escape.
_ESCAPE = 6


def _string(rng: random.Random) -> tuple[dict, int]:
    r = rng.random()
    if r < 0.35:
        pattern, length = rng.choice(_PATTERNS)
        return {"type": "string", "pattern": pattern}, length + 2
    if r < 0.6:
        values = rng.sample(["red", "green", "blue", "open", "closed", "a b", "x-1"], rng.randint(1, 4))
        return {"enum": values}, max(len(json.dumps(v)) for v in values)
    lo = rng.randint(0, 3)
    hi = lo + rng.randint(0, 5)
    return {"type": "string", "minLength": lo, "maxLength": hi}, hi * _ESCAPE + 2


def _leaf(rng: random.Random) -> tuple[dict, int]:
    r = rng.random()
    if r < 0.45:
        return _string(rng)
    if r < 0.8:
        lo = rng.randint(-50, 50)
        hi = lo + rng.choice([0, 1, 9, 100, 2000])
        return {"type": "integer", "minimum": lo, "maximum": hi}, max(len(str(lo)), len(str(hi)))
    if r < 0.93:
        return {"type": "boolean"}, 5
    return {"enum": [1, "two", None, True]}, 5


def _node(rng: random.Random, depth: int, defs: dict[str, tuple[dict, int]]) -> tuple[dict, int]:
    r = rng.random()
    if depth <= 0 or r < 0.35:
        if defs and rng.random() < 0.2:
            name = rng.choice(sorted(defs))
            return {"$ref": f"#/$defs/{name}"}, defs[name][1]
        return _leaf(rng)
    if r < 0.55:
        item, bound = _node(rng, depth - 1, defs)
        lo = rng.randint(0, 2)
        hi = lo + rng.randint(0, 2)
        return {"type": "array", "items": item, "minItems": lo, "maxItems": hi}, 2 + hi * (bound + _COMMA)
    if r < 0.65:
        branches = [_node(rng, depth - 1, defs) for _ in range(2)]
        return {"anyOf": [b[0] for b in branches]}, max(b[1] for b in branches)
    return _object(rng, depth, defs)


def _object(rng: random.Random, depth: int, defs: dict[str, tuple[dict, int]]) -> tuple[dict, int]:
    names = rng.sample(_WORDS, rng.randint(1, 3))
    props, bound = {}, 2
    for name in names:
        sub, b = _node(rng, depth - 1, defs)
        props[name] = sub
        bound += len(json.dumps(name)) + _COLON + b + _COMMA
    required = [n for n in names if rng.random() < 0.6]
    schema = {"type": "object", "properties": props, "additionalProperties": False}
    if required:
        schema["required"] = required
    return schema, bound


def generate_schema(rng: random.Random) -> tuple[dict, int]:
    """(schema, max characters of an instance), with the bound at most MAX_BOUND."""
    while True:
        defs: dict[str, tuple[dict, int]] = {}
        if rng.random() < 0.3:
            defs["item"] = _object(rng, 1, {})
        schema, bound = _object(rng, rng.randint(1, 3), defs)
        if defs:
            schema["$defs"] = {name: d[0] for name, d in defs.items()}
        if bound <= MAX_BOUND:
            return schema, bound


def generate_schemas(count: int, seed: int = 0) -> list[tuple[dict, int]]:
    rng = random.Random(seed)
    return [generate_schema(rng) for _ in range(count)]
