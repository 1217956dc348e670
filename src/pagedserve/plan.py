"""`pagedserve plan`: how many sequences fit in a KV cache budget, paged versus contiguous.

    KV bytes per token = 2 (K and V) x layers x kv_heads x (head_dim x bytes per element [+ 4-byte scale])

(the scale for the 8-bit kinds pagedserve stores, --kv-cache-dtype int8 / fp8_e4m3: kv_dtypes.py)

Paged allocation hands a sequence of L tokens ceil(L / B) blocks of B tokens, so it wastes under one block.
A contiguous allocator that does not know the output length reserves the whole context for every sequence,
so it wastes context - L tokens. The numbers come from the model's config alone (no weights are read).
"""
from __future__ import annotations

import argparse
import json
import math
import os
from dataclasses import asdict, dataclass

from pagedserve.kv_dtypes import ALIASES, ELEMENT_BYTES, QUANTIZED, SCALE_BYTES, bytes_per_token

DTYPE_BYTES = {"float32": 4, "fp32": 4, "float": 4, "float16": 2, "fp16": 2, "half": 2, "bfloat16": 2, "bf16": 2,
               "fp8": 1, "fp8_e4m3": 1, "fp8_e5m2": 1, "float8": 1, "int8": 1}
GIB = 1 << 30


@dataclass(frozen=True, slots=True)
class KVShape:
    name: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    max_context: int | None


@dataclass(slots=True)
class LengthRow:
    seq_len: int
    paged_seqs: int
    paged_waste: float        # unused fraction of the slots a sequence holds
    contiguous_seqs: int
    contiguous_waste: float


def kv_bytes_per_token(shape: KVShape, dtype_bytes: int) -> int:
    return 2 * shape.num_layers * shape.num_kv_heads * shape.head_dim * dtype_bytes


def _per_token(shape: KVShape, dtype: str) -> int:
    # The engine's own arithmetic for the dtypes it stores (8-bit ones carry scales), plain bytes otherwise.
    kv = ALIASES.get(dtype, dtype)
    if kv in ELEMENT_BYTES:
        return bytes_per_token(kv, shape.num_layers, shape.num_kv_heads, shape.head_dim)
    return kv_bytes_per_token(shape, DTYPE_BYTES[dtype])


def _hf_shape(cfg: dict, name: str) -> KVShape:
    # Multimodal configs keep the language model's numbers under text_config.
    if "num_hidden_layers" not in cfg and isinstance(cfg.get("text_config"), dict):
        cfg = cfg["text_config"]
    try:
        layers, heads = int(cfg["num_hidden_layers"]), int(cfg["num_attention_heads"])
        kv_heads = int(cfg.get("num_key_value_heads") or heads)
        head_dim = int(cfg.get("head_dim") or int(cfg["hidden_size"]) // heads)
    except (KeyError, TypeError, ValueError) as e:
        raise ValueError(f"{name}: config lacks a usable {e} (need num_hidden_layers, num_attention_heads, "
                         "hidden_size or head_dim)") from e
    ctx = cfg.get("max_position_embeddings")
    return KVShape(name, layers, kv_heads, head_dim, int(ctx) if ctx else None)


def _gguf_shape(path: str) -> KVShape:
    from gguf import GGUFReader

    try:
        reader = GGUFReader(path)
    except Exception as e:  # noqa: BLE001 - corrupt files fail inside numpy or struct
        raise ValueError(f"cannot read GGUF metadata from {path}: {e}") from e

    def field(key: str):
        f = reader.fields.get(key)
        if f is None:
            return None
        value = f.parts[f.data[0]]
        return bytes(value).decode() if f.types and f.types[0].name == "STRING" else value.tolist()[0]

    arch = field("general.architecture")
    layers, heads = field(f"{arch}.block_count"), field(f"{arch}.attention.head_count")
    if layers is None or heads is None:
        raise ValueError(f"{path}: GGUF metadata lacks {arch}.block_count or {arch}.attention.head_count")
    kv_heads = field(f"{arch}.attention.head_count_kv") or heads
    head_dim = field(f"{arch}.attention.key_length") or field(f"{arch}.embedding_length") // heads
    name = os.path.splitext(os.path.basename(path))[0]
    return KVShape(name, int(layers), int(kv_heads), int(head_dim), field(f"{arch}.context_length"))


def read_shape(model: str | None) -> KVShape:
    if model is None:
        from pagedserve.model.loader import default_model_path

        model = default_model_path()
    path = os.path.abspath(os.path.expanduser(model))
    if os.path.isdir(path):
        path = os.path.join(path, "config.json")
    if not os.path.isfile(path):
        raise ValueError(f"model not found: {model} (expected a GGUF file, an HF directory or its config.json)")
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic == b"GGUF":
        return _gguf_shape(path)
    try:
        with open(path, encoding="utf-8") as f:
            cfg = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path} is neither a GGUF file nor a JSON config: {e}") from e
    if not isinstance(cfg, dict):
        raise ValueError(f"{path}: expected a JSON object (a Hugging Face config.json)")
    return _hf_shape(cfg, os.path.basename(os.path.dirname(path)) or path)


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
    # --speculative-config's draft_model: its KV cache shares the budget (worker/memory.py does the same).
    shape: KVShape
    dtype: str
    num_speculative_tokens: int
    max_num_seqs: int


