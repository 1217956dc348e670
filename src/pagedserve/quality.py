"""Accuracy of a numeric mode, measured: teacher-forced logits of a text through the paged forward, then
perplexity and the mean KL divergence from a reference mode's logits (benchmarks/quality.py, the dtype and
KV-dtype tests).

The text goes through the model in chunks, as chunked prefill runs it, so every chunk after the first reads
the earlier tokens' K/V back from the cache: a KV cache dtype that loses precision shows in the result.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from pagedserve.attention.metadata import AttentionMetadata


@dataclass(frozen=True, slots=True)
class Quality:
    num_tokens: int       # predicted tokens (the text's length - 1)
    perplexity: float
    mean_kl: float | None  # KL(reference || this mode) per token, in nats; None without a reference
    top1_agreement: float | None  # fraction of positions whose argmax equals the reference's


def teacher_forced_logits(model, token_ids: list[int], kv_caches: list[torch.Tensor], block_size: int,
                          chunk: int = 128) -> torch.Tensor:
    # [len(token_ids), vocab] float32 logits; the caches must hold len(token_ids) tokens in blocks 0, 1, ...
    ids = torch.tensor(token_ids, dtype=torch.int64, device=kv_caches[0].device)
    return torch.cat([_forward(model, ids[start:start + chunk], start, kv_caches, block_size)
                      for start in range(0, len(token_ids), chunk)])


def greedy_continuation(model, token_ids: list[int], kv_caches: list[torch.Tensor], block_size: int,
                        max_tokens: int, chunk: int = 512) -> list[int]:
    # Prefill in chunks, then `max_tokens` greedy decode steps, each reading the whole context from the cache.
    ids = torch.tensor(token_ids, dtype=torch.int64, device=kv_caches[0].device)
    for start in range(0, len(token_ids), chunk):  # logits of the last position only: the LM head is costly
        logits = _forward(model, ids[start:start + chunk], start, kv_caches, block_size, last_only=True)[-1]
    out: list[int] = []
    for _ in range(max_tokens):
        out.append(int(logits.argmax()))
        ids = torch.tensor(out[-1:], dtype=torch.int64, device=kv_caches[0].device)
        logits = _forward(model, ids, len(token_ids) + len(out) - 1, kv_caches, block_size, last_only=True)[-1]
    return out


def _forward(model, ids: torch.Tensor, start: int, kv_caches: list[torch.Tensor], block_size: int,
             last_only: bool = False) -> torch.Tensor:
    # One sequence's tokens start .. start + len(ids) - 1 through the model, its blocks 0, 1, ... in order.
    device, end = ids.device, start + len(ids)
    table = torch.arange(-(-end // block_size), dtype=torch.int64, device=device)[None, :]
    pos = torch.arange(start, end, dtype=torch.int64, device=device)
    meta = AttentionMetadata(slot_mapping=pos, block_tables=table, seq_lens=torch.tensor([end], device=device),
                             query_start_loc=torch.tensor([0, end - start], device=device),
                             seq_lens_list=[end], query_lens_list=[end - start], block_size=block_size)
    with torch.inference_mode():
        hidden = model.forward(ids, pos, kv_caches, meta)
        return model.compute_logits(hidden[-1:] if last_only else hidden).float()


def score(logits: torch.Tensor, token_ids: list[int], reference: torch.Tensor | None = None) -> Quality:
    # Position t predicts token t + 1.
    targets = torch.tensor(token_ids[1:], dtype=torch.int64, device=logits.device)
    logp = logits[:-1].float().log_softmax(-1)
    nll = -logp.gather(1, targets[:, None]).mean().item()
    if reference is None:
        return Quality(len(targets), float(torch.tensor(nll).exp()), None, None)
    ref_logp = reference[:-1].float().log_softmax(-1)
    kl = (ref_logp.exp() * (ref_logp - logp)).sum(-1).mean().item()
    agree = (ref_logp.argmax(-1) == logp.argmax(-1)).float().mean().item()
    return Quality(len(targets), float(torch.tensor(nll).exp()), kl, agree)
