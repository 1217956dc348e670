"""Verify draft tokens against the target model so the output distribution stays exactly the target's.

A request with k drafts d1..dk has k + 1 target rows: row i (0-based) is the target distribution p_i of the
token after d1..di, computed in one forward pass. Leviathan et al. (2023), per row i < k in order:

    accept d_{i+1} with probability min(1, p_i(d) / q_i(d))        q_i: the draft's distribution
    on the first rejection emit a token from normalize(max(0, p_i - q_i)) and stop;
    if every draft is accepted, emit a bonus token from p_k.

An n-gram draft is one-hot (q_i(d) = 1), so acceptance is p_i(d) and the residual is p_i with d removed.
Greedy rows accept while the draft equals the argmax and then emit the argmax, so their output is token for
token the one without speculation (up to batched-verify numerics).

Each row's target is the sampler's own: the same logits processors (penalties and min_tokens see the drafts
before it as output tokens), temperature, top-k, top-p and min-p. A seeded request draws its uniforms and its
final token from its own generator, so its tokens do not depend on its batch mates.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from pagedserve.sample.sampler import (SamplingBatch, apply_logits_processors, compute_logprobs, draw,
                                       random_probs)


@dataclass(slots=True)
class VerifiedTokens:
    # Per request: the accepted drafts, then the one token sampled after them (recovered or bonus).
    accepted_token_ids: list[list[int]]
    sampled_token_ids: list[int]
    # Of every emitted token (accepted ones, then the sampled one), per request; None when none asked.
    logprobs: list[list[float]] | None = None
    ranks: list[list[int]] | None = None
    top_logprobs: list[list[list[tuple[int, float]]]] | None = None


def _uniforms(num_drafts: list[int], generators: list[torch.Generator | None], dtype: torch.dtype,
              device: torch.device) -> torch.Tensor:
    total = sum(num_drafts)
    if generators and all(g is generators[0] for g in generators):
        return torch.rand(total, generator=generators[0], dtype=dtype, device=device)
    parts = [torch.rand(k, generator=g, dtype=dtype, device=device) for k, g in zip(num_drafts, generators)]
    return torch.cat(parts) if parts else torch.empty(0, dtype=dtype, device=device)


def verify_drafts(probs: torch.Tensor, draft_token_ids: list[list[int]], is_greedy: list[bool],
                  generators: list[torch.Generator | None], draft_probs: torch.Tensor | None = None
                  ) -> tuple[list[int], torch.Tensor]:
    """Returns, per request, how many drafts it accepts, and the row index and token sampled after them.

    probs: [sum(k_i + 1), V] target rows, request after request (for greedy requests only the argmax
    matters; any scores will do). draft_probs: the draft's distributions at the k_i draft rows of each
    request, [sum(k_i), V]; None for one-hot drafts. generators: one per request.
    """
    device = probs.device
    # Acceptance compares p(d) with q(d) and the residual subtracts them: both in at least float32 whatever
    # the model's dtype, or a draft equal to the target would be rejected by the rounding of a bf16 q alone.
    dtype = torch.promote_types(probs.dtype, torch.float32)
    probs = probs.to(dtype)
    if draft_probs is not None:
        draft_probs = draft_probs.to(dtype)
    num_drafts = [len(d) for d in draft_token_ids]
    starts = [0]
    for k in num_drafts:
        starts.append(starts[-1] + k + 1)
    draft_rows = torch.tensor([starts[i] + j for i, k in enumerate(num_drafts) for j in range(k)],
                              dtype=torch.long, device=device)
    draft_ids = torch.tensor([t for d in draft_token_ids for t in d], dtype=torch.long, device=device)
    argmax = probs.argmax(dim=-1)
    greedy_rows = torch.tensor([g for g, k in zip(is_greedy, num_drafts) for _ in range(k)], dtype=torch.bool,
                               device=device)
    accept = argmax[draft_rows] == draft_ids
    all_greedy = all(is_greedy)
    if not all_greedy:
        # Rows are normalized here: min-p leaves its masked rows unnormalized.
        norm = probs / probs.sum(dim=-1, keepdim=True)
        p_draft = norm[draft_rows, draft_ids]
        u = _uniforms(num_drafts, generators, probs.dtype, device)
        if draft_probs is not None:
            q = draft_probs / draft_probs.sum(dim=-1, keepdim=True)
            u = u * q.gather(1, draft_ids.unsqueeze(1)).squeeze(1)
        accept = torch.where(greedy_rows, accept, u < p_draft)
    accept = accept.tolist()

    num_accepted: list[int] = []
    pos = 0
    for k in num_drafts:
        a = 0
        while a < k and accept[pos + a]:
            a += 1
        num_accepted.append(a)
        pos += k
    final_rows = torch.tensor([s + a for s, a in zip(starts, num_accepted)], dtype=torch.long, device=device)
    final = argmax[final_rows]
    if not all_greedy:
        residual = norm[final_rows].clone()
        rejected = [i for i, (a, k) in enumerate(zip(num_accepted, num_drafts)) if a < k]
        if rejected:
            # The residual max(0, p - q) at the rejected position; for a one-hot q, p without the draft.
            flat = [starts[i] - i + num_accepted[i] for i in rejected]  # index among the draft rows
            idx = torch.tensor(rejected, dtype=torch.long, device=device)
            flat_t = torch.tensor(flat, dtype=torch.long, device=device)
            if draft_probs is None:
                residual[idx, draft_ids[flat_t]] = 0.0
            else:
                residual[idx] = (residual[idx] - q[flat_t]).clamp_(min=0.0)
            # Float rounding can leave nothing (p == q up to an ulp): then p itself is the distribution.
            empty = residual.sum(dim=-1) <= 0
            residual[empty] = norm[final_rows][empty]
        sampled = draw(residual, generators)
        final = torch.where(torch.tensor(is_greedy, dtype=torch.bool, device=device), final, sampled)
    return num_accepted, final


def rejection_sample(logits: torch.Tensor, batch: SamplingBatch, draft_token_ids: list[list[int]],
                     request_generators: list[torch.Generator | None],
                     draft_probs: torch.Tensor | None = None) -> VerifiedTokens:
    """logits: [sum(k_i + 1), V] raw target logits; batch: one SamplingRow per logits row, each built with
    the drafts before it as output tokens. request_generators: one per request."""
    raw_logprobs = logits.float().log_softmax(dim=-1) if batch.max_num_logprobs is not None else None
    processed = apply_logits_processors(logits, batch)
    num_drafts = [len(d) for d in draft_token_ids]
    starts = np.cumsum([0] + [k + 1 for k in num_drafts[:-1]]).tolist()
    is_greedy = [batch.all_greedy or (batch.is_greedy is not None and bool(batch.is_greedy[s]))
                 for s in starts]
    probs = processed if all(is_greedy) else random_probs(processed, batch)
    num_accepted, final = verify_drafts(probs, draft_token_ids, is_greedy, request_generators, draft_probs)
    final_ids = final.tolist()
    accepted = [d[:a] for d, a in zip(draft_token_ids, num_accepted)]
    out = VerifiedTokens(accepted, final_ids)
    if raw_logprobs is not None:
        rows = [s + i for s, a in zip(starts, num_accepted) for i in range(a + 1)]
        emitted = [t for acc, f in zip(accepted, final_ids) for t in acc + [f]]
        num_top = [batch.num_logprobs[r] for r in rows]
        lp, ranks, top = compute_logprobs(raw_logprobs[torch.tensor(rows, device=logits.device)],
                                          torch.tensor(emitted, device=logits.device), num_top)
        out.logprobs, out.ranks, out.top_logprobs = [], [], []
        pos = 0
        for a in num_accepted:
            out.logprobs.append(lp[pos:pos + a + 1])
            out.ranks.append(ranks[pos:pos + a + 1])
            out.top_logprobs.append(top[pos:pos + a + 1])
            pos += a + 1
    return out
