"""paged_attention alone, over the shapes of the models people run: decode at short and long contexts, a prefill.

    python benchmarks/attention_shapes.py --before HEAD~1 --out benchmarks/results/attention_shapes.json
    python benchmarks/attention_shapes.py --isa avx2 --shapes llama-1b gemma-1b --contexts 10 --num-seqs 1

Each configuration is one kernel call (ops.paged_attention: write this step's K/V, attend) on a hot cache, blocks
of 16, sequence i owning blocks i, i + n, i + 2n, ... (scattered): decode of --num-seqs sequences at each
--contexts length, and a prompt of each --prefill-len after each --prefix-len cached tokens (a chunk of a longer
prompt, or a prompt over a cached prefix). float32 and bf16 (queries, K/V and cache alike).
--before REF also builds paged_attention.cpp as it was at git REF (into its own op namespace, beside this
tree's) and times both, interleaved round by round and configuration by configuration, so that load from
other processes on a shared machine hits both alike; each number is the median over --rounds.
--sdpa also times torch.nn.functional.scaled_dot_product_attention (CPU flash attention) on each prefill
without a cached prefix. --window W / --softcap C time paged_attention_windowed instead (Gemma's sliding layers:
window 512 on Gemma-3-1B, 4096 and cap 50 on Gemma 2), and --cpu-time counts this process's CPU time, not wall
time (with --num-threads 1, steadier on a loaded machine):

    python benchmarks/attention_shapes.py --before HEAD~1 --shapes gemma-3-1b --window 512 --num-seqs 1 \
        --contexts 1000 --prefill-len 1024 --dtypes float32 bfloat16 --num-threads 1 --cpu-time
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import machine_info, write_json  # noqa: E402

from pagedserve import envs, kernels  # noqa: E402
from pagedserve.kernels import isa  # noqa: E402

BLOCK_SIZE = 16
# name: (query heads, kv heads, head_dim)
SHAPES = {
    "llama-1b": (32, 8, 64),
    "llama-3b": (24, 8, 128),
    "qwen2.5-1.5b": (12, 2, 128),
    "gemma-1b": (8, 4, 256),
    "gemma-3-1b": (4, 1, 256),
    "smollm2-135m": (9, 3, 64),
    "64h-8kv-128": (64, 8, 128),
    "phi-like": (16, 16, 96),
}
CSRC = os.path.join(os.path.dirname(os.path.abspath(kernels.__file__)), "csrc")


def build_before(ref: str, variant_name: str):
    # paged_attention.cpp and the headers of csrc/ at git `ref`, compiled alone with the variant's flags into the
    # namespace pagedserve_before_<variant> (cached by cpp_extension under the pagedserve cache directory).
    (variant,) = isa.choose(variant_name)
    root = subprocess.run(["git", "rev-parse", "--show-toplevel"], cwd=CSRC, capture_output=True, text=True,
                          check=True).stdout.strip()
    commit = subprocess.run(["git", "rev-parse", ref], cwd=root, capture_output=True, text=True,
                            check=True).stdout.strip()
    src_dir = os.path.join(tempfile.gettempdir(), f"pagedserve-before-{commit[:12]}")
    rel = os.path.relpath(CSRC, root)
    if not os.path.isdir(src_dir):
        os.makedirs(src_dir)
        archive = subprocess.run(["git", "archive", commit, rel], cwd=root, capture_output=True, check=True).stdout
        subprocess.run(["tar", "-x", "-C", src_dir, "--strip-components", str(len(rel.split(os.sep)))],
                       input=archive, check=True)
    namespace = f"pagedserve_before_{variant.name}"
    flags = [f for f in kernels._cflags(variant) if not f.startswith("-DPAGEDSERVE_OPS_NS=")]
    from torch.utils.cpp_extension import load as cpp_load

    build_dir = os.path.join(envs.cache_dir(), "kernels", f"before-{variant.name}-{commit[:12]}")
    os.makedirs(build_dir, exist_ok=True)
    cpp_load(name=f"{namespace}_{commit[:12]}", sources=[os.path.join(src_dir, "paged_attention.cpp")],
             build_directory=build_dir, extra_cflags=[*flags, f"-DPAGEDSERVE_OPS_NS={namespace}"],
             extra_ldflags=kernels._LDFLAGS, is_python_module=False, verbose=False)
    return getattr(torch.ops, namespace), commit


def decode_inputs(num_seqs: int, context: int, heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype,
                  gen: torch.Generator) -> tuple:
    nb = -(-(context + 1) // BLOCK_SIZE)
    tables = torch.tensor([[i + b * num_seqs for b in range(nb)] for i in range(num_seqs)])
    slots = tables[:, context // BLOCK_SIZE] * BLOCK_SIZE + context % BLOCK_SIZE
    lens = torch.full((num_seqs,), context + 1)
    return (*new_tokens(num_seqs, heads, kv_heads, head_dim, dtype, gen), cache(tables.numel(), kv_heads, head_dim,
                                                                             dtype, gen),
            slots, tables, lens, torch.arange(num_seqs + 1))


def prefill_inputs(n: int, heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype,
                   gen: torch.Generator, prefix: int = 0) -> tuple:
    # n new tokens after `prefix` cached ones (a chunk of a longer prompt, or a prompt over a cached prefix).
    nb = -(-(prefix + n) // BLOCK_SIZE)
    tables = torch.arange(nb)[None]
    return (*new_tokens(n, heads, kv_heads, head_dim, dtype, gen), cache(nb, kv_heads, head_dim, dtype, gen),
            torch.arange(prefix, prefix + n), tables, torch.tensor([prefix + n]), torch.tensor([0, n]))


def new_tokens(n: int, heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype, gen: torch.Generator):
    return tuple(torch.randn(n, h, head_dim, generator=gen).to(dtype) for h in (heads, kv_heads, kv_heads))


def cache(num_blocks: int, kv_heads: int, head_dim: int, dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    return torch.randn(2, num_blocks, BLOCK_SIZE, kv_heads, head_dim, generator=gen).to(dtype)


def sdpa_call(args: tuple, scale: float):
    # torch's CPU flash attention on the same prompt (no cached prefix: is_causal aligns the first query with the
    # first key), with the K/V it would get as contiguous tensors; the kernel also writes the cache.
    q, k, v = (x.transpose(0, 1)[None] for x in args[:3])
    return lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale,
                                                                    enable_gqa=True)


def time_variants(variants: dict, args: tuple, scale: float, rounds: int, window: int = 0, softcap: float = 0.0,
                  clock=time.perf_counter, extra: dict | None = None) -> dict[str, float]:
    # Microseconds per call, median over rounds; each round runs every variant (and each of `extra`'s calls) for
    # about 20 ms.
    if window or softcap:
        calls = {name: (lambda ops=ops: ops.paged_attention_windowed(*args, scale, -1, window, softcap, False))
                 for name, ops in variants.items()}
    else:
        calls = {name: (lambda ops=ops: ops.paged_attention(*args, scale, -1)) for name, ops in variants.items()}
    calls.update(extra or {})
    reps = {}
    for name, call in calls.items():
        call()
        t0 = clock()
        call()
        reps[name] = max(1, min(300, int(0.02 / max(clock() - t0, 1e-7))))
    times = {name: [] for name in calls}
    for _ in range(rounds):
        for name, call in calls.items():
            t0 = clock()
            for _ in range(reps[name]):
                call()
            times[name].append((clock() - t0) / reps[name] * 1e6)
    return {name: statistics.median(ts) for name, ts in times.items()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--isa", default=None, help="kernel variant (default: this process's choice)")
    p.add_argument("--before", default=None, help="git ref whose paged_attention.cpp is timed beside this tree's")
    p.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    p.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    p.add_argument("--num-seqs", type=int, nargs="+", default=[1, 16])
    p.add_argument("--contexts", type=int, nargs="+", default=[10, 100, 1000, 4000])
    p.add_argument("--prefill-len", type=int, nargs="+", default=[512], help="0: no prefill")
    p.add_argument("--prefix-len", type=int, nargs="+", default=[0], help="cached tokens before each prefill")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--num-threads", type=int, default=None)
    p.add_argument("--window", type=int, default=0, help="> 0: paged_attention_windowed with this window")
    p.add_argument("--softcap", type=float, default=0.0, help="> 0: paged_attention_windowed with this score cap")
    p.add_argument("--cpu-time", action="store_true", help="time by this process's CPU time, not wall time")
    p.add_argument("--sdpa", action="store_true", help="also time torch's SDPA on prefills without a cached prefix")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    if args.num_threads:
        torch.set_num_threads(args.num_threads)
    isa_name = args.isa or kernels.selected_isa()
    variants = {}
    commit = None
    if args.before:
        variants["before"], commit = build_before(args.before, isa_name)
    variants["after"] = kernels.load_isa(isa_name)
    result = {"machine": machine_info(), "isa": isa_name, "command": " ".join(sys.argv), "before_commit": commit,
              "block_size": BLOCK_SIZE, "window": args.window, "softcap": args.softcap,
              "unit": f"microseconds ({'CPU' if args.cpu_time else 'wall'}) per paged_attention call, median of rounds",
              "rows": []}
    clock = time.process_time if args.cpu_time else time.perf_counter
    gen = torch.Generator().manual_seed(0)
    configs = [("decode", n, c) for n in args.num_seqs for c in args.contexts]
    configs += [("prefill", prefix, n) for n in args.prefill_len if n for prefix in args.prefix_len]
    for shape in args.shapes:
        heads, kv_heads, head_dim = SHAPES[shape]
        for dtype_name in args.dtypes:
            dtype = getattr(torch, dtype_name)
            for kind, num_seqs, tokens in configs:
                inputs = (decode_inputs(num_seqs, tokens, heads, kv_heads, head_dim, dtype, gen) if kind == "decode"
                          else prefill_inputs(tokens, heads, kv_heads, head_dim, dtype, gen, num_seqs))
                sdpa = args.sdpa and kind == "prefill" and num_seqs == 0 and not (args.window or args.softcap)
                extra = {"sdpa": sdpa_call(inputs, head_dim ** -0.5)} if sdpa else None
                us = time_variants(variants, inputs, head_dim ** -0.5, args.rounds, args.window, args.softcap, clock,
                                   extra)
                row = {"shape": shape, "num_heads": heads, "num_kv_heads": kv_heads, "head_dim": head_dim,
                       "dtype": dtype_name, "kind": kind,
                       **({"num_seqs": num_seqs, "context": tokens} if kind == "decode"
                          else {"prefix_len": num_seqs, "prompt_len": tokens}),
                       **{f"us_{name}": round(t, 1) for name, t in us.items()}}
                if "before" in us:
                    row["speedup"] = round(us["before"] / us["after"], 2)
                result["rows"].append(row)
                print(f"{shape:13s} {dtype_name:8s} {kind:7s} {num_seqs:5d} {'x' if kind == 'decode' else '+'} {tokens:5d}  "
                      + "  ".join(f"{name} {t:9.1f} us" for name, t in us.items())
                      + (f"  x{row['speedup']:.2f}" if "speedup" in row else ""), flush=True)
                del inputs
    result["load_avg_1_5_15_end"] = list(os.getloadavg())
    if args.out:
        write_json(args.out, result)


if __name__ == "__main__":
    main()
