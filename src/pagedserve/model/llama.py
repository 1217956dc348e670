"""Llama-family decoder (Llama, Mistral, Qwen2) over flattened tokens and a paged KV cache.

Differences within the family are config-driven: Qwen2 has q/k/v biases, Llama may have
attention_bias / mlp_bias, head_dim may differ from hidden_size // num_heads, embeddings may be tied.
Sliding-window attention (Mistral v0.1, Qwen2 with use_sliding_window): the windowed layers attend to the
last `sliding_window` positions (the token itself included, as in transformers) through the reference
backend with a window mask; the compiled CPU kernel has no window, so it serves only full-attention layers.
Every block stays allocated (no freeing of blocks that slid out of the window).

On CPU, when every layer qualifies (GGUF block weights, the compiled attention kernel; layers/decoder_stack.py),
forward runs all layers in one compiled call of the same ops, bit-identical to the modules below.

q/k/v and gate/up are fused into one matmul each; load_weights maps HF checkpoint names into the slices:

    qkv_proj.weight     = [ q_proj (Hq*D) | k_proj (Hkv*D) | v_proj (Hkv*D) ]   rows
    gate_up_proj.weight = [ gate_proj (I)  | up_proj (I) ]                      rows
"""
from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from pagedserve.attention.backend import AttentionBackend
from pagedserve.attention.metadata import AttentionMetadata
from pagedserve.attention.reference import ReferenceAttentionBackend
from pagedserve.distributed.parallel_state import TensorParallelGroup
from pagedserve.model.layers.activation import SiluAndMul
from pagedserve.model.layers.decoder_stack import DecoderStack
from pagedserve.model.layers.linear import Linear, pack_linear_weights, pack_weight, packed_linear
from pagedserve.model.layers.norm import RMSNorm
from pagedserve.model.layers.parallel import embedding, gather_logits, row_linear
from pagedserve.model.layers.rotary import RotaryEmbedding
from pagedserve.model.weight_quant import block_logits

# HF shard name -> (fused param name, shard index)
_STACKED = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
            "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def _linear(in_features: int, out_features: int, bias: bool, device, dtype) -> Linear:
    return Linear(in_features, out_features, bias=bias, device=device, dtype=dtype)


