"""The decoder layers of a Llama-family model in one compiled call (kernels/csrc/decoder_layers.cpp).

At decode batch sizes each layer is ~10 op calls of a few microseconds each, and the Python around them
(module calls, dtype and layout checks, splits and views) cost more than the ops: on the embedded 30-layer
model ~6 ms of a ~17 ms one-stream decode step on the Xeon of benchmarks/HISTORY.md. The compiled loop calls
the same ops in the same order, so its output is bit-identical to the modules' (tests/model/test_decoder_stack.py).

It serves the common case and leaves everything else to the modules: every linear holds GGUF blocks in their
inputs' natural order (the default for GGUF files; a fused weight may have parts of several types, as a Q4_K_M
qkv_proj does) that gemm_gguf, gemm_gguf_amx or gemm_gguf_int8 multiplies at this batch size, every layer
attends through the compiled CPU kernel (no sliding window, no reference fallback), the plain Llama layer (model/family.py: no q/k
norm, Gemma norms, GeGLU, partial rotary or per-layer rope), no tensor parallelism, activations of a dtype the
layer kernels take. `build` checks what is fixed per model, `__call__` what depends on the step, and returns
None to send the step through the modules.

Given `between_layers` (BetweenLayers), the compiled loop watches its flag, which another thread may set while
it runs: set before a layer, the loop returns there, the stack calls between_layers (the engine core runs an
urgent request's step there, engine/urgent_steps.py) and goes on with a run of the remaining layers from the
(x, residual) it stopped at, so the result is the same, bit for bit, and a step no one interrupts costs nothing.
"""
from __future__ import annotations

import functools
from typing import Protocol

import torch

from pagedserve import kernels
from pagedserve.attention.cpu_paged import CpuPagedAttentionBackend, kernel_supports
from pagedserve.attention.metadata import AttentionMetadata
from pagedserve.model.layers.gguf_quant import GEMM_IDS, kernel_choice
from pagedserve.model.layers.linear import Linear
from pagedserve.model.layers.norm import RMSNorm


class BetweenLayers(Protocol):
    # Called between two layers when flag (int64 [1]; another thread may set it at any time) is non-zero.
    flag: torch.Tensor

    def __call__(self) -> None: ...


class DecoderStack:
    def __init__(self, layers, rotary_emb) -> None:
        linears = [m for layer in layers for m in (layer.self_attn.qkv_proj, layer.self_attn.o_proj,
                                                   layer.mlp.gate_up_proj, layer.mlp.down_proj)]
        blocks = [m.exact_blocks[1] for m in linears]
        self.weights = [p for w in blocks for p in w.parts]  # every linear's row segments, in order
        self.qtypes = [t for w in blocks for t in w.qtypes]
        self.parts = [len(w.parts) for w in blocks]
        # Per layer, where its linears' parts start in weights / qtypes (and where the last one's end).
        ends = [0]
        for n in self.parts:
            ends.append(ends[-1] + n)
        self.layer_parts = ends[::4]
        self.linear_qtypes = [w.qtypes for w in blocks]
        self.biases = [m.bias for m in linears]
        self.norms = [n.weight for layer in layers for n in (layer.input_layernorm, layer.post_attention_layernorm)]
        self.eps = layers[0].input_layernorm.eps
        attn = layers[0].self_attn
        self.heads = [attn.num_heads, attn.num_kv_heads, attn.head_dim]
        self.scale = attn.scale
        self.rotary_emb = rotary_emb
        self.dtype = self.norms[0].dtype
        self.qtype_set = set(self.linear_qtypes)
        # batch-invariant mode: row-independent GEMMs at every row count and the attention kernel's invariant form
        self.batch_invariant = attn.attn_backend.batch_invariant

    @classmethod
    def build(cls, model) -> DecoderStack | None:
        # None when some layer needs what only the modules do (see the module doc).
        layers = list(model.model.layers)
        if not layers or model.tp is not None or not model.family.runs_llama_layers:
            return None
        first = layers[0].input_layernorm
        for layer in layers:
            attn = layer.self_attn
            backend = attn.attn_backend
            if (not isinstance(backend, CpuPagedAttentionBackend)
                    or backend.sliding_window is not None or backend.logit_softcap is not None
                    or attn.rotary_emb is not layers[0].self_attn.rotary_emb or not attn.rotary_emb.max_positions):
                return None
            for norm in (layer.input_layernorm, layer.post_attention_layernorm):
                if type(norm) is not RMSNorm or norm.eps != first.eps or norm.weight.dtype != first.weight.dtype:
                    return None
            for m in (attn.qkv_proj, attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj):
                blocks = m.exact_blocks
                if (type(m) is not Linear or blocks is None or blocks[0] != "gguf"
                        or blocks[1].in_order is not None):  # the compiled loop does not reorder x
                    return None
        return cls(layers, layers[0].self_attn.rotary_emb)

    def __call__(self, x: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor],
                 meta: AttentionMetadata, between_layers: BetweenLayers | None = None,
                 ) -> tuple[torch.Tensor, torch.Tensor] | None:
        # (last layer's output, residual), or None: run the modules.
        ops = kernels.ops_for(x, kernels.LAYER_DTYPES)
        if ops is None or x.dtype != self.dtype or x.dim() != 2 or not all(
                kernel_supports(x.dtype, c.dtype) for c in kv_caches):
            return None
        gemm_ids = self._gemm_ids(ops, x.dtype, x.shape[0])
        if gemm_ids is None:
            return None
        run = functools.partial(ops.decoder_layers, positions=positions, slot_mapping=meta.slot_mapping,
                                block_tables=meta.block_tables, seq_lens=meta.seq_lens,
                                query_start_loc=meta.query_start_loc, scale=self.scale,
                                cos_sin=self.rotary_emb._table(), heads=self.heads, eps=self.eps,
                                batch_invariant=self.batch_invariant)
        if between_layers is None:
            return run(x, kv_caches=kv_caches, norms=self.norms, weights=self.weights, qtypes=self.qtypes,
                       parts=self.parts, biases=self.biases, gemm_ids=gemm_ids)
        residual, start, layers_run = None, 0, torch.zeros(1, dtype=torch.int64)
        while True:  # runs from `start` to the last layer, or to where the flag stops it
            a = self.layer_parts[start]
            x, residual = run(x, kv_caches=kv_caches[start:], norms=self.norms[2 * start:],
                              weights=self.weights[a:], qtypes=self.qtypes[a:], parts=self.parts[4 * start:],
                              biases=self.biases[4 * start:], gemm_ids=gemm_ids[4 * start:], residual=residual,
                              interrupt=between_layers.flag, layers_run=layers_run)
            start += int(layers_run[0])
            if start == len(kv_caches):
                return x, residual
            between_layers()

    def _gemm_ids(self, ops, dtype: torch.dtype, m: int) -> list[int] | None:
        # Per linear, the kernel gguf_linear picks for m rows (the same kernel_choice) as GEMM_IDS codes; None
        # when some weight would go through dequantized tiles instead.
        paths = {q: kernel_choice(ops, dtype, q).path(m, self.batch_invariant) for q in self.qtype_set}
        if "tiles" in paths.values():
            return None
        return [GEMM_IDS[paths[q]] for q in self.linear_qtypes]
