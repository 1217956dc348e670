"""Structured outputs through the offline LLM with the embedded SmolLM2: every output obeys its grammar."""
from __future__ import annotations

import json
import re

import jsonschema
import numpy as np
import pytest

from pagedserve import SamplingParams
from pagedserve.sampling_params import StructuredOutputsParams
from tests.structured_output.schemas import generate_schemas

NUM_SCHEMAS = 200
PROMPT = "A JSON object:"


def test_generated_schemas_greedy_and_sampled(llm):
    # Each schema's longest instance has `bound` characters and every constrained token writes at least one,
    # so max_tokens = bound + 1 always leaves room for the stop token: any "length" finish would be a bug.
    schemas = generate_schemas(NUM_SCHEMAS, seed=13)
    prompts, params, expected = [], [], []
    for i, (schema, bound) in enumerate(schemas):
        for temperature in (0.0, 1.0):
            prompts.append(PROMPT)
            params.append(SamplingParams(temperature=temperature, seed=i, max_tokens=bound + 1,
                                         structured_outputs=StructuredOutputsParams(json=schema)))
            expected.append(schema)
    outs = llm.generate(prompts, params, use_tqdm=False)
    failures = []
    for out, schema in zip(outs, expected):
        c = out.outputs[0]
        try:
            assert c.finish_reason == "stop", c.finish_reason
            jsonschema.validate(json.loads(c.text), schema)
        except (AssertionError, ValueError, jsonschema.ValidationError) as e:
            failures.append((c.text, c.finish_reason, str(e)[:200], json.dumps(schema)))
    assert not failures, f"{len(failures)}/{len(outs)} outputs break their schema: {failures[:3]}"
    # The sweep really exercises the schema features, and sampling really varies the answers.
    texts = [o.outputs[0].text for o in outs]
    assert len(set(texts[1::2])) > len(set(texts[0::2])) / 2
    assert sum("$defs" in json.dumps(s) for s, _ in schemas) >= 20


def test_regex_choice_grammar_json_object(llm):
    so = StructuredOutputsParams
    cases = [
        (so(regex=r"[0-9]{4}-[0-9]{2}-[0-9]{2}"), lambda t: re.fullmatch(r"[0-9]{4}-[0-9]{2}-[0-9]{2}", t)),
        (so(choice=["red", "green", "blue"]), lambda t: t in ("red", "green", "blue")),
        (so(grammar='root ::= "yes" | "no" | "maybe " [0-9]'), lambda t: re.fullmatch(r"yes|no|maybe [0-9]", t)),
        (so(json_object=True), lambda t: isinstance(json.loads(t), dict)),
    ]
    params = [SamplingParams(temperature=0.8, seed=3, n=4, max_tokens=64, structured_outputs=c) for c, _ in cases]
    outs = llm.generate(["The answer:"] * len(cases), params, use_tqdm=False)
    for (spec, check), out in zip(cases, outs):
        assert len(out.outputs) == 4
        for c in out.outputs:
            if c.finish_reason == "stop":
                assert check(c.text), (spec, c.text)
            else:  # only an unbounded json_object may run out of tokens
                assert spec.json_object and c.finish_reason == "length", (spec, c.text, c.finish_reason)


def test_stop_strings_max_tokens_and_prefix_caching(llm):
    schema = {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]},
                                               "n": {"type": "integer", "minimum": 0, "maximum": 9}},
              "required": ["city", "n"]}
    so = StructuredOutputsParams(json=schema)
    greedy = SamplingParams(temperature=0.0, max_tokens=40, structured_outputs=so)
    long_prompt = "You are a data assistant for a chain of stores. " * 8 + "Answer with JSON:"
    first, again = (llm.generate(long_prompt, greedy, use_tqdm=False)[0] for _ in range(2))
    assert again.num_cached_tokens > 0 and again.outputs[0].text == first.outputs[0].text
    jsonschema.validate(json.loads(first.outputs[0].text), schema)
    cut = llm.generate(long_prompt, SamplingParams(temperature=0.0, max_tokens=3, structured_outputs=so),
                       use_tqdm=False)[0].outputs[0]
    assert cut.finish_reason == "length" and first.outputs[0].text.startswith(cut.text)
    stopped = llm.generate(long_prompt, SamplingParams(temperature=0.0, max_tokens=40, stop=['"n"'],
                                                       structured_outputs=so), use_tqdm=False)[0].outputs[0]
    assert stopped.finish_reason == "stop" and stopped.stop_reason == '"n"'
    assert first.outputs[0].text.startswith(stopped.text)