def plan(shape: KVShape, memory_gib: float, context: int | None, block_size: int, dtype: str,
         seq_lens: list[int] | None, draft: DraftPlan | None = None) -> dict:
    if dtype.lower() not in DTYPE_BYTES or (draft and draft.dtype.lower() not in DTYPE_BYTES):
        raise ValueError(f"unknown --dtype {dtype!r}; one of {', '.join(DTYPE_BYTES)}")
    if memory_gib <= 0 or block_size < 1:
        raise ValueError("--memory-gib must be > 0 and --block-size >= 1")
    context = context or shape.max_context or 4096
    per_token = _per_token(shape, dtype.lower())
    budget_bytes = int(memory_gib * GIB)
    draft_info = None
    if draft is not None:
        from pagedserve.spec_decode.draft_model import num_scratch_blocks

        # Every target block has a draft block beside it; scratch blocks per sequence come off the top.
        draft_per_token = _per_token(draft.shape, draft.dtype.lower())
        scratch = draft.max_num_seqs * num_scratch_blocks(draft.num_speculative_tokens, block_size)
        budget_bytes -= scratch * block_size * draft_per_token
        draft_info = {"model": asdict(draft.shape), "dtype": draft.dtype, "kv_bytes_per_token": draft_per_token,
                      "scratch_blocks": scratch}
    budget_tokens = max(budget_bytes, 0) // (per_token + (draft_info["kv_bytes_per_token"] if draft else 0))
    budget_tokens -= budget_tokens % block_size  # the pool holds whole blocks only
    if seq_lens and max(seq_lens) > context:
        raise ValueError(f"--seq-len {max(seq_lens)} exceeds the context of {context} tokens")
    lens = seq_lens or sorted({n for n in (128, 512, 2048, 8192, 32768) if n < context} | {context})
    return {"model": asdict(shape), "dtype": dtype, "memory_gib": memory_gib, "block_size": block_size,
            "context": context, "kv_bytes_per_token": per_token, "budget_tokens": budget_tokens,
            "budget_blocks": budget_tokens // block_size,
            "lengths": [asdict(length_row(n, budget_tokens, context, block_size)) for n in lens],
            "uniform_lengths": uniform_expectation(budget_tokens, context, block_size), "draft": draft_info}


def format_plan(p: dict) -> str:
    m, b = p["model"], DTYPE_BYTES[p["dtype"].lower()]
    kv = ALIASES.get(p["dtype"].lower(), p["dtype"].lower())
    row = f"({m['head_dim']} x {b} B + {SCALE_BYTES} B scale)" if kv in QUANTIZED else f"{m['head_dim']} x {b} B"
    lines = [f"model          {m['name']}: {m['num_layers']} layers, {m['num_kv_heads']} KV heads x head_dim {m['head_dim']}",
             f"KV per token   2 x {m['num_layers']} x {m['num_kv_heads']} x {row} ({p['dtype']}) = "
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
        read_shape(args.draft_model), args.draft_dtype, args.num_speculative_tokens, args.max_num_seqs)
    result = plan(read_shape(args.model), args.memory_gib, args.context, args.block_size, args.dtype, args.seq_len,
                  draft)
    print(json.dumps(result, indent=2) if args.json else format_plan(result))
    return 0
