"""Tensor parallelism on paper: what splitting a Llama across N ranks buys, from bytes moved and FLOPs done.

No model runs here; every number comes from the formulas below and the hardware constants (vendor specs,
named in HARDWARE), so the table can be checked by hand. docs/tensor_parallel.md explains the model.

Per step of B tokens on each rank (weights W bytes, L layers, hidden h, b bytes per value):
    compute   2 * params * B / N FLOPs            (matmuls; attention over the context is added as KV reads)
    memory    W / N + KV bytes read / N           (decode is bound by this)
    traffic   (2L + 1) all-reduces of B*h*b bytes (o_proj and down_proj per layer, the embedding)
              + 1 all-gather of B_sampled * vocab * b bytes (the logits)
    a ring all-reduce moves 2(N-1)/N of the message per rank, an all-gather (N-1)/N; each collective also pays
    a fixed latency alpha.
    step time = max(compute / peak FLOPs, memory / memory bandwidth) + traffic / link bandwidth + alpha * count

Usage: python benchmarks/tp_paper.py [--json results/tp_paper.json]
"""
from __future__ import annotations

import argparse
import json
from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class Model:
    name: str
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    vocab: int
    tied: bool

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @property
    def layer_params(self) -> int:
        h, d = self.hidden, self.head_dim
        return h * (self.heads + 2 * self.kv_heads) * d + self.heads * d * h + 3 * h * self.intermediate

    @property
    def params(self) -> int:  # matmul weights read per token (the embedding lookup reads one row)
        return self.layers * self.layer_params + self.vocab * self.hidden

    def kv_bytes_per_token(self, b: int) -> int:
        return 2 * self.layers * self.kv_heads * self.head_dim * b


@dataclass(frozen=True)
class Hardware:
    name: str
    flops: float          # peak per rank, at the dtype used
    mem_bw: float         # bytes/s per rank
    link_bw: float        # bytes/s per rank per direction, for collectives
    alpha: float          # fixed latency per collective, seconds
    dtype_bytes: int
    capacity: float       # bytes of memory per rank (weights + KV must fit)
    efficiency: float = 0.6  # fraction of peak FLOPs / bandwidth a real kernel reaches


MODELS = {
    "smollm2-135m": Model("SmolLM2-135M (embedded)", 576, 30, 9, 3, 1536, 49152, True),
    "llama-2-7b": Model("Llama-2-7B", 4096, 32, 32, 32, 11008, 32000, False),
    "llama-3-70b": Model("Llama-3-70B", 8192, 80, 64, 8, 28672, 128256, False),
}

HARDWARE = {
    # One socket of a 2-socket Xeon 8480+ (Sapphire Rapids): 8 x DDR5-4800 = 307 GB/s, 56 cores x AVX-512
    # (2 FMA x 16 fp32 lanes x 2 FLOP x 2.0 GHz) = 7.2 TFLOP/s fp32; 4 UPI 2.0 links at 16 GT/s ~ 100 GB/s
    # per direction in practice. alpha: gloo over loopback TCP (60 us assumed; benchmarks/tp_allreduce.py
    # measures it) vs a shared-memory all-reduce (a few microseconds; what vLLM's CPU backend uses).
    "xeon-socket-gloo": Hardware("2-socket Xeon, 1 rank/socket, gloo", 7.2e12, 307e9, 100e9, 60e-6, 4, 512e9),
    "xeon-socket-shm": Hardware("2-socket Xeon, 1 rank/socket, shm all-reduce", 7.2e12, 307e9, 100e9, 5e-6, 4, 512e9),
    # H100 SXM5: 989 TFLOP/s dense bf16, 3.35 TB/s HBM3, NVLink 4 450 GB/s per direction; NCCL small-message
    # all-reduce ~10 us. The same GPUs on PCIe Gen5 x16 (64 GB/s per direction, no NVLink): ~25 us.
    "h100-nvlink": Hardware("H100 SXM, NVLink 4, NCCL", 989e12, 3.35e12, 450e9, 10e-6, 2, 80e9),
    "h100-pcie": Hardware("H100, PCIe Gen5 only, NCCL", 989e12, 3.35e12, 64e9, 25e-6, 2, 80e9),
}


