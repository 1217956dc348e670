"""--batch-invariant end to end (docs/batch_invariance.md): a greedy request gives exactly the tokens it gives
alone when it runs inside a batch of 15 other requests, from the prefix cache, through prefill chunks of a few
tokens, with n-gram speculation verifying k + 1 tokens per step, and streamed or not over HTTP; in float32 and
bfloat16, on a tiny dense model (fixed-block dense GEMMs) and on the embedded GGUF model (one block kernel at
every row count). The same comparisons with the mode off differ in bf16 (see the docs page)."""
from __future__ import annotations

import random
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest
import transformers

from pagedserve import LLM, SamplingParams
from tests.tiny_models import random_hf_model, save_hf_dir

# Repetitive probes, so that n-gram lookup drafts tokens for them; 17-23 tokens: one cached block of 16.
PROBES = ["one two three four five one two three four five one two three four five one two",
          "The cat sat on the mat. The cat sat on the mat. The cat sat on the",
          "def add(a, b):\n    return a + b\n\ndef add(a, b):\n    return",
          "red green blue yellow, red green blue yellow, red green blue yellow, red green"]
WORDS = ["apple", "river", "stone", "cloud", "lamp", "tiger", "paper", "glass", "seven", "north"]
OTHERS = [" ".join(random.Random(i).choices(WORDS, k=8 + 3 * i)) for i in range(15)]
# The tiny model's prompts are token ids below its 128-token vocabulary: its random greedy tokens then recur in
# the context often enough for n-gram lookup to draft.
TINY_VOCAB = 128
TINY_PROBES = [[(7 * i + j) % 23 + 40 * (j % 3) for i in range(n)] for j, n in enumerate((17, 19, 23, 17))]
TINY_OTHERS = [random.Random(i).choices(range(TINY_VOCAB), k=8 + 3 * i) for i in range(15)]
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3,
         "disable_by_batch_size": None}
ENGINE = dict(kv_cache_memory_bytes=96 << 20, max_num_seqs=16, num_threads=1)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> str:
    # head_dim 64 (the AVX-512 attention path) and a 1,536-wide MLP (torch's GEMM blocks that K by the rows)
    from pagedserve.model.loader import resolve_model_dir

    tokenizer = transformers.AutoTokenizer.from_pretrained(resolve_model_dir(None)[0])
    config = transformers.LlamaConfig(hidden_size=256, intermediate_size=1536, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, vocab_size=TINY_VOCAB,
                                      max_position_embeddings=2048)
    return save_hf_dir(random_hf_model(config, scale=0.15), tokenizer, tmp_path_factory.mktemp("inv") / "tiny")


def generate(llm: LLM, prompts: list, max_tokens: int):
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    prompts = [p if isinstance(p, str) else {"prompt_token_ids": p} for p in prompts]
    return llm.generate(prompts, params, use_tqdm=False)


def token_ids(outputs) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in outputs]


def check_invariant(model: str | None, dtype: str, max_tokens: int, probes: list, others: list,
                    invariant: bool = True) -> None:
    engine = dict(ENGINE, dtype=dtype, batch_invariant=invariant)
    llm = LLM(model=model, **engine)
    alone = [token_ids(generate(llm, [p], max_tokens))[0] for p in probes]
    batched = token_ids(generate(llm, probes + others, max_tokens))[:len(probes)]
    again = [generate(llm, [p], max_tokens)[0] for p in probes]
    assert all(o.num_cached_tokens for o in again)  # their prompts' full blocks came from the prefix cache
    del llm
    # prefill in chunks of at most 5 tokens, beside 3 other requests
    llm = LLM(model=model, max_num_batched_tokens=5, **engine)
    chunked = token_ids(generate(llm, probes + others[:3], max_tokens))[:len(probes)]
    del llm
    # 3 n-gram draft tokens verified per step (k + 1 rows through every layer), beside 3 other requests
    llm = LLM(model=model, speculative_config=NGRAM, **engine)
    speculated = token_ids(generate(llm, probes + others[:3], max_tokens))[:len(probes)]
    assert llm.llm_engine.core.stats.spec.num_draft_tokens > 0
    for name, got in (("batched", batched), ("cached", token_ids(again)), ("chunked", chunked),
                      ("ngram", speculated)):
        assert got == alone, (name, dtype, [i for i, (a, b) in enumerate(zip(got, alone)) if a != b])


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_tiny_dense_model(tiny_dir: str, dtype: str) -> None:
    check_invariant(tiny_dir, dtype, 12, TINY_PROBES, TINY_OTHERS)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_embedded_gguf_model(dtype: str) -> None:
    check_invariant(None, dtype, 8, PROBES, OTHERS)


def test_http_streamed_equals_non_streamed(tiny_dir: str) -> None:
    # bf16 server: each probe non-streamed alone, then streamed while 15 other requests run, then non-streamed
    # again with its prompt cached.
    from tests.server.helpers import ServerProcess

    srv = ServerProcess("--model", tiny_dir, "--dtype", "bfloat16", "--batch-invariant", "--served-model-name", "t")
    try:
        client = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="unused", max_retries=0, timeout=120)

        def complete(prompt: list[int], stream: bool) -> str:
            kwargs = dict(model="t", prompt=prompt, max_tokens=16, temperature=0.0, extra_body={"ignore_eos": True})
            if not stream:
                return client.completions.create(**kwargs).choices[0].text
            return "".join(c.choices[0].text for c in client.completions.create(stream=True, **kwargs) if c.choices)

        for probe in TINY_PROBES:
            alone = complete(probe, stream=False)
            with ThreadPoolExecutor(16) as pool:
                others = [pool.submit(complete, p, False) for p in TINY_OTHERS]
                streamed = pool.submit(complete, probe, True).result()
                [f.result() for f in others]
            assert streamed == alone, probe
            assert complete(probe, stream=False) == alone, probe
    finally:
        srv.close()
