"""The decoder model of every family we serve (Llama, Mistral, Qwen2/3, Phi-3, Gemma 2/3) over flattened tokens
and a paged KV cache; model/family.py reads what differs from the config, model/decoder_layer.py holds the layer.

Sliding-window layers (Mistral v0.1, Qwen2 with use_sliding_window, Gemma's local layers, Phi-3) attend to
the last `sliding_window` positions (the token itself included, as in transformers), and Gemma 2's layers cap
their scores, through their backend's windowed form (the compiled kernel's or the reference's). A windowed
layer reads only the blocks that hold keys inside its window; every block stays allocated: Gemma's global
layers read every block anyway, and freed blocks would leave holes in the block tables and the prefix cache
(docs/how_it_works.md).

On CPU, when every layer qualifies (plain Llama layers, GGUF block weights, the compiled attention kernel;
layers/decoder_stack.py), forward runs all layers in one compiled call of the same ops, bit-identical to the
modules.

`between_layers` (layers/decoder_stack.py's BetweenLayers) is called between two layers when its flag is set:
the engine core runs an urgent request's step there while a long one is in flight (engine/urgent_steps.py).
"""
from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from pagedserve.attention.backend import AttentionBackend
from pagedserve.attention.cpu_paged import CpuPagedAttentionBackend
from pagedserve.attention.metadata import AttentionMetadata
from pagedserve.distributed.parallel_state import TensorParallelGroup
from pagedserve.kv_spec import head_dim_of
from pagedserve.model.decoder_layer import LlamaDecoderLayer
from pagedserve.model.family import DecoderFamily, decoder_family, split_fused_weights
from pagedserve.model.layers.decoder_stack import BetweenLayers, DecoderStack
from pagedserve.model.layers.linear import Linear, dense_linear, pack_linear_weights, pack_weight
from pagedserve.model.layers.norm import RMSNorm
from pagedserve.model.layers.parallel import embedding, gather_logits
from pagedserve.model.layers.rotary import RotaryEmbedding, longrope_switch_len
from pagedserve.model.weight_quant import block_logits

# HF shard name -> (fused param name, shard index)
_STACKED = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
            "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