def step_time(m: Model, hw: Hardware, n: int, tokens: int, sampled: int, context: int) -> dict:
    b = hw.dtype_bytes
    compute = 2 * m.params * tokens / n / (hw.flops * hw.efficiency)
    kv_read = sampled * context * m.kv_bytes_per_token(b)  # decode: each sequence reads its context once
    memory = (m.params * b + kv_read) / n / (hw.mem_bw * hw.efficiency)
    num_collectives = 2 * m.layers + 2 if n > 1 else 0
    ar_bytes = (2 * m.layers + 1) * tokens * m.hidden * b
    ag_bytes = sampled * m.vocab * b
    wire = (2 * (n - 1) / n * ar_bytes + (n - 1) / n * ag_bytes) if n > 1 else 0.0
    comm = wire / hw.link_bw + num_collectives * hw.alpha
    resident_gb = (m.params * b + kv_read) / n / 1e9  # weights + the batch's KV cache, per rank
    return {"resident_gb_per_rank": resident_gb, "fits": resident_gb * 1e9 <= hw.capacity * 0.9,
            "compute_ms": compute * 1e3, "memory_ms": memory * 1e3, "comm_ms": comm * 1e3,
            "wire_bytes_per_rank": wire, "allreduce_bytes_per_layer_per_token": 2 * m.hidden * b,
            "num_collectives": num_collectives, "step_ms": (max(compute, memory) + comm) * 1e3}


CASES = [
    # (model, hardware, N values, label, tokens in the step, sampled sequences, context per sequence)
    ("smollm2-135m", "xeon-socket-gloo", [1, 2], "decode, batch 1", 1, 1, 512),
    ("smollm2-135m", "xeon-socket-gloo", [1, 2], "decode, batch 64", 64, 64, 512),
    ("llama-2-7b", "xeon-socket-gloo", [1, 2], "decode, batch 1", 1, 1, 1024),
    ("llama-2-7b", "xeon-socket-shm", [1, 2], "decode, batch 1", 1, 1, 1024),
    ("llama-2-7b", "xeon-socket-shm", [1, 2], "decode, batch 32", 32, 32, 1024),
    ("llama-2-7b", "xeon-socket-shm", [1, 2], "prefill 2048", 2048, 1, 0),
    ("llama-2-7b", "h100-nvlink", [1, 2], "decode, batch 64", 64, 64, 2048),
    ("llama-3-70b", "h100-nvlink", [2, 4, 8], "decode, batch 64", 64, 64, 2048),
    ("llama-3-70b", "h100-pcie", [2, 4, 8], "decode, batch 64", 64, 64, 2048),
    ("llama-3-70b", "h100-nvlink", [2, 4, 8], "prefill 8192", 8192, 1, 0),
    ("llama-3-70b", "h100-pcie", [2, 4, 8], "prefill 8192", 8192, 1, 0),
]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", help="also write the rows here")
    args = ap.parse_args()
    rows = []
    print("| model | hardware | step | N | GB/rank | compute ms | memory ms | comm ms | step ms | speedup |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for model_key, hw_key, ns, label, tokens, sampled, context in CASES:
        m, hw = MODELS[model_key], HARDWARE[hw_key]
        base = None
        for n in ns:
            r = step_time(m, hw, n, tokens, sampled, context)
            base = base or r["step_ms"]
            rows.append({"model": m.name, "hardware": hw.name, "step": label, "n": n, **r})
            fits = f"{r['resident_gb_per_rank']:.1f}" + ("" if r["fits"] else " (does not fit)")
            print(f"| {m.name} | {hw.name} | {label} | {n} | {fits} | {r['compute_ms']:.3f} | {r['memory_ms']:.3f} | "
                  f"{r['comm_ms']:.3f} | {r['step_ms']:.3f} | {base / r['step_ms']:.2f}x |")
    print()
    for m in MODELS.values():
        print(f"{m.name}: {m.params / 1e9:.3f} B matmul params, all-reduce per layer per token "
              f"{2 * m.hidden * 2} B (bf16) / {2 * m.hidden * 4} B (fp32), "
              f"{2 * m.layers + 2} collectives per step")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"models": {k: asdict(v) for k, v in MODELS.items()},
                       "hardware": {k: asdict(v) for k, v in HARDWARE.items()}, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
