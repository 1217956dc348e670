"""Beam search equals transformers' num_beams search, and beams share blocks."""
from __future__ import annotations

import pytest
import torch

from pagedserve import BeamSearchParams
from pagedserve.beam_search import beam_score

PROMPTS = ["The capital of France is", "def square(x):"]
WIDTH, MAX_TOKENS = 3, 8


def test_beam_search_matches_transformers(llm, hf_smol):
    tok = llm.get_tokenizer()
    outs = llm.beam_search(PROMPTS, BeamSearchParams(beam_width=WIDTH, max_tokens=MAX_TOKENS, ignore_eos=True))
    for prompt, out in zip(PROMPTS, outs):
        ids = tok(prompt, return_tensors="pt").input_ids
        with torch.inference_mode():
            # No eos: every beam runs to max_tokens, as with ignore_eos, so both rank equal-length beams.
            ref = hf_smol.generate(ids, num_beams=WIDTH, num_return_sequences=WIDTH, max_new_tokens=MAX_TOKENS,
                                   do_sample=False, early_stopping=False, eos_token_id=None, pad_token_id=0,
                                   length_penalty=1.0, output_scores=True, return_dict_in_generate=True)
        expected = [seq.tolist() for seq in ref.sequences]
        assert [s.tokens for s in out.sequences] == expected
        assert out.sequences[0].text == tok.decode(expected[0][ids.shape[1]:], skip_special_tokens=True)
        # transformers reports cum_logprob / generated_len ** length_penalty for each returned beam (vLLM's
        # ranking divides by the whole length instead; with equal lengths the order is the same).
        for seq, hf_score in zip(out.sequences, ref.sequences_scores.tolist()):
            assert seq.cum_logprob / MAX_TOKENS == pytest.approx(hf_score, abs=1e-3)


def test_length_penalty_ranking():
    # Shorter finished beam with eos vs a longer one: the penalty decides.
    short, long_ = [1, 2, 3, 2], [1, 2, 3, 4, 5, 6]
    assert beam_score(short, -3.0, 2, 1.0) == -1.0                     # eos not counted: 3 tokens
    assert beam_score(long_, -5.0, 2, 1.0) > beam_score(short, -3.0, 2, 1.0)
    assert beam_score(long_, -5.0, 2, 0.0) < beam_score(short, -3.0, 2, 0.0)


def test_beam_search_rejects_bad_params():
    with pytest.raises(ValueError):
        BeamSearchParams(beam_width=0, max_tokens=4)
