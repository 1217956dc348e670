"""Megatron-style tensor-parallel layers and the weight slicing that goes with them.

Each rank builds the ordinary Llama module tree from a *sharded config* (its share of the heads, KV heads,
MLP columns and vocabulary) and loads its slices of the checkpoint. Three places then talk to the others:

    qkv_proj, gate_up_proj   column-parallel: each rank computes its own heads / MLP columns; no traffic
    o_proj, down_proj        row-parallel: each rank's partial product, summed by an all-reduce (the bias
                             is rank 0's; the others hold zeros)
    embed_tokens             vocab-parallel: a rank looks up the ids in its vocab range, zeros elsewhere,
                             and an all-reduce sums the rows
    LM head                  vocab-parallel: each rank's logits for its vocab range, all-gathered (then the
                             padding past the real vocabulary is cut off) before the sampler on rank 0

Attention needs no traffic: a rank's query heads use only the KV heads it holds, because rank r holds query
heads [r*Hq/N, (r+1)*Hq/N) and KV heads [r*Hkv/N, (r+1)*Hkv/N), and GQA maps query head h to KV head
h // (Hq/Hkv). So per layer and token the traffic is two all-reduces of hidden_size values.
"""
from __future__ import annotations

import copy
from collections.abc import Iterable, Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from pagedserve.distributed.parallel_state import TensorParallelGroup, check_divisible
from pagedserve.kv_spec import head_dim_of, num_kv_heads_of
from pagedserve.model.layers.linear import Linear

# Checkpoint name suffix -> the dim split across ranks. Column-parallel weights split their output rows,
# row-parallel ones their input columns; a row-parallel bias is held by rank 0 and zero on the others.
_SPLIT_DIM = {"q_proj.weight": 0, "k_proj.weight": 0, "v_proj.weight": 0,
              "q_proj.bias": 0, "k_proj.bias": 0, "v_proj.bias": 0,
              "gate_proj.weight": 0, "up_proj.weight": 0, "gate_proj.bias": 0, "up_proj.bias": 0,
              "o_proj.weight": 1, "down_proj.weight": 1}
_VOCAB_NAMES = ("embed_tokens.weight", "lm_head.weight")
_ROW_PARALLEL_BIASES = ("o_proj.bias", "down_proj.bias")


def vocab_shard_size(vocab_size: int, world_size: int) -> int:
    # Rows per rank; the last rank's range is padded with zero rows when the vocabulary does not divide.
    return -(-vocab_size // world_size)


def shard_config(hf_config, world_size: int):
    """The config of one rank's slice of the model (a copy; the full config stays the engine's)."""
    check_divisible(hf_config, world_size)
    local = copy.deepcopy(hf_config)
    # head_dim must be explicit: hidden_size // local heads would be wrong.
    local.head_dim = head_dim_of(hf_config)
    local.num_attention_heads = hf_config.num_attention_heads // world_size
    local.num_key_value_heads = num_kv_heads_of(hf_config) // world_size
    local.intermediate_size = hf_config.intermediate_size // world_size
    local.vocab_size = vocab_shard_size(hf_config.vocab_size, world_size)
    return local


def shard_weights(weights: Iterable[tuple[str, Any]], tp: TensorParallelGroup,
                  vocab_size: int) -> Iterator[tuple[str, torch.Tensor]]:
    """This rank's slice of each checkpoint tensor, under the same name. A weight is a tensor or a lazy
    safetensors slice (get_shape() and [] indexing), so a rank reads only its own rows from disk."""
    rank, n = tp.rank, tp.world_size
    for name, weight in weights:
        shape = weight.get_shape() if hasattr(weight, "get_shape") else weight.shape
        dim = next((d for suffix, d in _SPLIT_DIM.items() if name.endswith(suffix)), None)
        if dim is not None:
            size = shape[dim] // n  # divides: shard_config checked heads and MLP width
            part = weight[rank * size:(rank + 1) * size] if dim == 0 else weight[:, rank * size:(rank + 1) * size]
        elif name.endswith(_VOCAB_NAMES):
            rows = vocab_shard_size(vocab_size, n)
            part = weight[rank * rows:(rank + 1) * rows]
            if part.shape[0] < rows:
                part = torch.cat([part, part.new_zeros(rows - part.shape[0], *part.shape[1:])])
        else:
            part = weight[:]
            if rank and name.endswith(_ROW_PARALLEL_BIASES):
                part = torch.zeros_like(part)
        yield name, part.contiguous()


class RowParallelLinear(Linear):
    tp: TensorParallelGroup

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Linear's own paths on this rank's columns; the bias is rank 0's alone (zero elsewhere, see
        # shard_weights), so it is counted once in the sum.
        return self.tp.all_reduce(super().forward(x))


class Embedding(nn.Embedding):
    def reset_parameters(self) -> None:
        pass  # the table always comes from load_weights (see Linear.reset_parameters)


class VocabParallelEmbedding(Embedding):
    tp: TensorParallelGroup
    vocab_start: int

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        local = input_ids - self.vocab_start
        outside = (local < 0) | (local >= self.num_embeddings)
        x = F.embedding(local.masked_fill(outside, 0), self.weight)
        x.masked_fill_(outside.unsqueeze(-1), 0.0)
        return self.tp.all_reduce(x)


def row_linear(in_features: int, out_features: int, bias: bool, device, dtype,
               tp: TensorParallelGroup | None) -> Linear:
    # Weights are always overwritten by load_weights, so random init would only cost load time.
    if tp is None:
        return Linear(in_features, out_features, bias=bias, device=device, dtype=dtype)
    layer = RowParallelLinear(in_features, out_features, bias=bias, device=device, dtype=dtype)
    layer.tp = tp
    return layer


def embedding(num_embeddings: int, dim: int, device, dtype, tp: TensorParallelGroup | None) -> nn.Embedding:
    if tp is None:
        return Embedding(num_embeddings, dim, device=device, dtype=dtype)
    layer = VocabParallelEmbedding(num_embeddings, dim, device=device, dtype=dtype)
    layer.tp, layer.vocab_start = tp, tp.rank * num_embeddings
    return layer


def gather_logits(local_logits: torch.Tensor, tp: TensorParallelGroup | None, vocab_size: int) -> torch.Tensor:
    # Every rank gets the full [tokens, vocab] logits (padding rows cut); only rank 0 samples from them.
    if tp is None:
        return local_logits
    return tp.all_gather(local_logits)[..., :vocab_size]
