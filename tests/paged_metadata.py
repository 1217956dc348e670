"""Test helpers: AttentionMetadata for hand-made batches, and scattered block tables.

A batch is a list of (context_len, query_len) per sequence: context_len tokens are already in the cache
from earlier calls, query_len new tokens run now. Reused by attention, model and runner tests.
"""
from __future__ import annotations

import random

import torch

from pagedserve.attention.metadata import AttentionMetadata


def build_attention_metadata(seqs: list[tuple[int, int]], block_tables: list[list[int]], block_size: int,
                             device: str | torch.device = "cpu") -> AttentionMetadata:
    assert len(seqs) == len(block_tables)
    slots: list[int] = []
    for (context_len, query_len), table in zip(seqs, block_tables):
        end = context_len + query_len
        assert len(table) * block_size >= end, "block table too short for the sequence"
        slots.extend(table[p // block_size] * block_size + p % block_size for p in range(context_len, end))
    width = max(len(t) for t in block_tables)
    padded = [t + [0] * (width - len(t)) for t in block_tables]
    query_lens = [q for _, q in seqs]
    seq_lens = [c + q for c, q in seqs]
    starts = [0]
    for q in query_lens:
        starts.append(starts[-1] + q)
    as_tensor = lambda x: torch.tensor(x, dtype=torch.int64, device=device)  # noqa: E731
    return AttentionMetadata(slot_mapping=as_tensor(slots), block_tables=as_tensor(padded),
                             seq_lens=as_tensor(seq_lens), query_start_loc=as_tensor(starts),
                             seq_lens_list=seq_lens, query_lens_list=query_lens, block_size=block_size)


def scattered_block_tables(seq_lens: list[int], block_size: int, num_blocks: int, seed: int = 0) -> list[list[int]]:
    # Disjoint, shuffled, non-contiguous physical blocks, so a backend that assumes contiguity fails.
    needed = [-(-n // block_size) for n in seq_lens]
    assert sum(needed) <= num_blocks, "pool too small"
    ids = list(range(num_blocks))
    random.Random(seed).shuffle(ids)
    tables, at = [], 0
    for n in needed:
        tables.append(ids[at:at + n])
        at += n
    return tables


def chunk_schedule(chunks: list[list[int]]) -> list[list[tuple[int, int, int]]]:
    # chunks[i] = token counts sequence i runs in successive steps. Returns per step a list of
    # (seq_index, context_len, query_len); sequences with no chunk left drop out of later steps.
    steps: list[list[tuple[int, int, int]]] = []
    done = [0] * len(chunks)
    for k in range(max(len(c) for c in chunks)):
        step = []
        for i, c in enumerate(chunks):
            if k < len(c):
                step.append((i, done[i], c[k]))
                done[i] += c[k]
        steps.append(step)
    return steps


def run_paged_schedule(model, token_ids: list[list[int]], chunks: list[list[int]], block_size: int = 4,
                       num_blocks: int | None = None, seed: int = 0) -> list[torch.Tensor]:
    # Feeds each sequence's tokens through `model` (our forward/compute_logits API) following `chunks`
    # (see chunk_schedule), all sequences of a step in one flattened batch, with a fresh paged cache on
    # scattered blocks. Returns per-sequence logits for every position, [len(token_ids[i]), vocab].
    from pagedserve.worker.kv_cache import allocate_kv_caches

    assert [len(t) for t in token_ids] == [sum(c) for c in chunks]
    lens = [len(t) for t in token_ids]
    needed = sum(-(-n // block_size) for n in lens)
    num_blocks = num_blocks or 2 * needed + 3
    tables = scattered_block_tables(lens, block_size, num_blocks, seed=seed)
    param = next(model.parameters())
    caches = allocate_kv_caches(len(model.model.layers), num_blocks, block_size, model.num_kv_heads,
                                model.head_dim, param.dtype, param.device)
    logits: list[list[torch.Tensor]] = [[] for _ in token_ids]
    with torch.inference_mode():
        for step in chunk_schedule(chunks):
            meta = build_attention_metadata([(c, q) for _, c, q in step], [tables[i] for i, _, _ in step],
                                            block_size, device=param.device)
            ids = torch.tensor([t for i, c, q in step for t in token_ids[i][c:c + q]], device=param.device)
            pos = torch.tensor([p for _, c, q in step for p in range(c, c + q)], device=param.device)
            out = model.compute_logits(model.forward(ids, pos, caches, meta))
            at = 0
            for i, _, q in step:
                logits[i].append(out[at:at + q])
                at += q
    return [torch.cat(chunk) for chunk in logits]
