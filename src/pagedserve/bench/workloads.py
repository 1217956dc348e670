"""Shared-prefix workloads: vLLM bench's `prefix_repetition` and SGLang's `generated-shared-prefix`.

Both are random words (one token each, bench/dataset.py), so lengths are about tokens on any server. The
prefixes depend on the seed only, so every sweep point sees the same system prompts (as a deployment's
would be warm); the questions take fresh words at each point (`variant`).

prefix_repetition (vLLM): `num_prefixes` prefixes of `prefix_len` words; request i is prefix i mod
num_prefixes followed by its own suffix of `input_len` words, in shuffled order.

generated-shared-prefix (SGLang's gen_shared_prefix): `num_prefixes` groups, each with its own long system
prompt; each group holds conversations of `num_turns` turns. Turn t's prompt is the system prompt, the
earlier turns (question, then an answer of that turn's output length in words standing in for the reply),
then question t: later turns extend earlier prompts, as a chat client resending its history does. All first
turns come first (groups interleaved), then all second turns, and so on.
"""
from __future__ import annotations

import random

from pagedserve.bench.words import BenchRequest, DatasetError, random_words

WORKLOADS = ("prefix_repetition", "generated-shared-prefix")
DEFAULT_PREFIX_LEN = 256


def _prefixes(num_prefixes: int, prefix_len: int, seed: int, kind: str) -> list[str]:
    if num_prefixes < 1:
        raise DatasetError(f"--num-prefixes must be >= 1, got {num_prefixes}")
    return [random_words(random.Random(f"{kind}/{seed}/{i}"), prefix_len) for i in range(num_prefixes)]


def prefix_repetition(num_prompts: int, prefix_len: int, input_len: tuple[int, int], output_len: tuple[int, int],
                      num_prefixes: int, seed: int = 0, variant: int = 0) -> list[BenchRequest]:
    prefixes = _prefixes(num_prefixes, prefix_len, seed, "prefix")
    lengths, words = random.Random(seed), random.Random(f"suffix/{seed}/{variant}")
    reqs = []
    for i in range(num_prompts):
        n_in, n_out = max(lengths.randint(*input_len), 1), max(lengths.randint(*output_len), 1)
        reqs.append(BenchRequest(f"{prefixes[i % num_prefixes]} {random_words(words, n_in)}", prefix_len + n_in,
                                 n_out))
    random.Random(f"order/{seed}").shuffle(reqs)
    return reqs


def generated_shared_prefix(num_prompts: int, prefix_len: int, input_len: tuple[int, int],
                            output_len: tuple[int, int], num_groups: int, num_turns: int = 1, seed: int = 0,
                            variant: int = 0) -> list[BenchRequest]:
    if num_turns < 1:
        raise DatasetError(f"--num-turns must be >= 1, got {num_turns}")
    systems = _prefixes(num_groups, prefix_len, seed, "system")
    lengths, words = random.Random(seed), random.Random(f"questions/{seed}/{variant}")
    num_conversations = max(1, -(-num_prompts // num_turns))
    turns: list[list[BenchRequest]] = [[] for _ in range(num_turns)]
    for c in range(num_conversations):
        history, history_len = systems[c % num_groups], prefix_len
        for t in range(num_turns):
            n_in, n_out = max(lengths.randint(*input_len), 1), max(lengths.randint(*output_len), 1)
            question = random_words(words, n_in)
            turns[t].append(BenchRequest(f"{history} {question}", history_len + n_in, n_out))
            history = f"{history} {question} {random_words(words, n_out)}"
            history_len += n_in + n_out
    return [r for turn in turns for r in turn][:num_prompts]
