"""worker/gemm_caches.py: torch's CPU bf16 GEMM keeps one cache entry per row count; bounded, memory stays flat.

Each case runs in a fresh process (the capacities are read at the first GEMM) and multiplies x [m, 576] by one
[3072, 576] weight for 300 row counts m, as prefills of 300 prompt lengths do, and reports its RSS growth over
the last 200.
"""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from pagedserve.worker.gemm_caches import CACHE_CAPACITY, CAPACITY_VARIABLES

SCRIPT = """
import sys, torch
from pagedserve.worker.gemm_caches import bound_gemm_caches
if sys.argv[1] == "bounded":
    bound_gemm_caches()
torch.set_num_threads(1)
def rss_mb():
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS")) / 1024
w = torch.randn(3072, 576, dtype=torch.bfloat16)
x = torch.randn(65, 576, dtype=torch.bfloat16)
first = x @ w.t()
for m in range(67, 667, 2):
    torch.randn(m, 576, dtype=torch.bfloat16) @ w.t()
    if m == 265:
        start = rss_mb()  # 100 row counts in: a bounded cache is full, the libraries' one-time state is made
again = x @ w.t()  # its cache entry evicted long ago when bounded: built again, the same product
assert torch.equal(first, again)
assert torch.allclose(first.float(), x.float() @ w.float().t(), rtol=2e-2, atol=0.5)
print(rss_mb() - start)
"""


def _growth_mb(mode: str) -> float:
    env = {k: v for k, v in os.environ.items() if k not in CAPACITY_VARIABLES}
    out = subprocess.run([sys.executable, "-c", SCRIPT, mode], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    return float(out.stdout.split()[-1])


def test_bounded_caches_keep_memory_flat():
    if not (torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()):
        # AVX2-only CPUs: torch's bf16 matmul does not go through oneDNN (no entry per shape to bound)
        pytest.skip("oneDNN takes no bf16 GEMM on this CPU: nothing caches per shape")
    unbounded, bounded = _growth_mb("default"), _growth_mb("bounded")
    # ~0.8 MB per row count at the libraries' default capacities (1,024 entries); bounded, the caches are full
    # long before the first 100 and stay at their size (measured: 160 vs 0-11 MB: what remains is the heap's
    # high-water mark for x and y, which grow with m to 0.8 and 4 MB, not the caches).
    assert unbounded > 80, unbounded
    assert bounded < 30 and bounded < unbounded / 4, (bounded, unbounded)


def test_user_setting_wins(monkeypatch):
    from pagedserve.worker.gemm_caches import bound_gemm_caches

    monkeypatch.setenv("LRU_CACHE_CAPACITY", "100")
    monkeypatch.delenv("ONEDNN_PRIMITIVE_CACHE_CAPACITY", raising=False)
    bound_gemm_caches()
    assert os.environ["LRU_CACHE_CAPACITY"] == "100"
    assert os.environ["ONEDNN_PRIMITIVE_CACHE_CAPACITY"] == str(CACHE_CAPACITY)
