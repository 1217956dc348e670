"""Engine core v2: per-request failures stay per request, adds are all or nothing, no work is lost."""
from __future__ import annotations

import pytest

from pagedserve import SamplingParams
from pagedserve.engine.llm_engine import RequestFailedError

PROMPTS = ["The capital of France is", "One, two, three,", "def add(a, b):", "The sky is"]
GREEDY = SamplingParams(max_tokens=8, temperature=0)


def run_all(engine, ids):
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    return done


def test_a_row_that_raises_inside_a_step_fails_only_its_request(llm, monkeypatch):
    engine = llm.llm_engine
    expected = {i: o.outputs[0].token_ids for i, o in enumerate(llm.generate(PROMPTS, GREEDY, use_tqdm=False))}
    execute_model = engine.runner.execute_model

    def poisoned(num_scheduled_tokens, draft_probs=None, between_layers=None):
        # Any step that includes the poisoned request fails, as a bad row inside the batch would.
        if "bad" in num_scheduled_tokens:
            raise RuntimeError("row exploded")
        return execute_model(num_scheduled_tokens, draft_probs, between_layers)

    monkeypatch.setattr(engine.runner, "execute_model", poisoned)
    for i, p in enumerate(PROMPTS):
        engine.add_request(str(i), p, GREEDY)
        if i == 1:
            engine.add_request("bad", "Anything at all", GREEDY)
    done = run_all(engine, list(map(str, range(4))))
    failures = engine.take_failures()
    assert list(failures) == ["bad"] and "row exploded" in failures["bad"]
    assert {int(k): v.outputs[0].token_ids for k, v in done.items()} == expected
    assert engine.kv.pool.num_free_blocks == engine.kv.num_blocks


def test_offline_generate_raises_for_a_failed_request(llm, monkeypatch):
    runner = llm.llm_engine.runner
    execute_model = runner.execute_model

    def failing(num_scheduled_tokens, draft_probs=None, between_layers=None):
        if any(runner.input_batch.requests[r].params.max_tokens == 3 for r in num_scheduled_tokens):
            raise RuntimeError("row exploded")
        return execute_model(num_scheduled_tokens, draft_probs, between_layers)

    monkeypatch.setattr(runner, "execute_model", failing)
    with pytest.raises(RequestFailedError, match="row exploded"):
        llm.generate(["Hello"], SamplingParams(max_tokens=3), use_tqdm=False)
    monkeypatch.undo()
    assert llm.generate("Hi", GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    assert llm.llm_engine.kv.pool.num_free_blocks == llm.llm_engine.kv.num_blocks


def test_add_with_samples_is_all_or_nothing(llm):
    # "x#1" is taken, so the second sample of request "x" collides. Before: x#0 was left behind as an
    # orphan and the next step's KeyError failed every request in flight.
    engine = llm.llm_engine
    engine.add_request("x#1", "Hello", GREEDY)
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request("x", "Hello there", SamplingParams(n=2, max_tokens=4, temperature=1.0, seed=1))
    assert set(engine.scheduler.requests) == {"x#1"}
    done = run_all(engine, ["x#1"])
    assert list(done) == ["x#1"] and not engine.take_failures()
    assert engine.kv.pool.num_free_blocks == engine.kv.num_blocks


def test_an_empty_plan_still_reaches_the_runner(llm):
    # schedule() drains finished ids into the plan; a step with nothing to run must still hand them on, or
    # the runner keeps per-request state (a seeded generator here) of a request that is gone.
    engine = llm.llm_engine
    engine.add_request("seeded", "Hello", SamplingParams(max_tokens=50, temperature=1.0, seed=7))
    engine.step()
    assert "seeded" in engine.runner.input_batch.requests
    engine.abort_request("seeded")
    assert engine.step() == []
    assert "seeded" not in engine.runner.input_batch.requests
