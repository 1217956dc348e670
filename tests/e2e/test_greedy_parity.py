"""The embedded model's greedy tokens equal transformers' generate, for a mixed batch run together."""
from __future__ import annotations

import torch

from pagedserve import SamplingParams

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village by the sea, there lived an old fisherman who",
    "1, 2, 3, 4,",
    "Translate to French: I like green apples.",
    "Q: What is the boiling point of water at sea level?\nA:",
    "The three primary colors are",
    ("In a recent study of distributed systems, researchers compared consensus protocols under network "
     "partitions, measuring latency, throughput and availability across many clusters. They found that"),
]
MAX_TOKENS = 48


def hf_greedy(model, tokenizer, prompt: str) -> list[int]:
    ids = tokenizer(prompt, return_tensors="pt").input_ids
    with torch.inference_mode():
        out = model.generate(ids, max_new_tokens=MAX_TOKENS, do_sample=False,
                             eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.eos_token_id)
    return out[0, ids.shape[1]:].tolist()


def test_batched_greedy_matches_transformers(llm, hf_smol):
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS), use_tqdm=False)
    tok = llm.get_tokenizer()
    for prompt, out in zip(PROMPTS, outs):
        assert out.prompt_token_ids == tok(prompt).input_ids
        expected = hf_greedy(hf_smol, tok, prompt)
        assert out.outputs[0].token_ids == expected, prompt
        assert out.outputs[0].text == tok.decode(expected, skip_special_tokens=True)
