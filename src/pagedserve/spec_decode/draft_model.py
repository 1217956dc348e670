"""Draft-model speculation (vLLM's "draft_model" method): a second, smaller or cheaper model proposes k tokens.

KV: the draft's paged pool mirrors the target's physical blocks (same block ids, same slots), so the KV
manager allocates nothing for it. Every step the draft runs on exactly the tokens the target runs on, with
the target's slot mapping (catch_up), so wherever the target's K/V is valid the draft's is too, prefix-cache
hits included (the request that filled a cached block ran the draft on it as well).

Proposing writes the draft's K/V for positions past the verified ones. Inside the request's last allocated
block those slots are its own and are overwritten by the next step's catch-up; positions past its last
allocated block go to scratch blocks appended after the mirrored ones, one set per proposing row.

Greedy requests draft the argmax (a one-hot q); random ones sample from softmax(logits / temperature), and
that distribution q goes to the rejection sampler, which keeps the output exactly the target's either way.
"""
from __future__ import annotations

import os

import numpy as np
import torch

from pagedserve.attention.metadata import AttentionMetadata
from pagedserve.config import SpeculativeConfig
from pagedserve.model.loader import LoadedModel, load_model
from pagedserve.model.weight_quant import apply_quantization, resolve_quantization
from pagedserve.sample.sampler import SamplingBatch, draw, random_probs
from pagedserve.worker.kv_cache import allocate_kv_caches


def load_draft(spec: SpeculativeConfig, device: torch.device, dtype: torch.dtype, attn_backend: str,
               tokenizer: str | None) -> LoadedModel:
    # "int8" on a GGUF file: dense fp32 first, then every weight requantized to Q8_0 blocks. On CPUs where
    # the Q8_0 kernel is much faster than Q4_1's (AVX2 without AVX-512: benchmarks/README.md, "Speculative
    # decoding") this is a self-draft several times cheaper than the target it approximates.
    requantize = spec.quantization == "int8" and not os.path.isdir(os.path.expanduser(spec.model))
    loaded = load_model(spec.model, device, dtype, attn_backend, tokenizer,
                        quantization="none" if requantize else spec.quantization)
    if requantize:
        resolve_quantization("int8", False, dtype, device)  # ValueError where the block kernels cannot run
        apply_quantization(loaded.model, "int8")
        loaded.quantization = "int8"
    return loaded


def check_same_vocab(target: LoadedModel, draft: LoadedModel) -> None:
    # Draft token ids are verified as target token ids: the two must mean the same text by the same id.
    if target.hf_config.vocab_size != draft.hf_config.vocab_size:
        raise ValueError(f"the draft model's vocabulary ({draft.hf_config.vocab_size} tokens) does not match "
                         f"the target's ({target.hf_config.vocab_size})")
    if target.tokenizer.get_vocab() != draft.tokenizer.get_vocab():
        raise ValueError("the draft model's tokenizer vocabulary differs from the target's")


class DraftModel:
    def __init__(self, loaded: LoadedModel, k: int, num_blocks: int, block_size: int, max_num_reqs: int,
                 max_model_len: int, dtype: torch.dtype, device: torch.device) -> None:
        hf = loaded.hf_config
        self.model = loaded.model
        self.k = k
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.device = device
        # Proposing reaches k positions past the step's last allocated slot: ceil(k / bs) + 1 scratch blocks
        # per row cover it wherever the row's last block ends.
        self.num_scratch = -(-k // block_size) + 1
        num_kv_heads = hf.num_key_value_heads
        head_dim = self.head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
        self.kv_caches = allocate_kv_caches(hf.num_hidden_layers, num_blocks + max_num_reqs * self.num_scratch,
                                            block_size, num_kv_heads, head_dim, dtype, device)
        self.host_caches: list[torch.Tensor] = []

    def catch_up(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> None:
        # The target's step, run through the draft: fills the draft's K/V at the same slots.
        self.model(input_ids, positions, self.kv_caches, meta)

    def propose(self, last_token_ids: list[int], positions: list[int], tables: list[np.ndarray],
                sampling: SamplingBatch) -> tuple[list[list[int]], list[torch.Tensor] | None]:
        """Per row: the token at `positions[i]` (not yet in any K/V) and the row's allocated block ids;
        `sampling` holds each row's temperature / top-k / top-p / min-p (SamplingBatch.build_distribution).
        Returns k draft tokens per row and their draft distributions q, [k, V] per row (None when every row
        is greedy: greedy verification only compares with the argmax)."""
        num_rows, k, bs = len(last_token_ids), self.k, self.block_size
        pos = np.asarray(positions, dtype=np.int64)
        width = int((pos.max() + k - 1) // bs) + 1
        table = np.empty((num_rows, width), dtype=np.int64)
        for i, blocks in enumerate(tables):
            n = min(len(blocks), width)
            table[i, :n] = blocks[:n]
            scratch = self.num_blocks + i * self.num_scratch
            table[i, n:] = scratch + np.arange(width - n) % self.num_scratch
        # Every step's slots and lengths at once: the loop below only slices them.
        steps = pos[None, :] + np.arange(k)[:, None]                                # [k, rows]
        slots = torch.from_numpy(table[np.arange(num_rows)[None, :], steps // bs] * bs + steps % bs)
        seq_lens = torch.from_numpy(steps + 1)
        positions_t = torch.from_numpy(steps)
        seq_lens_lists = (steps + 1).tolist()
        dev = self.device
        tokens = torch.tensor(last_token_ids, dtype=torch.long, device=dev)
        qsl = torch.arange(num_rows + 1, device=dev)
        table_t = torch.from_numpy(table).to(dev)
        query_lens = [1] * num_rows
        greedy = None if sampling.all_greedy else (
            sampling.is_greedy if sampling.is_greedy is not None else torch.zeros(num_rows, dtype=torch.bool))
        drafts, probs = [], []
        for j in range(k):
            meta = AttentionMetadata(
                slot_mapping=slots[j].to(dev), block_tables=table_t, seq_lens=seq_lens[j].to(dev),
                query_start_loc=qsl, seq_lens_list=seq_lens_lists[j], query_lens_list=query_lens, block_size=bs)
            hidden = self.model(tokens, positions_t[j].to(dev), self.kv_caches, meta)
            logits = self.model.compute_logits(hidden)
            tokens = logits.argmax(dim=-1)
            if greedy is not None:
                # The request's own distribution (temperature, top-k, top-p, min-p), as the target samples:
                # the closer q is to p, the more drafts are accepted; exactness needs only q as drawn from.
                q = random_probs(logits.float(), sampling)
                q = torch.where(greedy.unsqueeze(1), torch.nn.functional.one_hot(tokens, q.shape[1]).to(q.dtype), q)
                tokens = torch.where(greedy, tokens, draw(q, sampling.generators))
                probs.append(q)
            drafts.append(tokens)
        draft_ids = torch.stack(drafts, dim=1).tolist()
        if greedy is None:
            return draft_ids, None
        return draft_ids, list(torch.stack(probs, dim=1).unbind(0))
