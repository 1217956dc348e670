"""Decode attention over float32, bf16 and 8-bit KV caches: the compiled kernel against the torch reference path.

    python benchmarks/kv_attention.py --out benchmarks/results/kv_attention.json          # micro-benchmark
    python benchmarks/kv_attention.py --cold --contexts 384 1024 --out ...                   # caches not in cache
    python benchmarks/kv_attention.py --e2e --out ...                                       # + engine decode tok/s
    python benchmarks/kv_attention.py --prefill --isas amx avx512 --out ...                  # prefill steps, per ISA

Micro-benchmark: one layer's decode step of the embedded model's attention shape (9 query heads, 3 kv heads,
head_dim 64, blocks of 16) for 16 sequences at each context length: the kernel writes the new K/V (quantizing
for an 8-bit cache) and attends; "reference" is the torch path 8-bit caches took before the kernel read them
(quantize with torch ops, gather + dequantize the context, SDPA). Every configuration runs once per round,
rounds interleaved, and the median is reported, so load on a shared machine hits all of them alike.
--cold: the same call, but each call reads the next of --cold-layers separate caches (like the model's 30
layers; together larger than the last-level cache), so the KV bytes come from memory as in the engine, where
a step's weights evict them between layers. float32 queries on a float32 cache; bf16 queries (the bf16 model)
on bf16 and int8 caches. Reports ms per call and the GB/s of KV cache read (K and V of every context token).
--prefill: bf16 queries on bf16 and int8 caches, steps shaped like the engine's under its 512-token budget:
a fresh prefill (400 + 112 new tokens), the next chunk over a cached part (112 cached + 288 new, then 224 new),
16 suffixes of 20-60 tokens over a cached 1,000-token shared prefix, and 16 decoding sequences at 400 tokens;
each --isas variant loaded side by side, rounds interleaved (the amx variant differs only in its prefill tiles).
--e2e: the embedded model's engine, 16 prompts of 1,024 random tokens decoding 32 tokens each (ignore_eos):
tokens / time of the steps after every prompt is prefilled, for --kv-cache-dtype auto (float32 here) and int8 with the kernel, and
int8 with --attention-backend reference (the previous int8 path).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import allowed_token_ids, machine_info  # noqa: E402

from pagedserve import kernels  # noqa: E402
from pagedserve.attention import kv_quant  # noqa: E402
from pagedserve.attention.cpu_paged import CpuPagedAttentionBackend  # noqa: E402
from pagedserve.attention.metadata import AttentionMetadata  # noqa: E402
from pagedserve.attention.reference import ReferenceAttentionBackend, write_kv  # noqa: E402

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 9, 3, 64, 16
KV_DTYPES = ("float32", "bfloat16", "int8", "fp8_e4m3")
COLD_CASES = (("float32", torch.float32), ("bfloat16", torch.bfloat16), ("int8", torch.bfloat16))  # kv, query


def decode_metadata(num_seqs: int, context: int) -> AttentionMetadata:
    # Sequence i owns blocks i, i + num_seqs, i + 2 * num_seqs, ...: scattered, as a busy pool leaves them.
    nb = -(-(context + 1) // BLOCK_SIZE)
    tables = torch.tensor([[i + b * num_seqs for b in range(nb)] for i in range(num_seqs)])
    slots = tables[:, context // BLOCK_SIZE] * BLOCK_SIZE + context % BLOCK_SIZE
    lens = [context + 1] * num_seqs
    return AttentionMetadata(slot_mapping=slots, block_tables=tables, seq_lens=torch.tensor(lens),
                             query_start_loc=torch.arange(num_seqs + 1), seq_lens_list=lens,
                             query_lens_list=[1] * num_seqs, block_size=BLOCK_SIZE)


def batch_metadata(seqs: list[tuple[int, int]]) -> AttentionMetadata:
    # seqs: (cached tokens, new tokens) per sequence; blocks interleaved across sequences as in decode_metadata.
    n = len(seqs)
    widths = [-(-(c + q) // BLOCK_SIZE) for c, q in seqs]
    tables = torch.tensor([[i + b * n for b in range(max(widths))] for i in range(n)])
    slots = [tables[i, p // BLOCK_SIZE].item() * BLOCK_SIZE + p % BLOCK_SIZE
             for i, (c, q) in enumerate(seqs) for p in range(c, c + q)]
    lens, qlens = [c + q for c, q in seqs], [q for _, q in seqs]
    starts = torch.tensor([0] + qlens).cumsum(0)
    return AttentionMetadata(slot_mapping=torch.tensor(slots), block_tables=tables, seq_lens=torch.tensor(lens),
                             query_start_loc=starts, seq_lens_list=lens, query_lens_list=qlens,
                             block_size=BLOCK_SIZE)


def filled_cache(kv: str, num_blocks: int, gen: torch.Generator) -> torch.Tensor:
    dtype = kv_quant.storage_dtype(kv)
    cache = torch.zeros(2, num_blocks, BLOCK_SIZE, NUM_KV_HEADS, kv_quant.row_width(dtype, HEAD_DIM), dtype=dtype)
    x = torch.randn(2, num_blocks * BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, generator=gen)
    write_kv(cache, x[0], x[1], torch.arange(num_blocks * BLOCK_SIZE))
    return cache


def micro(num_seqs: int, contexts: list[int], rounds: int) -> list[dict]:
    ops = kernels.load()
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(num_seqs, NUM_HEADS, HEAD_DIM, generator=gen)
    k, v = torch.randn(num_seqs, NUM_KV_HEADS, HEAD_DIM, generator=gen), torch.randn(num_seqs, NUM_KV_HEADS, HEAD_DIM)
    rows = []
    for context in contexts:
        meta = decode_metadata(num_seqs, context)
        num_blocks = meta.block_tables.numel()
        cases = {}
        for kv in KV_DTYPES:
            cache = filled_cache(kv, num_blocks, gen)
            cases[(kv, "kernel")] = (CpuPagedAttentionBackend(ops), cache)
            if kv in ("float32", "int8", "fp8_e4m3"):
                cases[(kv, "reference")] = (ReferenceAttentionBackend(), cache)
        times = {key: [] for key in cases}
        for _ in range(rounds):
            for key, (backend, cache) in cases.items():
                reps = 20 if key[1] == "kernel" else 3
                t0 = time.perf_counter()
                for _ in range(reps):
                    backend.forward(q, k, v, cache, meta, HEAD_DIM ** -0.5)
                times[key].append((time.perf_counter() - t0) / reps * 1e3)
        fp32_kernel = statistics.median(times[("float32", "kernel")])
        for (kv, path), ts in times.items():
            ms = statistics.median(ts)
            rows.append({"num_seqs": num_seqs, "context": context, "kv_cache_dtype": kv, "path": path,
                         "ms_per_call": round(ms, 3), "vs_float32_kernel": round(ms / fp32_kernel, 3)})
            print(f"{num_seqs} x {context:5d}  {kv:9s} {path:9s} {ms:8.3f} ms  x{ms / fp32_kernel:.2f} of fp32 kernel",
                  flush=True)
    return rows


def cold(num_seqs: int, contexts: list[int], rounds: int, num_layers: int) -> list[dict]:
    backend = CpuPagedAttentionBackend(kernels.load())
    gen = torch.Generator().manual_seed(0)
    rows = []
    for context in contexts:
        meta = decode_metadata(num_seqs, context)
        cases = {}
        for kv, q_dtype in COLD_CASES:
            q, k, v = (torch.randn(num_seqs, n, HEAD_DIM, generator=gen).to(q_dtype)
                       for n in (NUM_HEADS, NUM_KV_HEADS, NUM_KV_HEADS))
            cache = filled_cache(kv, meta.block_tables.numel(), gen)
            cases[kv] = (q, k, v, [cache] + [cache.clone() for _ in range(num_layers - 1)])
        times = {kv: [] for kv in cases}
        for _ in range(rounds):
            for kv, (q, k, v, caches) in cases.items():
                t0 = time.perf_counter()
                for cache in caches:
                    backend.forward(q, k, v, cache, meta, HEAD_DIM ** -0.5)
                times[kv].append((time.perf_counter() - t0) / num_layers * 1e3)
        for kv, q_dtype in COLD_CASES:
            caches = cases[kv][3]
            row_bytes = caches[0].size(-1) * caches[0].element_size()
            kv_bytes = 2 * num_seqs * (context + 1) * NUM_KV_HEADS * row_bytes  # K and V read per call
            ms = statistics.median(times[kv])
            rows.append({"num_seqs": num_seqs, "context": context, "kv_cache_dtype": kv,
                         "query_dtype": str(q_dtype).removeprefix("torch."), "layers": num_layers,
                         "caches_mb": round(num_layers * caches[0].nbytes / 1e6), "ms_per_call": round(ms, 3),
                         "kv_gb_s": round(kv_bytes / ms / 1e6, 2), "ms_all_rounds": [round(t, 3) for t in times[kv]]})
            print(f"cold {num_seqs} x {context:5d}  {kv:9s} {ms:8.3f} ms  {kv_bytes / ms / 1e6:6.2f} GB/s of KV",
                  flush=True)
        del cases
    return rows


PREFILL_STEPS = {
    "prefill 400+112": [(0, 400), (0, 112)],
    "chunk 112+288, 224": [(112, 288), (0, 224)],
    "shared 1000 + 16x20-60": [(1000, 20 + (40 * i) // 15) for i in range(16)],
    "decode 16 x 400": [(399, 1)] * 16,
}


def prefill(rounds: int, isas: list[str]) -> list[dict]:
    backends = {name: CpuPagedAttentionBackend(kernels.load_isa(name)) for name in isas}
    gen = torch.Generator().manual_seed(0)
    rows = []
    for step, seqs in PREFILL_STEPS.items():
        meta = batch_metadata(seqs)
        n = sum(q for _, q in seqs)
        q, k, v = (torch.randn(n, h, HEAD_DIM, generator=gen).to(torch.bfloat16)
                   for h in (NUM_HEADS, NUM_KV_HEADS, NUM_KV_HEADS))
        caches = {kv: filled_cache(kv, meta.block_tables.numel(), gen) for kv in ("bfloat16", "int8")}
        times = {(kv, name): [] for kv in caches for name in backends}
        reps = 20 if step.startswith("decode") else 3
        for _ in range(rounds):
            for kv, name in times:
                t0 = time.perf_counter()
                for _ in range(reps):
                    backends[name].forward(q, k, v, caches[kv], meta, HEAD_DIM ** -0.5)
                times[(kv, name)].append((time.perf_counter() - t0) / reps * 1e3)
        for kv, name in times:
            ms, base = statistics.median(times[(kv, name)]), statistics.median(times[(kv, isas[-1])])
            rows.append({"step": step, "seqs": seqs, "kv_cache_dtype": kv, "isa": name, "ms_per_call": round(ms, 3),
                         f"vs_{isas[-1]}": round(ms / base, 3)})
            print(f"{step:24s} {kv:9s} {name:8s} {ms:8.3f} ms  x{ms / base:.2f} of {isas[-1]}", flush=True)
    return rows


def e2e(num_prompts: int, input_len: int, output_len: int) -> list[dict]:
    # Decode tok/s: tokens generated by the steps after every request has its first token, over those steps'
    # time (the prefill steps are left out; all requests decode together until they finish together).
    import random

    from pagedserve import LLM, SamplingParams

    rows, prompts = [], None
    for kv, backend in (("auto", "auto"), ("int8", "auto"), ("int8", "reference")):
        llm = LLM(kv_cache_dtype=kv, attention_backend=backend, max_num_seqs=num_prompts,
                  max_model_len=input_len + output_len + 16)
        engine = llm.llm_engine
        if prompts is None:
            ids = allowed_token_ids(llm.get_tokenizer(), engine.hf_config.vocab_size)
            rng = random.Random(0)
            prompts = [{"prompt_token_ids": [rng.choice(ids) for _ in range(input_len)]} for _ in range(num_prompts)]
        params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
        engine.add_requests([(f"r{i}", p, params) for i, p in enumerate(prompts)])
        started: set[str] = set()
        while len(started) < num_prompts:
            started.update(o.request_id for o in engine.step())
        n_tokens, t0 = 0, time.perf_counter()
        while engine.has_unfinished_requests():
            n_tokens += len(engine.step())  # one new token per running request and step
        elapsed = time.perf_counter() - t0
        rows.append({"kv_cache_dtype": engine.core.config.cache.cache_dtype, "attention_backend": backend,
                     "num_prompts": num_prompts, "input_len": input_len, "output_len": output_len,
                     "decode_tokens": n_tokens, "decode_s": round(elapsed, 2),
                     "decode_tok_s": round(n_tokens / elapsed, 1)})
        print(rows[-1], flush=True)
        del llm, engine
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--num-seqs", type=int, default=16)
    p.add_argument("--contexts", type=int, nargs="+", default=[1024, 2048])
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--num-threads", type=int, default=None)
    p.add_argument("--cold", action="store_true", help="micro-benchmark over separate per-layer caches instead")
    p.add_argument("--cold-layers", type=int, default=30)
    p.add_argument("--prefill", action="store_true", help="prefill-shaped steps, bf16, per --isas variant")
    p.add_argument("--isas", nargs="+", default=["amx", "avx512"], help="--prefill: variants, baseline last")
    p.add_argument("--e2e", action="store_true", help="also engine decode tok/s, int8 vs auto")
    p.add_argument("--no-micro", action="store_true", help="skip the micro-benchmark")
    p.add_argument("--e2e-prompts", type=int, default=16)
    p.add_argument("--e2e-input-len", type=int, default=1024)
    p.add_argument("--e2e-output-len", type=int, default=32)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    if args.num_threads:
        torch.set_num_threads(args.num_threads)
    info = machine_info()
    result = {"machine": info, "kernel_isa": kernels.selected_isa(), "command": " ".join(sys.argv),
              "shape": {"num_heads": NUM_HEADS, "num_kv_heads": NUM_KV_HEADS, "head_dim": HEAD_DIM,
                        "block_size": BLOCK_SIZE},
              "micro": []}
    if args.prefill:
        result["prefill"] = prefill(args.rounds, args.isas)
    elif args.cold and not args.no_micro:
        result["cold"] = cold(args.num_seqs, args.contexts, args.rounds, args.cold_layers)
    elif not args.no_micro:
        result["micro"] = micro(args.num_seqs, args.contexts, args.rounds)
    if args.e2e:
        result["e2e"] = e2e(args.e2e_prompts, args.e2e_input_len, args.e2e_output_len)
    result["load_avg_1_5_15_end"] = list(os.getloadavg())
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            json.dump(result, f, indent=2)
            f.write("\n")


if __name__ == "__main__":
    main()
