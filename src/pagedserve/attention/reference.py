"""Reference paged attention in plain torch (CPU or CUDA). Correctness first, but not naive.

Sequences are split by query length:
  - decode sequences (1 new token) run together: their blocks are gathered into a padded
    [B, L, Hkv, D] view and attended with one masked SDPA call;
  - prefill / chunked-prefill sequences run one at a time with SDPA and a causal mask shifted by the
    cached context:

        keys:     0 1 2 3 4 5 6        (seq_len = 7, of which 3 are new)
        query 4:  x x x x x . .        query j attends to keys <= context_len + j
        query 5:  x x x x x x .
        query 6:  x x x x x x x

K/V are gathered through block tables only transiently inside the call; nothing contiguous per request
outlives it. With a sliding window W only the blocks that hold a key some query can see are gathered (from
the block of position context_len - W + 1 on), so a windowed layer reads O(W) keys per sequence, not the
whole context:

        keys:     0 1 2 3 | 4 5 6 7 | 8 9        (block size 4, W = 3, decode at position 9)
        gathered:           [4 5 6 7 | 8 9]      seen: 7 8 9 Loop bounds come from the host lists in the metadata so CUDA never syncs on .item().
An 8-bit cache (attention/kv_quant.py) is quantized as it is written and dequantized to the query's dtype as
it is gathered; the attention arithmetic is the same.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from pagedserve.attention import kv_quant
from pagedserve.attention.metadata import AttentionMetadata


def write_kv(kv_cache: torch.Tensor, key: torch.Tensor, value: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    num_kv_heads, width = kv_cache.shape[-2:]
    quantized = kv_quant.is_quantized(kv_cache.dtype)
    for half, x in ((0, key), (1, value)):
        rows = kv_quant.quantize(x, kv_cache.dtype) if quantized else x.to(kv_cache.dtype)
        # kv_cache[i] is a contiguous slice, so the flat view aliases the pool and index_copy_ writes in place
        # (through a byte view: index_copy_ has no float8 kernel).
        flat = kv_cache[half].view(-1, num_kv_heads, width)
        if quantized:
            flat, rows = flat.view(torch.uint8), rows.view(torch.uint8)
        flat.index_copy_(0, slot_mapping, rows)


def gather_kv(kv_cache: torch.Tensor, block_tables: torch.Tensor, num_blocks: int,
              dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    # block_tables [B, >= num_blocks] -> keys, values [B, num_blocks * block_size, Hkv, D], dequantized to
    # `dtype` (the query's) when the cache holds another type (8-bit codes, or bf16 under an fp32 model).
    blocks = block_tables[:, :num_blocks]
    batch, (block_size, num_kv_heads, width) = blocks.shape[0], kv_cache.shape[2:]
    shape = (batch, num_blocks * block_size, num_kv_heads, width)
    keys, values = kv_cache[0][blocks].view(shape), kv_cache[1][blocks].view(shape)
    if kv_quant.is_quantized(kv_cache.dtype):
        keys, values = kv_quant.dequantize(keys, dtype), kv_quant.dequantize(values, dtype)
    elif dtype is not None and keys.dtype != dtype:
        keys, values = keys.to(dtype), values.to(dtype)
    return keys, values


class ReferenceAttentionBackend:
    name = "reference"

    def __init__(self, sliding_window: int | None = None, logit_softcap: float | None = None) -> None:
        # With a window W, query position p sees keys p - W + 1 .. p (transformers' and vLLM's convention).
        self.sliding_window = sliding_window
        # Gemma 2: scores become cap * tanh(scores / cap) before the mask and softmax.
        self.logit_softcap = logit_softcap

    def with_window(self, sliding_window: int | None, logit_softcap: float | None) -> ReferenceAttentionBackend:
        return ReferenceAttentionBackend(sliding_window, logit_softcap)

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                meta: AttentionMetadata, scale: float) -> torch.Tensor:
        write_kv(kv_cache, key, value, meta.slot_mapping)
        out = torch.empty_like(query)
        query_starts = [0]
        for q_len in meta.query_lens_list:
            query_starts.append(query_starts[-1] + q_len)

        decode_ids = [i for i, q_len in enumerate(meta.query_lens_list) if q_len == 1]
        if decode_ids:
            self._decode(query, kv_cache, meta, decode_ids, query_starts, scale, out)
        for i, q_len in enumerate(meta.query_lens_list):
            if q_len > 1:
                start = query_starts[i]
                out[start:start + q_len] = self._prefill_one(
                    query[start:start + q_len], kv_cache, meta.block_tables[i], meta.seq_lens_list[i], scale)
        return out

    def _decode(self, query: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata,
                decode_ids: list[int], query_starts: list[int], scale: float, out: torch.Tensor) -> None:
        block_size, num_kv_heads, head_dim = kv_cache.shape[2], kv_cache.shape[3], query.shape[-1]
        max_len = max(meta.seq_lens_list[i] for i in decode_ids)
        num_blocks = -(-max_len // block_size)
        all_decode = len(decode_ids) == meta.num_seqs
        if all_decode:  # the common pure-decode step: token i belongs to sequence i, no indexing needed
            q, block_tables, seq_lens = query, meta.block_tables, meta.seq_lens
        else:
            seq_idx = torch.tensor(decode_ids, device=query.device)
            tok_idx = torch.tensor([query_starts[i] for i in decode_ids], device=query.device)
            q, block_tables, seq_lens = query[tok_idx], meta.block_tables[seq_idx], meta.seq_lens[seq_idx]
        batch, num_heads = q.shape[0], q.shape[1]
        slot = torch.arange(block_size, device=query.device)
        if self.sliding_window is None:
            positions = torch.arange(num_blocks * block_size, device=query.device)[None, :]
        else:  # each sequence's blocks from the one holding its first visible key
            first = ((seq_lens - self.sliding_window).clamp(min=0) // block_size)[:, None]
            num_blocks = min(num_blocks, -(-self.sliding_window // block_size) + 1)
            cols = first + torch.arange(num_blocks, device=query.device)[None, :]  # may run past a table's end
            block_tables = block_tables.gather(1, cols.clamp(max=block_tables.shape[1] - 1))
            positions = (cols[:, :, None] * block_size + slot).flatten(1)
        keys, values = gather_kv(kv_cache, block_tables, num_blocks, query.dtype)  # [B, L, Hkv, D]
        # GQA: query head h reads kv head h // group, so [B, Hq, D] -> [B, Hkv, group, D] treats the group
        # as SDPA's "query length" axis; no K/V repeat is materialized.
        q = q.view(batch, num_kv_heads, num_heads // num_kv_heads, head_dim)
        mask = positions < seq_lens[:, None]  # padding and stale slots off
        if self.sliding_window is not None:
            mask &= positions >= seq_lens[:, None] - self.sliding_window
        mask = mask.view(batch, 1, 1, -1)
        o = self._attend(q, keys.transpose(1, 2), values.transpose(1, 2), mask, scale)
        o = o.reshape(batch, num_heads, head_dim).to(out.dtype)
        if all_decode:
            out.copy_(o)
        else:
            out.index_copy_(0, tok_idx, o)

    def _prefill_one(self, q: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor, seq_len: int,
                     scale: float) -> torch.Tensor:
        block_size = kv_cache.shape[2]
        q_len = q.shape[0]
        context_len = seq_len - q_len
        # Keys from the block of the first one a query sees (window) or from 0: key_pos0 .. seq_len - 1.
        first = 0 if self.sliding_window is None else max(0, context_len - self.sliding_window + 1) // block_size
        key_pos0 = first * block_size
        keys, values = gather_kv(kv_cache, block_table[None, first:], -(-seq_len // block_size) - first, q.dtype)
        keys = keys[0, :seq_len - key_pos0].transpose(0, 1)[None]
        values = values[0, :seq_len - key_pos0].transpose(0, 1)[None]
        q = q.transpose(0, 1)[None]  # [1, Hq, q_len, D]
        if q_len == seq_len and self.sliding_window is None and self.logit_softcap is None:
            # SDPA's top-left causal mask is exactly right
            o = F.scaled_dot_product_attention(q, keys, values, is_causal=True, scale=scale, enable_gqa=True)
        else:
            key_pos = torch.arange(key_pos0, seq_len, device=q.device)
            query_pos = torch.arange(q_len, device=q.device) + context_len
            mask = key_pos[None, :] <= query_pos[:, None]
            if self.sliding_window is not None:
                mask &= key_pos[None, :] > query_pos[:, None] - self.sliding_window
            o = self._attend(q, keys, values, mask, scale)
        return o[0].transpose(0, 1)

    def _attend(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor,
                scale: float) -> torch.Tensor:
        # q [B, H, Lq, D], keys/values [B, Hkv, L, D] with H % Hkv == 0; mask (True: attend) broadcasts to
        # [B, H, Lq, L]. SDPA has no soft-capping, so capped layers spell attention out, in transformers'
        # order of operations (scale, cap, mask, float32 softmax).
        if self.logit_softcap is None:
            return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=scale, enable_gqa=True)
        if keys.shape[1] != q.shape[1]:
            group = q.shape[1] // keys.shape[1]
            keys, values = keys.repeat_interleave(group, dim=1), values.repeat_interleave(group, dim=1)
        scores = torch.matmul(q, keys.transpose(-1, -2)) * scale
        scores = torch.tanh(scores / self.logit_softcap) * self.logit_softcap
        scores = scores.masked_fill(~mask, float("-inf"))
        return torch.matmul(torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype), values)