class LlamaAttention(nn.Module):
    def __init__(self, hf_config, attn_backend: AttentionBackend, device, dtype,
                 rotary_emb: RotaryEmbedding | None = None, tp: TensorParallelGroup | None = None) -> None:
        super().__init__()
        hidden = hf_config.hidden_size
        self.num_heads = hf_config.num_attention_heads
        self.num_kv_heads = getattr(hf_config, "num_key_value_heads", None) or self.num_heads
        self.head_dim = getattr(hf_config, "head_dim", None) or hidden // self.num_heads
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_attention_heads {self.num_heads} is not a multiple of "
                             f"num_key_value_heads {self.num_kv_heads}")
        is_qwen2 = hf_config.model_type == "qwen2"
        attention_bias = bool(getattr(hf_config, "attention_bias", False))
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.qkv_proj = _linear(hidden, self.q_size + 2 * self.kv_size, is_qwen2 or attention_bias, device, dtype)
        self.o_proj = row_linear(self.q_size, hidden, attention_bias and not is_qwen2, device, dtype, tp)
        # One instance shared by all layers (its cos/sin table is built once per model).
        self.rotary_emb = rotary_emb or RotaryEmbedding(hf_config, self.head_dim, device=device)
        self.attn_backend = attn_backend
        self.scale = self.head_dim ** -0.5

    def forward(self, positions: torch.Tensor, x: torch.Tensor, kv_cache: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        num_tokens = x.shape[0]
        q = q.view(num_tokens, self.num_heads, self.head_dim)
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        q, k = self.rotary_emb(positions, q, k)
        o = self.attn_backend.forward(q, k, v, kv_cache, meta, self.scale)
        return self.o_proj(o.reshape(num_tokens, self.q_size))


class LlamaMLP(nn.Module):
    def __init__(self, hf_config, device, dtype, tp: TensorParallelGroup | None = None) -> None:
        super().__init__()
        act = getattr(hf_config, "hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"unsupported hidden_act {act!r}; only 'silu' is implemented")
        bias = bool(getattr(hf_config, "mlp_bias", False))
        hidden, inter = hf_config.hidden_size, hf_config.intermediate_size
        self.gate_up_proj = _linear(hidden, 2 * inter, bias, device, dtype)
        self.down_proj = row_linear(inter, hidden, bias, device, dtype, tp)
        self.act_fn = SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, hf_config, attn_backend: AttentionBackend, device, dtype,
                 rotary_emb: RotaryEmbedding | None = None, tp: TensorParallelGroup | None = None) -> None:
        super().__init__()
        eps = hf_config.rms_norm_eps
        self.input_layernorm = RMSNorm(hf_config.hidden_size, eps, device=device, dtype=dtype)
        self.self_attn = LlamaAttention(hf_config, attn_backend, device, dtype, rotary_emb, tp)
        self.post_attention_layernorm = RMSNorm(hf_config.hidden_size, eps, device=device, dtype=dtype)
        self.mlp = LlamaMLP(hf_config, device, dtype, tp)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata,
                residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        # vLLM's residual stream: each norm first adds the pending branch output into the residual (one
        # fused add + norm):  residual += x;  x = attn(norm(residual));  residual += x;  x = mlp(norm(residual))
        # The hidden state after the layer is x + residual. The first layer gets residual None.
        if residual is None:
            residual, x = x, self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm.forward_residual(x, residual)
        x = self.self_attn(positions, x, kv_cache, meta)
        x, residual = self.post_attention_layernorm.forward_residual(x, residual)
        return self.mlp(x), residual


def sliding_windows(hf_config) -> list[int | None]:
    # Per layer: the attention window, or None for full attention. transformers' layer_types names the
    # sliding layers (Qwen2: those from max_window_layers on, when use_sliding_window); configs without it
    # (Mistral) window every layer when sliding_window is set.
    num_layers, window = hf_config.num_hidden_layers, getattr(hf_config, "sliding_window", None)
    if not window:
        return [None] * num_layers
    layer_types = getattr(hf_config, "layer_types", None)
    if layer_types is not None:
        return [int(window) if t == "sliding_attention" else None for t in layer_types]
    if not getattr(hf_config, "use_sliding_window", True):
        return [None] * num_layers
    return [int(window)] * num_layers


class LlamaModel(nn.Module):
    def __init__(self, hf_config, attn_backend: AttentionBackend, device, dtype,
                 tp: TensorParallelGroup | None = None) -> None:
        super().__init__()
        self.embed_tokens = embedding(hf_config.vocab_size, hf_config.hidden_size, device, dtype, tp)
        head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads
        rotary_emb = RotaryEmbedding(hf_config, head_dim, device=device)
        windows = sliding_windows(hf_config)
        windowed = {w: ReferenceAttentionBackend(sliding_window=w) for w in set(windows) if w is not None}
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(hf_config, attn_backend if w is None else windowed[w], device, dtype, rotary_emb, tp)
            for w in windows)
        self.norm = RMSNorm(hf_config.hidden_size, hf_config.rms_norm_eps, device=device, dtype=dtype)


