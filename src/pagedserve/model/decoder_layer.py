"""One decoder layer of any family (model/family.py says which switches each family sets).

q/k/v and gate/up are fused into one matmul each; load_weights (model/llama.py) maps HF checkpoint names
into the slices:

    qkv_proj.weight     = [ q_proj (Hq*D) | k_proj (Hkv*D) | v_proj (Hkv*D) ]   rows
    gate_up_proj.weight = [ gate_proj (I)  | up_proj (I) ]                      rows
"""
from __future__ import annotations

import torch
from torch import nn

from pagedserve.attention.backend import AttentionBackend
from pagedserve.attention.metadata import AttentionMetadata
from pagedserve.distributed.parallel_state import TensorParallelGroup
from pagedserve.kv_spec import head_dim_of, num_kv_heads_of
from pagedserve.model.family import DecoderFamily
from pagedserve.model.layers.activation import GeluTanhAndMul, SiluAndMul
from pagedserve.model.layers.linear import Linear
from pagedserve.model.layers.norm import RMSNorm
from pagedserve.model.layers.parallel import row_linear
from pagedserve.model.layers.rotary import RotaryEmbedding


def _linear(in_features: int, out_features: int, bias: bool, device, dtype) -> Linear:
    return Linear(in_features, out_features, bias=bias, device=device, dtype=dtype)


class LlamaAttention(nn.Module):
    def __init__(self, hf_config, family: DecoderFamily, attn_backend: AttentionBackend, rotary_emb: RotaryEmbedding,
                 device, dtype, tp: TensorParallelGroup | None = None) -> None:
        super().__init__()
        hidden = hf_config.hidden_size
        self.num_heads = hf_config.num_attention_heads
        self.num_kv_heads = num_kv_heads_of(hf_config)
        self.head_dim = head_dim_of(hf_config)
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_attention_heads {self.num_heads} is not a multiple of "
                             f"num_key_value_heads {self.num_kv_heads}")
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.qkv_proj = _linear(hidden, self.q_size + 2 * self.kv_size, family.qkv_bias, device, dtype)
        self.o_proj = row_linear(self.q_size, hidden, family.o_bias, device, dtype, tp)
        if family.qk_norm:  # per head, before rope (Qwen3, Gemma 3)
            self.q_norm = RMSNorm(self.head_dim, hf_config.rms_norm_eps, device=device, dtype=dtype)
            self.k_norm = RMSNorm(self.head_dim, hf_config.rms_norm_eps, device=device, dtype=dtype)
        # Shared by the layers with the same rope parameters (one cos/sin table each).
        self.rotary_emb = rotary_emb
        self.attn_backend = attn_backend
        self.scale = family.attn_scale

    def forward(self, positions: torch.Tensor, x: torch.Tensor, kv_cache: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        num_tokens = x.shape[0]
        if hasattr(self, "q_norm"):  # rows of one head each: the 2-D norm kernel
            q = self.q_norm(q.reshape(-1, self.head_dim))
            k = self.k_norm(k.reshape(-1, self.head_dim))
        q = q.view(num_tokens, self.num_heads, self.head_dim)
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        q, k = self.rotary_emb(positions, q, k)
        o = self.attn_backend.forward(q, k, v, kv_cache, meta, self.scale)
        return self.o_proj(o.reshape(num_tokens, self.q_size))


class LlamaMLP(nn.Module):
    def __init__(self, hf_config, family: DecoderFamily, device, dtype, tp: TensorParallelGroup | None = None) -> None:
        super().__init__()
        hidden, inter = hf_config.hidden_size, hf_config.intermediate_size
        self.gate_up_proj = _linear(hidden, 2 * inter, family.mlp_bias, device, dtype)
        self.down_proj = row_linear(inter, hidden, family.mlp_bias, device, dtype, tp)
        self.act_fn = GeluTanhAndMul() if family.gelu_tanh else SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, hf_config, family: DecoderFamily, attn_backend: AttentionBackend, rotary_emb: RotaryEmbedding,
                 device, dtype, tp: TensorParallelGroup | None = None) -> None:
        super().__init__()
        hidden, eps = hf_config.hidden_size, hf_config.rms_norm_eps
        self.input_layernorm = RMSNorm(hidden, eps, device=device, dtype=dtype)
        self.self_attn = LlamaAttention(hf_config, family, attn_backend, rotary_emb, device, dtype, tp)
        # Llama: the norm before the MLP. Gemma: the norm of the attention output (HF's names).
        self.post_attention_layernorm = RMSNorm(hidden, eps, device=device, dtype=dtype)
        if family.sandwich_norms:
            self.pre_feedforward_layernorm = RMSNorm(hidden, eps, device=device, dtype=dtype)
            self.post_feedforward_layernorm = RMSNorm(hidden, eps, device=device, dtype=dtype)
        self.mlp = LlamaMLP(hf_config, family, device, dtype, tp)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata,
                residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        # vLLM's residual stream: each norm first adds the pending branch output into the residual (one
        # fused add + norm):  residual += x;  x = attn(norm(residual));  residual += x;  x = mlp(norm(residual))
        # The hidden state after the layer is x + residual. The first layer gets residual None. Gemma also
        # normalizes each branch's output before it joins the residual.
        if residual is None:
            residual, x = x, self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm.forward_residual(x, residual)
        x = self.self_attn(positions, x, kv_cache, meta)
        if hasattr(self, "pre_feedforward_layernorm"):
            x = self.post_attention_layernorm(x)
            x, residual = self.pre_feedforward_layernorm.forward_residual(x, residual)
            return self.post_feedforward_layernorm(self.mlp(x)), residual
        x, residual = self.post_attention_layernorm.forward_residual(x, residual)
        return self.mlp(x), residual
