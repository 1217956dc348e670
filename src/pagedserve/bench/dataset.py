"""Benchmark workloads: random word prompts, a JSONL file, or a ShareGPT conversations file.

The client talks to servers whose tokenizer it does not know, so lengths are in words chosen to be one token
each: every word below encodes to a single token (with its leading space) in SmolLM2's, GPT-2's and Llama's
BPE vocabularies, so a random prompt of N words is about N prompt tokens. The server's own count (the
`usage` chunk) is what the report uses whenever the server sends one.
"""
from __future__ import annotations

import json
import math
import random

from pagedserve.bench import workloads
from pagedserve.bench.words import CHARS_PER_TOKEN, WORDS, BenchRequest, DatasetError, random_words  # noqa: F401

def parse_range(text: str) -> tuple[int, int]:
    # "128" -> (128, 128); "64-256" or "64:256" -> (64, 256), both ends inclusive.
    parts = text.replace(":", "-").split("-")
    try:
        lo, hi = (int(parts[0]), int(parts[-1])) if len(parts) <= 2 else (None, None)
    except ValueError:
        lo = hi = None
    if lo is None or hi is None or lo < 0 or hi < lo:
        raise ValueError(f"expected a length N or a range LO-HI with 0 <= LO <= HI, got {text!r}")
    return lo, hi


def random_requests(num_prompts: int, input_len: tuple[int, int], output_len: tuple[int, int],
                    shared_prefix_len: int = 0, seed: int = 0, variant: int = 0) -> list[BenchRequest]:
    # Seeded RNGs make the workload identical for every endpoint. Lengths depend on the seed only; the words
    # also depend on `variant`, so each point of a sweep sends fresh prompts of the same lengths and a server
    # with a prefix cache cannot answer a later point from blocks cached during an earlier one. The shared
    # prefix (a long system prompt) is the same everywhere and comes first, so it can be cached; each
    # request's own words follow, so requests never share more than the prefix by accident.
    lengths = random.Random(seed)
    words = random.Random(f"words/{seed}/{variant}")
    prefix = random_words(random.Random(f"prefix/{seed}"), shared_prefix_len)
    reqs = []
    for _ in range(num_prompts):
        n_in = max(lengths.randint(*input_len), 1 if not prefix else 0)
        n_out = max(lengths.randint(*output_len), 1)
        own = random_words(words, n_in)
        prompt = f"{prefix} {own}".strip() if prefix else own
        reqs.append(BenchRequest(prompt, shared_prefix_len + n_in, n_out))
    return reqs


def _load_json(path: str):
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except OSError as e:
        raise DatasetError(f"cannot read dataset {path}: {e.strerror or e}") from e
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise DatasetError(f"{path} is not valid JSON: {e}") from e


def load_jsonl(path: str, output_len: tuple[int, int], seed: int = 0) -> list[BenchRequest]:
    # One object per line: {"prompt": str, "output_len": int (optional; else drawn from --output-len)}.
    rng = random.Random(seed)
    reqs = []
    try:
        with open(path, encoding="utf-8") as f:
            lines = f.readlines()
    except OSError as e:
        raise DatasetError(f"cannot read dataset {path}: {e.strerror or e}") from e
    except UnicodeDecodeError as e:
        raise DatasetError(f"{path} is not UTF-8 text: {e}") from e
    for lineno, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise DatasetError(f"{path}:{lineno}: not valid JSON ({e.msg}); expected one "
                               '{"prompt": "...", "output_len": N} object per line') from e
        prompt = obj.get("prompt") if isinstance(obj, dict) else None
        if not isinstance(prompt, str) or not prompt:
            raise DatasetError(f"{path}:{lineno}: expected a non-empty string field 'prompt'")
        n_out = obj.get("output_len")
        if n_out is None:
            n_out = rng.randint(*output_len)
        elif not isinstance(n_out, int) or isinstance(n_out, bool) or n_out < 1:
            raise DatasetError(f"{path}:{lineno}: 'output_len' must be a positive integer, got {n_out!r}")
        reqs.append(BenchRequest(prompt, len(prompt.split()), max(n_out, 1)))
    if not reqs:
        raise DatasetError(f"{path} holds no prompts")
    return reqs


def load_sharegpt(path: str, output_len: tuple[int, int] | None, seed: int = 0) -> list[BenchRequest]:
    # [{"conversations": [{"from": "human", "value": ...}, {"from": "gpt", "value": ...}, ...]}, ...]: the
    # first turn is the prompt, the reply's length (or --output-len when given) the output length, as in
    # vLLM's benchmark. Conversations with fewer than two turns are skipped.
    data = _load_json(path)
    if not isinstance(data, list):
        raise DatasetError(f"{path}: expected a JSON list of ShareGPT conversations")
    rng = random.Random(seed)
    reqs = []
    for i, conv in enumerate(data):
        turns = conv.get("conversations") if isinstance(conv, dict) else None
        if not isinstance(turns, list):
            raise DatasetError(f"{path}: entry {i} has no 'conversations' list")
        if len(turns) < 2:
            continue
        if not all(isinstance(t, dict) and isinstance(t.get("value"), str) for t in turns[:2]):
            raise DatasetError(f"{path}: entry {i}: each turn needs a string 'value'")
        prompt, reply = turns[0]["value"], turns[1]["value"]
        if not prompt.strip():
            continue
        n_out = rng.randint(*output_len) if output_len else max(math.ceil(len(reply) / CHARS_PER_TOKEN), 1)
        reqs.append(BenchRequest(prompt, len(prompt.split()), n_out))
    if not reqs:
        raise DatasetError(f"{path} holds no conversation with at least two turns")
    rng.shuffle(reqs)
    return reqs


def load_dataset(name: str, num_prompts: int | None, input_len: tuple[int, int], output_len: tuple[int, int],
                 shared_prefix_len: int = 0, seed: int = 0, output_len_given: bool = False,
                 variant: int = 0, num_prefixes: int = 10, num_turns: int = 1) -> list[BenchRequest]:
    if name == "random":
        return random_requests(num_prompts or 100, input_len, output_len, shared_prefix_len, seed, variant)
    prefix_len = shared_prefix_len or workloads.DEFAULT_PREFIX_LEN
    if name == "prefix_repetition":
        return workloads.prefix_repetition(num_prompts or 100, prefix_len, input_len, output_len, num_prefixes,
                                           seed, variant)
    if name == "generated-shared-prefix":
        return workloads.generated_shared_prefix(num_prompts or 100, prefix_len, input_len, output_len,
                                                 num_prefixes, num_turns, seed, variant)
    if name.endswith(".jsonl"):
        reqs = load_jsonl(name, output_len, seed)
    elif name.endswith(".json"):
        reqs = load_sharegpt(name, output_len if output_len_given else None, seed)
    else:
        raise DatasetError(f"unknown dataset {name!r}: use 'random', 'prefix_repetition', 'generated-shared-prefix', "
                           "a .jsonl file of prompts or a ShareGPT .json")
    if shared_prefix_len:
        prefix = random_words(random.Random(f"prefix/{seed}"), shared_prefix_len)
        reqs = [BenchRequest(f"{prefix} {r.prompt}", r.prompt_len + shared_prefix_len, r.output_len) for r in reqs]
    # Files are not repeated to reach --num-prompts: repeats would hit a prefix cache and flatter it.
    return reqs[:num_prompts] if num_prompts else reqs