class LlamaForCausalLM(nn.Module):
    def __init__(self, hf_config, attn_backend: AttentionBackend, *, device: torch.device | str | None = None,
                 dtype: torch.dtype | None = None, tp: TensorParallelGroup | None = None,
                 vocab_size: int | None = None) -> None:
        # With tensor parallelism hf_config is this rank's slice (model/layers/parallel.py: shard_config) and
        # vocab_size the whole vocabulary, which the gathered logits are cut to.
        super().__init__()
        device = torch.device("cpu") if device is None else torch.device(device)  # skip_init needs one
        self.config = hf_config
        self.tp = tp
        self.vocab_size = vocab_size or hf_config.vocab_size
        self.model = LlamaModel(hf_config, attn_backend, device, dtype, tp)
        self.tie_word_embeddings = bool(getattr(hf_config, "tie_word_embeddings", False))
        # Tied: logits reuse the embedding matrix; no separate lm_head parameter exists.
        self.lm_head = None if self.tie_word_embeddings else _linear(
            hf_config.hidden_size, hf_config.vocab_size, False, device, dtype)
        attn = self.model.layers[0].self_attn if len(self.model.layers) else None
        self.num_kv_heads = attn.num_kv_heads if attn else 0
        self.head_dim = attn.head_dim if attn else 0
        inter = hf_config.intermediate_size
        self._shard_sizes = {"qkv_proj": [attn.q_size, attn.kv_size, attn.kv_size] if attn else [],
                             "gate_up_proj": [inter, inter]}
        self.requires_grad_(False)  # serving only; no autograd graph even outside inference_mode
        self._lm_head_packed: torch.Tensor | None = None
        self._lm_head_blocks = None
        # The layers in one compiled call where they qualify (layers/decoder_stack.py); False: not looked at yet.
        self._stack: DecoderStack | None | bool = False

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor],
                meta: AttentionMetadata) -> torch.Tensor:
        if len(kv_caches) != len(self.model.layers):
            raise ValueError(f"got {len(kv_caches)} kv caches for {len(self.model.layers)} layers")
        x = self.model.embed_tokens(input_ids)
        if self._stack is False:
            self._stack = DecoderStack.build(self)
        out = self._stack(x, positions, kv_caches, meta) if self._stack is not None else None
        if out is not None:
            return self.model.norm.forward_residual(*out)[0]
        residual = None
        for layer, kv_cache in zip(self.model.layers, kv_caches):
            x, residual = layer(positions, x, kv_cache, meta, residual)
        if residual is None:  # no layers
            return self.model.norm(x)
        return self.model.norm.forward_residual(x, residual)[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return gather_logits(self._local_logits(hidden), self.tp, self.vocab_size)

    def _local_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        weight = self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        if self._lm_head_blocks is not None:  # blocks only (--quantization, model/weight_quant.py)
            return block_logits(hidden, self._lm_head_blocks)
        if self._lm_head_packed is None:
            return F.linear(hidden, weight)
        return packed_linear(hidden, weight, self._lm_head_packed)

    def pack_weights(self) -> None:
        # The float32 CPU fast paths' weight copies (layers/linear.py); run after every weight load.
        pack_linear_weights(self)
        self._stack = False  # weights (and their block copies) changed: look again at the next forward
        if self.lm_head is None and self.model.embed_tokens.weight is None:
            pass  # the embedding is blocks only (model/gguf_weights.py); _lm_head_blocks already points at them
        elif self.lm_head is None:
            self._lm_head_packed, self._lm_head_blocks = pack_weight(self.model.embed_tokens.weight), None
        else:
            self._lm_head_packed, self._lm_head_blocks = self.lm_head.packed_weight, self.lm_head.exact_blocks

    def _num_shards(self, param_name: str) -> int:
        return len(self._shard_sizes.get(param_name.split(".")[-2], [param_name]))

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        params = dict(self.named_parameters())
        loaded: set[tuple[str, int]] = set()
        for hf_name, tensor in weights:
            if hf_name.endswith(_IGNORED_SUFFIXES):
                continue
            if hf_name == "lm_head.weight" and self.lm_head is None:
                continue  # tied checkpoints sometimes still store a copy of the embedding
            parts = hf_name.split(".")
            stacked = _STACKED.get(parts[-2]) if len(parts) >= 2 else None
            if stacked is None:
                name, shard, dst = hf_name, 0, params.get(hf_name)
            else:
                fused, shard = stacked
                name = ".".join(parts[:-2] + [fused, parts[-1]])
                dst = params.get(name)
                if dst is not None:
                    sizes = self._shard_sizes[fused]
                    start = sum(sizes[:shard])
                    dst = dst[start:start + sizes[shard]]
            if dst is None:
                raise ValueError(f"checkpoint tensor {hf_name!r} has no matching parameter in "
                                 f"{type(self).__name__}")
            if tuple(dst.shape) != tuple(tensor.shape):
                raise ValueError(f"checkpoint tensor {hf_name!r} has shape {tuple(tensor.shape)}, "
                                 f"expected {tuple(dst.shape)}")
            dst.copy_(tensor)
            loaded.add((name, shard))
        missing = [name if self._num_shards(name) == 1 else f"{name}[shard {shard}]"
                   for name in params for shard in range(self._num_shards(name)) if (name, shard) not in loaded]
        if missing:
            raise ValueError(f"checkpoint is missing {len(missing)} tensors, e.g. {missing[:5]}")
        self.pack_weights()


# Same module tree, same weight names; only the config differs.
MistralForCausalLM = LlamaForCausalLM
Qwen2ForCausalLM = LlamaForCausalLM
