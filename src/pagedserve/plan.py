"""`pagedserve plan`: how many sequences fit in a KV cache budget, paged versus contiguous.

    KV bytes per token = 2 (K and V) x layers x kv_heads x (head_dim x bytes per element [+ 4-byte scale])

(the scale for the 8-bit kinds pagedserve stores, --kv-cache-dtype int8 / fp8_e4m3: kv_dtypes.py)

Paged allocation hands a sequence of L tokens ceil(L / B) blocks of B tokens, so it wastes under one block.
A contiguous allocator that does not know the output length reserves the whole context for every sequence,
so it wastes context - L tokens. The model's config is read as the engine reads it (a GGUF file's metadata is
converted once into the cache; no weights are read), and the KV geometry and the pool's block count come from
the engine's own functions (kv_spec.kv_cache_spec, worker/memory.plan_num_blocks).
"""
from __future__ import annotations

import argparse
import json
import math
import os
from dataclasses import asdict, dataclass
from typing import Any

from pagedserve import kv_dtypes
from pagedserve.kv_spec import KVCacheSpec, kv_cache_spec

GIB = 1 << 30


@dataclass(frozen=True, slots=True)
class PlanModel:
    name: str
    hf_config: Any  # as the engine reads it (model/hf_config.py)

    def kv_spec(self, block_size: int, kv_dtype: str) -> KVCacheSpec:
        try:
            return kv_cache_spec(self.hf_config, block_size, kv_dtype)
        except AttributeError as e:
            raise ValueError(f"{self.name}: the config lacks {e.name} (need num_hidden_layers, "
                             "num_attention_heads, hidden_size or head_dim)") from None

    @property
    def max_context(self) -> int | None:
        ctx = getattr(self.hf_config, "max_position_embeddings", None)
        return int(ctx) if ctx else None


@dataclass(slots=True)
class LengthRow:
    seq_len: int
    paged_seqs: int
    paged_waste: float        # unused fraction of the slots a sequence holds
    contiguous_seqs: int
    contiguous_waste: float


def read_model(model: str | None) -> PlanModel:
    """A GGUF file, an HF directory or its config.json (None: the embedded model)."""
    from pagedserve.model.hf_config import HFConfig, read_config
    from pagedserve.model.loader import resolve_model_dir

    path = None if model is None else os.path.abspath(os.path.expanduser(model))
    if path is not None and os.path.basename(path) == "config.json":
        path = os.path.dirname(path)
    model_dir, name = resolve_model_dir(path, weights=False)
    hf_config = read_config(model_dir)
    text = getattr(hf_config, "text_config", None)
    if not hasattr(hf_config, "num_hidden_layers") and isinstance(text, dict):
        hf_config = HFConfig(**text)  # a multimodal config: its language model holds the KV cache
    return PlanModel(name, hf_config)


def _kv_dtype(name: str) -> str:
    kv = kv_dtypes.canonical(name)
    if kv == "auto":
        raise ValueError("give the KV element type (--kv-cache-dtype float32, bfloat16, float16, fp8_e4m3 or "
                         "int8): auto follows the engine's --dtype, which plan does not know")
    return kv


