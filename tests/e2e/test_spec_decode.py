"""Speculative decoding end to end on the embedded model: greedy output token-identical with it on and off,
and the features that see several tokens per step (logprobs, stop strings, max/min tokens, n, streaming)."""
from __future__ import annotations

import random

import pytest

from pagedserve import LLM, SamplingParams
from pagedserve.sampling_params import RequestOutputKind
from tests.e2e.conftest import KV_BYTES

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3,
         "disable_by_batch_size": None}
ITEMS = ["apples", "bolts", "cables", "drills", "engines", "filters", "gears", "hoses", "inks", "jacks"]


def table_prompts(num: int) -> list[str]:
    # Answers quote the prompt: the model copies a row of the table, which n-gram lookup drafts.
    rng = random.Random(0)
    prompts = []
    for i in range(num):
        items = rng.sample(ITEMS, 3)
        rows = "\n".join(f"{it} | {rng.randint(10, 99)} | {rng.randint(1, 9)}.{rng.randint(10, 99)} EUR"
                         for it in items)
        pick = items[i % 3]
        prompts.append(f"Stock:\n{rows}\n\nCopy the row for {pick}:\n{pick} |")
    return prompts


@pytest.fixture(scope="module")
def spec_llm():
    return LLM(kv_cache_memory_bytes=KV_BYTES, max_num_batched_tokens=512, max_num_seqs=64,
               speculative_config=NGRAM)


@pytest.fixture(scope="module")
def plain_llm():
    return LLM(kv_cache_memory_bytes=KV_BYTES, max_num_batched_tokens=512, max_num_seqs=64)


def test_greedy_is_token_identical_with_speculation(spec_llm, plain_llm):
    prompts = table_prompts(50)
    params = SamplingParams(temperature=0.0, max_tokens=10)
    spec = spec_llm.llm_engine.core.stats.spec
    accepted_before = spec.num_accepted_tokens
    on = spec_llm.generate(prompts, params, use_tqdm=False)
    off = plain_llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in on] == [o.outputs[0].token_ids for o in off]
    assert [o.outputs[0].text for o in on] == [o.outputs[0].text for o in off]
    # The drafts did their job: most of the answer came from accepted drafts.
    assert spec.num_accepted_tokens - accepted_before > 50
    assert spec_llm.llm_engine.core.kv.pool.num_free_blocks == spec_llm.llm_engine.core.num_kv_blocks


def test_logprobs_stop_strings_and_token_limits_match(spec_llm, plain_llm):
    prompt = table_prompts(1)[0]
    cases = [SamplingParams(temperature=0.0, max_tokens=9, logprobs=2),
             SamplingParams(temperature=0.0, max_tokens=12, stop=[" EUR"]),
             SamplingParams(temperature=0.0, max_tokens=12, stop=["|"], include_stop_str_in_output=True),
             SamplingParams(temperature=0.0, max_tokens=5, min_tokens=5, logprobs=0)]
    on = spec_llm.generate([prompt] * len(cases), cases, use_tqdm=False)
    off = plain_llm.generate([prompt] * len(cases), cases, use_tqdm=False)
    for a, b in zip(on, off):
        ca, cb = a.outputs[0], b.outputs[0]
        assert (ca.token_ids, ca.text, ca.finish_reason, ca.stop_reason) == \
            (cb.token_ids, cb.text, cb.finish_reason, cb.stop_reason)
        if cb.logprobs is not None:
            assert len(ca.logprobs) == len(cb.logprobs) == len(cb.token_ids)
            for x, y in zip(ca.logprobs, cb.logprobs):
                assert x.keys() == y.keys()
                for t in y:
                    assert x[t].logprob == pytest.approx(y[t].logprob, abs=1e-3)
                    assert x[t].rank == y[t].rank
            assert ca.cumulative_logprob == pytest.approx(cb.cumulative_logprob, abs=1e-3)
    assert len(on[0].outputs[0].token_ids) == 9 and on[0].outputs[0].finish_reason == "length"


def test_sampling_n_best_of_and_seeds(spec_llm):
    prompt = table_prompts(2)[1]
    params = SamplingParams(temperature=0.8, max_tokens=8, n=3, seed=7, logprobs=1)
    first = spec_llm.generate(prompt, params, use_tqdm=False)[0]
    again = spec_llm.generate(prompt, params, use_tqdm=False)[0]
    assert [c.token_ids for c in first.outputs] == [c.token_ids for c in again.outputs]  # seeded: reproducible
    assert all(len(c.token_ids) == 8 and len(c.logprobs) == 8 for c in first.outputs)
    best = spec_llm.generate(prompt, SamplingParams(temperature=1.0, max_tokens=5, n=2, best_of=3, seed=3),
                             use_tqdm=False)[0]
    assert len(best.outputs) == 2 and best.outputs[0].cumulative_logprob is None
    core = spec_llm.llm_engine.core
    assert core.kv.pool.num_free_blocks == core.num_kv_blocks


def test_streaming_deltas_carry_several_tokens(spec_llm, plain_llm):
    prompt = table_prompts(3)[2]
    params = SamplingParams(temperature=0.0, max_tokens=10, output_kind=RequestOutputKind.DELTA)
    engine = spec_llm.llm_engine
    engine.add_request("stream", prompt, params)
    deltas = []
    while engine.has_unfinished_requests():
        deltas += [o.outputs[0] for o in engine.step() if o.request_id == "stream" and o.outputs]
    [full] = plain_llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=10), use_tqdm=False)
    assert [t for d in deltas for t in d.token_ids] == full.outputs[0].token_ids
    assert "".join(d.text for d in deltas) == full.outputs[0].text
    assert max(len(d.token_ids) for d in deltas) > 1


def test_low_acceptance_switches_a_request_off(spec_llm, plain_llm):
    # Free-form answers: n-gram drafts are mostly wrong. With disable_by_acceptance_rate 1.0 over a window of
    # one step, a request gets no more drafts after its first step with a rejected draft, so at most k of its
    # draft tokens are ever rejected; without the switch they pile up. The output stays the target's.
    prompts = [f"Tell a short story about a {w} and a {v}, in plain words." for w, v in
               zip(ITEMS, reversed(ITEMS))][:4]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    k = NGRAM["num_speculative_tokens"]
    switched = LLM(kv_cache_memory_bytes=KV_BYTES, max_num_batched_tokens=512, max_num_seqs=64,
                   speculative_config={**NGRAM, "disable_by_acceptance_rate": 1.0, "acceptance_window": 1})

    def rejected_tokens(llm):
        spec = llm.llm_engine.core.stats.spec
        before = spec.num_draft_tokens - spec.num_accepted_tokens
        outputs = llm.generate(prompts, params, use_tqdm=False)
        return spec.num_draft_tokens - spec.num_accepted_tokens - before, [o.outputs[0].token_ids for o in outputs]

    rejected_on, tokens_on = rejected_tokens(switched)
    rejected_off, tokens_off = rejected_tokens(spec_llm)
    plain = [o.outputs[0].token_ids for o in plain_llm.generate(prompts, params, use_tqdm=False)]
    assert tokens_on == tokens_off == plain
    assert 0 < rejected_on <= k * len(prompts) < rejected_off
    # Finished requests are forgotten when the next plan carries their ids.
    switched.generate(["Hi"], SamplingParams(max_tokens=1), use_tqdm=False)
    assert not switched.llm_engine.core.executor.worker.acceptance.disabled
