"""cache_salt offline: prompts with different salts never hit each other's prefix-cache blocks."""
from __future__ import annotations

import random

import pytest

from pagedserve import SamplingParams
from pagedserve.sampling_params import BeamSearchParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)


def unique_prompt(seed: int) -> list[int]:
    # 40 plain-text token ids seen by no other test: 2 full blocks of 16 can be cached.
    rng = random.Random(f"cache-salt-{seed}")
    return [rng.randint(300, 20000) for _ in range(40)]


def cached_tokens(llm, prompt: dict) -> tuple[int, list[int]]:
    [out] = llm.generate(prompt, GREEDY, use_tqdm=False)
    return out.num_cached_tokens, out.outputs[0].token_ids


def test_salts_isolate_token_prompts(llm):
    ids = unique_prompt(1)
    first, tokens_a = cached_tokens(llm, {"prompt_token_ids": ids, "cache_salt": "alice"})
    assert first == 0
    other, tokens_b = cached_tokens(llm, {"prompt_token_ids": ids, "cache_salt": "bob"})
    assert other == 0                                   # another tenant's prefix is invisible
    assert cached_tokens(llm, {"prompt_token_ids": ids})[0] == 0
    assert cached_tokens(llm, {"prompt_token_ids": ids, "cache_salt": "alice"})[0] == 32
    assert cached_tokens(llm, {"prompt_token_ids": ids})[0] == 32   # unsalted requests share among themselves
    assert tokens_a == tokens_b                         # the salt changes caching, never the output


def test_salts_isolate_text_prompts(llm):
    text = " ".join(f"w{i}" for i in range(30)) + " cache salt text prompt"
    assert cached_tokens(llm, {"prompt": text, "cache_salt": "t1"})[0] == 0
    assert cached_tokens(llm, {"prompt": text, "cache_salt": "t2"})[0] == 0
    assert cached_tokens(llm, {"prompt": text, "cache_salt": "t1"})[0] >= 16


def test_beam_search_keeps_the_salt(llm):
    ids = unique_prompt(2)
    llm.beam_search({"prompt_token_ids": ids, "cache_salt": "beam"},
                    BeamSearchParams(beam_width=2, max_tokens=2, ignore_eos=True))
    assert cached_tokens(llm, {"prompt_token_ids": ids})[0] == 0
    assert cached_tokens(llm, {"prompt_token_ids": ids, "cache_salt": "beam"})[0] == 32


@pytest.mark.parametrize("salt", ["", 7])
def test_bad_salt_is_refused(llm, salt):
    with pytest.raises(ValueError, match="cache_salt"):
        llm.generate({"prompt_token_ids": [300, 301], "cache_salt": salt}, GREEDY, use_tqdm=False)
