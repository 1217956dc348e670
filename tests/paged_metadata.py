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
