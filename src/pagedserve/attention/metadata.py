"""What an attention backend sees of a step: token slots, block tables, lengths. No requests, no scheduler.

Tokens of all sequences in a step are flattened into one batch (no padding):

    query tokens:  [ seq0: q0 tokens | seq1: q1 tokens | ... ]
    query_start_loc = [0, q0, q0+q1, ...]            (num_seqs + 1)
    seq_lens[i]     = tokens of seq i in the cache after this step (context + its new tokens)

Sequence i's new tokens sit at positions seq_lens[i]-q_i .. seq_lens[i]-1 and attend causally to
everything before them in the same sequence. Token t's K/V is written to flat slot slot_mapping[t]
(block_id * block_size + offset) before attention reads it through block_tables[i].
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(slots=True)
class AttentionMetadata:
    slot_mapping: torch.Tensor     # [num_tokens] int64
    block_tables: torch.Tensor     # [num_seqs, max_blocks_per_seq] int64, padded with 0
    seq_lens: torch.Tensor         # [num_seqs] int64
    query_start_loc: torch.Tensor  # [num_seqs + 1] int64
    # Host copies, so CPU backends can loop without device syncs.
    seq_lens_list: list[int]
    query_lens_list: list[int]
    block_size: int

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_list)