def length_row(seq_len: int, budget_tokens: int, context: int, block_size: int) -> LengthRow:
    blocks = math.ceil(seq_len / block_size)
    return LengthRow(seq_len=seq_len,
                     paged_seqs=(budget_tokens // block_size) // blocks,
                     paged_waste=1 - seq_len / (blocks * block_size),
                     contiguous_seqs=budget_tokens // context,
                     contiguous_waste=1 - seq_len / context)


def uniform_expectation(budget_tokens: int, context: int, block_size: int) -> dict:
    # Lengths uniform over 1..context: mean slots held per sequence decides how many fit on average.
    mean_len = (context + 1) / 2
    mean_paged = sum(math.ceil(n / block_size) * block_size for n in range(1, context + 1)) / context
    return {"mean_seq_len": mean_len,
            "paged_seqs": budget_tokens / mean_paged, "paged_waste": 1 - mean_len / mean_paged,
            "contiguous_seqs": budget_tokens // context, "contiguous_waste": 1 - mean_len / context}


@dataclass(frozen=True, slots=True)
class DraftPlan:
    # --speculative-config's draft_model: its KV cache shares the budget, as in the engine.
    model: PlanModel
    dtype: str
    num_speculative_tokens: int
    max_num_seqs: int


def _model_dict(name: str, spec: KVCacheSpec, max_context: int | None) -> dict:
    return {"name": name, "num_layers": spec.num_layers, "num_kv_heads": spec.num_kv_heads,
            "head_dim": spec.head_dim, "max_context": max_context}


def plan(model: PlanModel, memory_gib: float, context: int | None, block_size: int, dtype: str,
         seq_lens: list[int] | None, draft: DraftPlan | None = None) -> dict:
    from pagedserve.config import CacheConfig
    from pagedserve.worker.memory import DraftKV, plan_num_blocks

    if memory_gib <= 0 or block_size < 1:
        raise ValueError("--memory-gib must be > 0 and --block-size >= 1")
    spec = model.kv_spec(block_size, _kv_dtype(dtype))
    context = context or model.max_context or 4096
    draft_kv, draft_info = None, None
    if draft is not None:
        from pagedserve.spec_decode.draft_model import num_scratch_blocks

        # Every target block has a draft block beside it; scratch blocks per sequence come off the top.
        draft_spec = draft.model.kv_spec(block_size, _kv_dtype(draft.dtype))
        scratch = draft.max_num_seqs * num_scratch_blocks(draft.num_speculative_tokens, block_size)
        draft_kv = DraftKV(draft_spec.bytes_per_block, scratch)
        draft_info = {"model": _model_dict(draft.model.name, draft_spec, draft.model.max_context),
                      "dtype": draft.dtype, "kv_bytes_per_token": draft_spec.bytes_per_token, "scratch_blocks": scratch}
    budget_blocks = plan_num_blocks(CacheConfig(block_size=block_size), spec.bytes_per_block, int(memory_gib * GIB),
                                    draft_kv)
    budget_tokens = budget_blocks * block_size
    if seq_lens and max(seq_lens) > context:
        raise ValueError(f"--seq-len {max(seq_lens)} exceeds the context of {context} tokens")
    lens = seq_lens or sorted({n for n in (128, 512, 2048, 8192, 32768) if n < context} | {context})
    return {"model": _model_dict(model.name, spec, model.max_context), "dtype": spec.kv_dtype,
            "memory_gib": memory_gib, "block_size": block_size, "context": context,
            "kv_bytes_per_token": spec.bytes_per_token, "budget_tokens": budget_tokens, "budget_blocks": budget_blocks,
            "lengths": [asdict(length_row(n, budget_tokens, context, block_size)) for n in lens],
            "uniform_lengths": uniform_expectation(budget_tokens, context, block_size), "draft": draft_info}


def format_plan(p: dict) -> str:
    m, kv = p["model"], p["dtype"]
    b = kv_dtypes.ELEMENT_BYTES[kv]
    row = (f"({m['head_dim']} x {b} B + {kv_dtypes.SCALE_BYTES} B scale)" if kv in kv_dtypes.QUANTIZED
           else f"{m['head_dim']} x {b} B")
    lines = [f"model          {m['name']}: {m['num_layers']} layers, {m['num_kv_heads']} KV heads x head_dim {m['head_dim']}",
             f"KV per token   2 x {m['num_layers']} x {m['num_kv_heads']} x {row} ({kv}) = "
             f"{p['kv_bytes_per_token']:,} B ({p['kv_bytes_per_token'] / 1024:.1f} KiB)",
             *([f"draft model    {p['draft']['model']['name']} ({p['draft']['dtype']}): "
                f"{p['draft']['kv_bytes_per_token']:,} B per token beside each target token, "
                f"{p['draft']['scratch_blocks']:,} scratch blocks; both inside the budget"] if p.get("draft") else []),
             f"KV budget      {p['memory_gib']:g} GiB = {p['budget_tokens']:,} tokens = {p['budget_blocks']:,} blocks "
             f"of {p['block_size']}",
             f"context        {p['context']:,} tokens (what a contiguous allocator reserves per sequence)", "",
             f"{'seq len':>9} | {'paged seqs':>11} {'waste':>7} | {'contiguous seqs':>16} {'waste':>7} | {'paged/contig':>12}"]
    for r in p["lengths"]:
        ratio = f"{r['paged_seqs'] / r['contiguous_seqs']:.1f}x" if r["contiguous_seqs"] else "n/a"
        contig = f"{r['contiguous_seqs']:>16,} {r['contiguous_waste']:>7.1%}"
        lines.append(f"{r['seq_len']:>9,} | {r['paged_seqs']:>11,} {r['paged_waste']:>7.1%} | {contig} | {ratio:>12}")
    u = p["uniform_lengths"]
    lines += ["", f"lengths uniform over 1..{p['context']:,} (mean {u['mean_seq_len']:,.0f}): paged fits "
              f"{u['paged_seqs']:,.0f} sequences on average, wasting {u['paged_waste']:.1%}; contiguous fits "
              f"{u['contiguous_seqs']:,}, wasting {u['contiguous_waste']:.1%}"]
    return "\n".join(lines)


def add_plan_parser(subparsers) -> None:
    p = subparsers.add_parser("plan", help="KV cache capacity: sequences that fit, paged vs contiguous")
    p.add_argument("--model", default=None, help="GGUF file, HF directory or config.json (default: embedded SmolLM2)")
    p.add_argument("--memory-gib", type=float, required=True, help="memory given to the KV cache, GiB")
    p.add_argument("--context", type=int, default=None, help="max sequence length (default: the model's)")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--kv-cache-dtype", "--dtype", dest="dtype", default="float32",
                   help="KV element type (default float32; int8 and fp8_e4m3 as the engine stores them, with "
                        "scales)")
    p.add_argument("--seq-len", type=int, nargs="+", default=None, help="lengths to tabulate")
    p.add_argument("--draft-model", default=None,
                   help="a draft_model speculative config's draft (GGUF, HF directory or config.json): its KV "
                        "cache shares the budget, as in the engine")
    p.add_argument("--draft-dtype", default="float32", help="the draft's dtype (its KV element type)")
    p.add_argument("--num-speculative-tokens", type=int, default=3)
    p.add_argument("--max-num-seqs", type=int, default=64, help="sequences the draft keeps scratch blocks for")
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    p.set_defaults(func=cmd_plan)


def cmd_plan(args: argparse.Namespace) -> int:
    if args.seq_len and min(args.seq_len) < 1:
        raise ValueError("--seq-len values must be >= 1")
    draft = None if args.draft_model is None else DraftPlan(
        read_model(args.draft_model), args.draft_dtype, args.num_speculative_tokens, args.max_num_seqs)
    result = plan(read_model(args.model), args.memory_gib, args.context, args.block_size, args.dtype, args.seq_len,
                  draft)
    print(json.dumps(result, indent=2) if args.json else format_plan(result))
    return 0
