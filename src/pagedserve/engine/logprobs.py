"""Logprob records in vLLM's shape: per token, {token id: Logprob(logprob, rank, decoded_token)} holding the
chosen (sampled or prompt) token plus the top-k alternatives."""
from __future__ import annotations

from typing import Any

from pagedserve.core.scheduler_output import PromptLogprobsChunk
from pagedserve.engine.detokenizer import decode_token
from pagedserve.outputs import Logprob, PromptLogprobs


class TokenTexts:
    # One token's text never depends on context, so decodes are memoized: prompt logprobs with top-k decode
    # (k + 1) tokens per prompt position, mostly the same few ids. Bounded by the vocabulary size.
    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self._texts: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        text = self._texts.get(token_id)
        if text is None:
            text = self._texts[token_id] = decode_token(self.tokenizer, token_id)
        return text


def logprob_entry(texts: TokenTexts, token_id: int, logprob: float, rank: int | None,
                  top: list[tuple[int, float]]) -> dict[int, Logprob]:
    entry = {token_id: Logprob(logprob, rank, texts(token_id))}
    for r, (t, lp) in enumerate(top):
        if t not in entry:
            entry[t] = Logprob(lp, r + 1, texts(t))
    return entry


def extend_prompt_logprobs(dest: PromptLogprobs, chunk: PromptLogprobsChunk, texts: TokenTexts) -> None:
    """Append chunk's entries to dest, which holds the entries of prompt tokens 0 .. len(dest) - 1.

    A request preempted by recompute computes its prompt again from position 0; entries already recorded are
    kept and the repeats dropped, so each prompt token has exactly one entry. Prompt-logprob requests never
    take prefix-cache hits, so chunks arrive in prompt order without gaps.
    """
    skip = len(dest) - chunk.first_index
    if skip < 0:
        raise RuntimeError(f"prompt logprobs from token {chunk.first_index} arrived with only {len(dest)} recorded")
    for i in range(skip, len(chunk.token_ids)):
        dest.append(logprob_entry(texts, chunk.token_ids[i], chunk.logprobs[i], chunk.ranks[i],
                                  chunk.top_logprobs[i]))