def test_the_plan_carries_the_bitmask_of_each_sampling_step(llm):
    # The engine core fills the allowed tokens of its requests under a grammar into the plan the worker runs;
    # a request without a grammar gets no row.
    core, tok = llm.llm_engine.core, llm.get_tokenizer()
    plans = []
    apply_plan = core.executor.apply_plan
    core.executor.apply_plan = lambda plan: (plans.append(plan), apply_plan(plan))[1]
    try:
        choice, free = llm.generate(["The answer:", "Hello"], [
            SamplingParams(temperature=0.0, max_tokens=8, structured_outputs=StructuredOutputsParams(
                choice=["yes", "no"])),
            SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)], use_tqdm=False)
    finally:
        del core.executor.apply_plan
    assert choice.outputs[0].text in ("yes", "no") and len(free.outputs[0].token_ids) == 3
    rows = [p.grammar for p in plans if p.grammar is not None]
    [req_id] = {r for g in rows for r in g.req_ids}
    # One row per step that samples the constrained request: one per output token, its stop token included.
    assert [g.req_ids for g in rows] == [[req_id]] * len(choice.outputs[0].token_ids)
    vocab = core.hf_config.vocab_size
    allowed = np.unpackbits(rows[0].bitmask[0].view(np.uint8), bitorder="little")[:vocab].nonzero()[0]
    # The first token may be any token whose text starts one of the choices.
    want = [t for t in range(vocab) if (text := tok.decode([t])) and ("yes".startswith(text) or "no".startswith(text))]
    assert allowed.tolist() == want and len(want) >= 2


def test_bad_specs_raise_value_error(llm):
    so = StructuredOutputsParams
    with pytest.raises(ValueError, match="exactly one"):
        so(json={"type": "object"}, regex="a")
    with pytest.raises(ValueError, match="exactly one"):
        so()
    bad = [(so(json="{not json"), "not valid JSON"), (so(json={"type": "foo"}), "invalid JSON schema"),
           (so(json={"type": "array", "uniqueItems": True}), "'uniqueItems'"),
           (so(regex="a(b"), "regex cannot be compiled"), (so(grammar="root ::= missing"), "cannot be compiled")]
    for spec, message in bad:
        with pytest.raises(ValueError, match=re.escape(message)):
            llm.generate("x", SamplingParams(max_tokens=4, structured_outputs=spec), use_tqdm=False)
    # The engine keeps serving after refusing them.
    out = llm.generate("x", SamplingParams(max_tokens=4, structured_outputs=so(choice=["ok"])), use_tqdm=False)
    assert out[0].outputs[0].text == "ok"


def test_compile_cache_and_timeout(llm):
    grammars = llm.llm_engine.processor.grammars
    spec = StructuredOutputsParams(json={"type": "object", "properties": {"cached": {"type": "boolean"}}})
    assert grammars.compile(spec) is grammars.compile(spec)  # one compile per spec
    saved = grammars.config
    try:
        grammars.config = type(saved)(compile_timeout_s=0.05)
        # The message names the timeout in force: the request was refused at 0.05 s, not the default.
        with pytest.raises(ValueError, match=r"did not compile within 0\.05s"):
            llm.generate("x", SamplingParams(max_tokens=4, structured_outputs=StructuredOutputsParams(
                json=pathological_schema(6))), use_tqdm=False)
    finally:
        grammars.config = saved


def pathological_schema(depth: int) -> dict:
    # Deeply nested oneOf: the grammar grows about 4x per level.
    if depth == 0:
        return {"type": "string"}
    sub = pathological_schema(depth - 1)
    return {"oneOf": [{"type": "object", "properties": {"a": sub}, "required": ["a"]},
                      {"type": "array", "items": sub},
                      {"type": "object", "properties": {"b": sub, "c": sub}}]}


def test_rollback_hook_for_speculative_drafts(llm):
    from pagedserve.structured_output.manager import StructuredOutputManager

    grammars = llm.llm_engine.processor.grammars
    compiled = grammars.wait(grammars.compile(StructuredOutputsParams(choice=["yes", "no"])))
    tok = llm.get_tokenizer()
    manager = StructuredOutputManager(llm.llm_engine.hf_config.vocab_size)
    manager.add_request("r", compiled)
    good, bad = tok.encode("yes", add_special_tokens=False), tok.encode("maybe", add_special_tokens=False)
    assert manager.validate_tokens("r", good) == len(good)
    assert manager.validate_tokens("r", bad) == 0
    for t in good:
        assert manager.accept_token("r", t)
    manager.rollback("r", len(good))  # rejected drafts are undone; the matcher accepts "no" again
    assert all(manager.accept_token("r", t) for t in tok.encode("no", add_special_tokens=False))
