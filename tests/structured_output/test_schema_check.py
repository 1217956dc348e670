"""The meta-schema check gives the same verdict in the thread (small schemas) and in a child process (large
ones, which would hold the GIL too long on a server: structured_output/schema.py)."""
import json

import pytest

from pagedserve.structured_output import schema as schema_mod


def _big(bad: bool) -> dict:
    # Over IN_THREAD_CHECK_CHARS of JSON; `bad` puts an invalid "type" deep inside.
    props = {f"field_{i}": {"type": "string", "description": "x" * 40} for i in range(800)}
    props["field_799"] = {"type": "no-such-type" if bad else "integer"}
    return {"type": "object", "properties": props}


@pytest.mark.parametrize("bad", [False, True])
def test_child_process_check_matches_the_thread_check(monkeypatch, bad):
    s = _big(bad)
    text = json.dumps(s)
    assert len(text) > schema_mod.IN_THREAD_CHECK_CHARS
    child = schema_mod._meta_schema_error(s, text, timeout_s=60)
    monkeypatch.setattr(schema_mod, "IN_THREAD_CHECK_CHARS", len(text) + 1)
    thread = schema_mod._meta_schema_error(s, text, timeout_s=60)
    assert child == thread
    assert (child is not None) == bad
    if bad:
        assert child[0] == "properties/field_799/type"
        with pytest.raises(ValueError, match="invalid JSON schema at properties/field_799/type"):
            schema_mod.check_schema(s, text, 60)


def test_child_process_check_is_killed_at_the_timeout():
    s = _big(False)
    with pytest.raises(ValueError, match="could not be checked within"):
        schema_mod.check_schema(s, json.dumps(s), timeout_s=0.001)


def test_a_schema_the_child_cannot_check_is_a_value_error():
    n = 3000  # nesting past the child's recursion limit (the text is written out: json.dumps would recurse too)
    text = '{"type": "array", "items": ' * n + '{"type": "string"}' + "}" * n
    deep: dict = {"type": "string"}
    for _ in range(n):
        deep = {"type": "array", "items": deep}
    assert len(text) > schema_mod.IN_THREAD_CHECK_CHARS
    with pytest.raises(ValueError, match="could not be checked: RecursionError"):
        schema_mod._meta_schema_error(deep, text, timeout_s=60)
