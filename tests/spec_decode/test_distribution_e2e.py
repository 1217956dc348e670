"""End to end on a tiny random model: with n-gram drafts, sampled tokens follow the target distribution,
computed independently by transformers in fp64."""
from __future__ import annotations

import torch
import transformers

from pagedserve import LLM, SamplingParams
from tests.spec_decode.test_rejection_sampler import chi_square_p
from tests.tiny_models import random_hf_model, save_hf_dir

ALLOWED = [1000 + 7 * i for i in range(6)]
NUM_SAMPLES = 2000


def test_sampled_tokens_follow_the_target_with_drafts(embedded_model, tmp_path, monkeypatch):
    monkeypatch.setenv("PAGEDSERVE_CACHE_DIR", str(tmp_path / "cache"))
    tokenizer = embedded_model.tokenizer
    config = transformers.LlamaConfig(hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                                      num_attention_heads=2, num_key_value_heads=1, vocab_size=1100,
                                      max_position_embeddings=64, tie_word_embeddings=True)
    hf = random_hf_model(config, scale=0.3)
    model_dir = save_hf_dir(hf, tokenizer, tmp_path / "tiny-llama")
    # A small vocabulary (ids the tokenizer knows) keeps the 2000 samples fast.
    # The prompt cycles through the allowed tokens, so after any first token t the n-gram lookup drafts the
    # tokens that followed t in the prompt: the second token is always a verified (or recovered) one.
    prompt = ALLOWED + ALLOWED[:1]
    llm = LLM(model=model_dir, kv_cache_memory_bytes=4 << 20, max_num_seqs=256, max_num_batched_tokens=4096,
              speculative_config={"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 1,
                                  "prompt_lookup_max": 1, "disable_by_batch_size": None})
    params = SamplingParams(temperature=1.0, max_tokens=3, ignore_eos=True, allowed_token_ids=ALLOWED)
    outs = llm.generate([{"prompt_token_ids": prompt}] * NUM_SAMPLES, params, use_tqdm=False)
    spec = llm.llm_engine.core.stats.spec
    assert spec.num_drafts >= NUM_SAMPLES and 0 < spec.num_accepted_tokens < spec.num_draft_tokens

    # The exact target in fp64: p(t1 | prompt) and p(t2 | prompt, t1) over the allowed tokens.
    hf = hf.double()
    allowed = torch.tensor(ALLOWED)
    with torch.no_grad():
        first = hf(torch.tensor([prompt])).logits[:, -1]
        second = hf(torch.tensor([prompt + [t] for t in ALLOWED])).logits[:, -1]
        logits = torch.cat([first, second])[:, allowed]
    probs = logits.softmax(dim=-1)
    joint = (probs[0].unsqueeze(1) * probs[1:]).flatten()   # cell (i, j): t1 = ALLOWED[i], t2 = ALLOWED[j]
    index = {t: i for i, t in enumerate(ALLOWED)}
    counts = torch.zeros(len(ALLOWED) ** 2, dtype=torch.long)
    for o in outs:
        t1, t2 = o.outputs[0].token_ids[:2]
        counts[index[t1] * len(ALLOWED) + index[t2]] += 1
    # Cells expected to hold fewer than 5 samples are pooled into one, as the chi-square test needs.
    small = joint * NUM_SAMPLES < 5
    pooled_counts = torch.cat([counts[~small], counts[small].sum().view(1)])
    pooled_probs = torch.cat([joint[~small], joint[small].sum().view(1)])
    assert chi_square_p(pooled_counts, pooled_probs) > 0.01
