"""Start-up warm-up: a few requests through the whole path before a server takes any (`--warmup`, default on).

Without it resident memory grew by a one-time ~48 MB during the first ~100 requests (benchmarks/memory_soak.py:
RssAnon +29 MB, RssFile +19 MB): oneDNN's kernels and caches, the allocator's arenas, library code paged in as it
first runs, xgrammar's tokenizer tables and the chat template. A pod's memory request sized from the start-up
line was then short by that much. These requests run the shapes a server uses (a prefill chunk, a decode batch
of several rows with sampling and logprobs, a chat, a JSON schema) before the start-up memory line is printed
and before the server listens, so /ready stays unanswered until they end.

What they leave is cleared (EngineCore.clear_warmup): their blocks leave the prefix cache and their tokens and
requests the counters, so /metrics and /debug/kv start from zero as they would without warm-up. With KV events
on, subscribers see the blocks stored, then AllBlocksCleared; a disk tier keeps the blocks it wrote (a few, evicted
like any others).
"""
from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from pagedserve.engine.processor import ChatPrompt
from pagedserve.sampling_params import SamplingParams, StructuredOutputsParams

logger = logging.getLogger(__name__)

# The long prompt takes the tile / oneDNN path of a prefill chunk; 512 tokens is the adaptive token budget's
# floor (core/token_budget.py), so every server runs chunks at least this long.
PREFILL_TOKENS = 512
NUM_DECODE_PROMPTS = 8  # decode rows 5-31 take the batched GEMM kernels, 1-4 the vector ones
OUTPUT_TOKENS = 4
SCHEMA = {"type": "object", "properties": {"answer": {"type": "string", "enum": ["yes", "no"]},
                                           "count": {"type": "integer"}}, "required": ["answer"]}


def warmup_requests(vocab_size: int, max_model_len: int) -> list[list[tuple[str, Any, SamplingParams]]]:
    """The warm-up's client requests, each a list of (request id, prompt, params)."""
    greedy = SamplingParams(max_tokens=OUTPUT_TOKENS, temperature=0.0, ignore_eos=True)
    sampled = SamplingParams(max_tokens=OUTPUT_TOKENS, temperature=0.8, top_p=0.9, seed=0, logprobs=2,
                             ignore_eos=True)
    num_prompt = max(1, min(PREFILL_TOKENS, max_model_len - OUTPUT_TOKENS - 1))
    long_prompt = [(7 + 13 * i) % vocab_size for i in range(num_prompt)]  # token ids: no tokenizer assumptions
    words = "the server warms up before it takes requests".split()
    short = [" ".join(words[i % len(words):] + words[:i % len(words)]) for i in range(NUM_DECODE_PROMPTS)]
    chat = ChatPrompt([{"role": "user", "content": "Hello, how are you?"}])
    schema = SamplingParams(max_tokens=2 * OUTPUT_TOKENS, temperature=0.0,
                            structured_outputs=StructuredOutputsParams(json=SCHEMA))
    return [[("warmup-prefill", long_prompt, greedy)],
            [(f"warmup-decode-{i}", p, sampled) for i, p in enumerate(short)],
            [("warmup-chat", chat, greedy)],
            [("warmup-schema", chat, schema)]]


async def _run(engine: Any) -> tuple[int, list[str]]:
    async def one(requests: list[tuple[str, Any, SamplingParams]]) -> str | None:
        try:
            stream = await engine.add_requests(requests)
            async for _ in stream:
                pass
            return None
        except Exception as exc:  # noqa: BLE001 (reported; a server without a chat template still starts)
            return f"{requests[0][0]}: {exc}"

    reqs = warmup_requests(engine.processor.vocab_size, engine.max_model_len)
    errors = [e for e in await asyncio.gather(*(one(r) for r in reqs)) if e is not None]
    try:
        await engine.clear_warmup()
    except Exception as exc:  # noqa: BLE001 (its blocks stay cached and its counts counted; serving works)
        errors.append(f"clearing what it left: {exc}")
    return sum(len(r) for r in reqs), errors


def warm_up(engine: Any) -> float:
    """Runs the warm-up requests on an AsyncLLMEngine that serves nothing yet; returns the seconds taken."""
    t0 = time.perf_counter()
    num_requests, errors = asyncio.run(_run(engine))
    seconds = time.perf_counter() - t0
    for error in errors:
        logger.warning("warm-up failed (the server starts anyway): %s", error)
    logger.info("warm-up: %d requests in %.1fs (--no-warmup skips it)", num_requests, seconds)
    return seconds