class LlamaModel(nn.Module):
    def __init__(self, hf_config, family: DecoderFamily, attn_backend: AttentionBackend, device, dtype,
                 tp: TensorParallelGroup | None = None) -> None:
        super().__init__()
        self.embed_tokens = embedding(hf_config.vocab_size, hf_config.hidden_size, device, dtype, tp)
        head_dim = head_dim_of(hf_config)
        rotaries = {t: RotaryEmbedding(hf_config, head_dim, device=device, layer_type=t)
                    for t in set(family.layer_rope)}
        # Windowed or soft-capped layers get the backend's windowed form, one per window.
        cap = family.attn_logit_softcap
        backends = {w: attn_backend.with_window(w, cap) for w in set(family.layer_windows)
                    if w is not None or cap is not None}
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(hf_config, family, backends.get(w, attn_backend), rotaries[t], device, dtype, tp)
            for w, t in zip(family.layer_windows, family.layer_rope))
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
        self.family = decoder_family(hf_config)
        self.model = LlamaModel(hf_config, self.family, attn_backend, device, dtype, tp)
        # longrope: sequences longer than this use the long factors (layers/rotary.py); None otherwise.
        self.longrope_switch = longrope_switch_len(hf_config) if len(set(self.family.layer_rope)) == 1 else None
        self.tie_word_embeddings = bool(getattr(hf_config, "tie_word_embeddings", False))
        # Tied: logits reuse the embedding matrix; no separate lm_head parameter exists.
        self.lm_head = None if self.tie_word_embeddings else Linear(
            hf_config.hidden_size, hf_config.vocab_size, bias=False, device=device, dtype=dtype)
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
        self.batch_invariant = False  # set_batch_invariant

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor],
                meta: AttentionMetadata, long_rope: torch.Tensor | None = None,
                between_layers: BetweenLayers | None = None) -> torch.Tensor:
        # long_rope: per token, whether its sequence is past longrope_switch tokens (long factors); None: none is.
        if len(kv_caches) != len(self.model.layers):
            raise ValueError(f"got {len(kv_caches)} kv caches for {len(self.model.layers)} layers")
        if self.longrope_switch is not None:  # positions become rows of the [short | long] rotary table
            if long_rope is not None:
                positions = positions + long_rope.to(positions.dtype) * self.longrope_switch
            elif positions.numel() and int(positions.max()) >= self.longrope_switch:
                raise ValueError(f"positions past {self.longrope_switch} need long_rope (longrope's long factors)")
        x = self.model.embed_tokens(input_ids)
        if self.family.embed_scale is not None:  # Gemma; the scale rounded to the activations' dtype, as in HF
            x = x * torch.tensor(self.family.embed_scale, dtype=x.dtype)
        if self._stack is False:
            self._stack = DecoderStack.build(self)
        out = self._stack(x, positions, kv_caches, meta, between_layers) if self._stack is not None else None
        if out is not None:
            return self.model.norm.forward_residual(*out)[0]
        residual = None
        for i, (layer, kv_cache) in enumerate(zip(self.model.layers, kv_caches)):
            if i and between_layers is not None and between_layers.flag[0]:
                between_layers()
            x, residual = layer(positions, x, kv_cache, meta, residual)
        if residual is None:  # no layers
            return self.model.norm(x)
        return self.model.norm.forward_residual(x, residual)[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = gather_logits(self._local_logits(hidden), self.tp, self.vocab_size)
        cap = self.family.final_logit_softcap
        return logits if cap is None else torch.tanh(logits / cap) * cap

    def _local_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        weight = self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        if self._lm_head_blocks is not None:  # blocks only (--quantization, model/weight_quant.py)
            return block_logits(hidden, self._lm_head_blocks, self.batch_invariant)
        return dense_linear(hidden, weight, self._lm_head_packed, None, self.batch_invariant)

    def set_batch_invariant(self, on: bool = True) -> None:
        # Every reduction in an order that does not depend on the batch (docs/batch_invariance.md): the linears
        # and the LM head through row-independent kernels, attention through the kernel's invariant form.
        # ValueError where a layer's attention has no such form (the reference backend's SDPA).
        backends = {}
        for layer in self.model.layers:
            attn = layer.self_attn
            backend = attn.attn_backend
            if not isinstance(backend, CpuPagedAttentionBackend):
                if not on:
                    continue
                raise ValueError(f"--batch-invariant needs the compiled CPU attention kernel; this model's layers "
                                 f"attend through the {backend.name!r} backend")
            if id(backend) not in backends:
                backends[id(backend)] = backend.with_batch_invariance(on)
            attn.attn_backend = backends[id(backend)]
        for m in self.modules():
            if isinstance(m, Linear):
                m.batch_invariant = on
        self.batch_invariant = on
        self._stack = False  # the compiled stack reads the mode when it is built

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
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]], norms_hold_offset: bool = False) -> None:
        # norms_hold_offset: the norm weights come with Gemma's 1 + w already in them (a GGUF file's).
        params = dict(self.named_parameters())
        loaded: set[tuple[str, int]] = set()
        # Gemma: the norm weights hold 1 + w (model/family.py)
        offset = 0.0 if norms_hold_offset else self.family.norm_weight_offset
        for hf_name, tensor in split_fused_weights(weights, self.config):
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
            if offset and hf_name.endswith("norm.weight"):
                tensor = tensor.float() + offset  # in float32, as Gemma's norm computes 1 + w
            dst.copy_(tensor)
            loaded.add((name, shard))
        missing = [name if self._num_shards(name) == 1 else f"{name}[shard {shard}]"
                   for name in params for shard in range(self._num_shards(name)) if (name, shard) not in loaded]
        if missing:
            raise ValueError(f"checkpoint is missing {len(missing)} tensors, e.g. {missing[:5]}")
        self.pack_weights()


# Same module tree, same weight names; only the config's switches (model/family.py) differ.
MistralForCausalLM = Qwen2ForCausalLM = Qwen3ForCausalLM = Phi3ForCausalLM = LlamaForCausalLM
Gemma2ForCausalLM = Gemma3ForCausalLM = LlamaForCausalLM
