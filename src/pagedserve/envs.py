"""Every environment variable pagedserve reads, in one place. Each is read when its accessor is called, so a
test or a launcher that sets one before the first use is obeyed.

    PAGEDSERVE_CACHE_DIR  root of converted GGUF models and built kernels (default ~/.cache/pagedserve)
    PAGEDSERVE_KERNELS    "0" turns off the compiled CPU kernels and oneDNN-packed linears (default on)
    PAGEDSERVE_API_KEY    `pagedserve serve`'s API key when --api-key is not given (vLLM reads VLLM_API_KEY)
    PAGEDSERVE_CPU_ISA    kernel variant: "auto" (the best this CPU runs, default), "avx512", "avx2" or
                          "baseline"; forcing one this CPU cannot run is an error (pagedserve/kernels/isa.py)
    PAGEDSERVE_REQUIRE_KERNELS "1": a kernel build that fails is an error (RuntimeError), not a warning and the
                          pure-torch paths; CI sets it (.ci/run) so a broken build fails the run instead of
                          skipping the kernel tests. PAGEDSERVE_KERNELS=0 still turns the kernels off
    PAGEDSERVE_GGUF_INT8  "0": GGUF block weights never multiply int8-quantized activations (csrc/gguf_int8.h),
                          only float32 ones (default on where the kernel variant has the int8 kernel; the
                          test suite pins "0" so its exact-equality tests hold)
    PAGEDSERVE_GGUF_BF16  "0": prompt-sized GEMMs over GGUF k-quants keep the int8 kernels instead of bf16 panels
                          and oneDNN's brgemm (csrc/gguf_bf16.cpp; default on where the CPU has AVX512-BF16
                          or AMX; off with PAGEDSERVE_GGUF_INT8=0, which keeps float32 activations)
    PAGEDSERVE_TEST_ALL_ISAS "1": the kernel parity tests run every variant this CPU runs, not only its own
                          and baseline (each costs a build of minutes)
    PAGEDSERVE_AUTO_DTYPE what `--dtype auto` means, when set: "float32", "bfloat16" or "float16" (the test
                          suite pins float32 so its fp32 oracles hold on every CPU; model/dtypes.py)
"""
from __future__ import annotations

import os


def cache_dir() -> str:
    return os.environ.get("PAGEDSERVE_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "pagedserve")


def kernels_enabled() -> bool:
    return os.environ.get("PAGEDSERVE_KERNELS", "1") != "0"


def kernels_required() -> bool:
    return os.environ.get("PAGEDSERVE_REQUIRE_KERNELS") == "1"


def gguf_int8() -> bool:
    return os.environ.get("PAGEDSERVE_GGUF_INT8", "1") != "0"


def gguf_bf16() -> bool:
    return os.environ.get("PAGEDSERVE_GGUF_BF16", "1") != "0"


def api_key() -> str | None:
    key = os.environ.get("PAGEDSERVE_API_KEY")
    # A Secret mounted with an empty value must not silently turn authentication off.
    if key is not None and not key:
        raise ValueError("PAGEDSERVE_API_KEY is set but empty (unset it to serve without an API key)")
    return key


def cpu_isa() -> str:
    return (os.environ.get("PAGEDSERVE_CPU_ISA") or "auto").strip().lower()


def auto_dtype() -> str | None:
    return os.environ.get("PAGEDSERVE_AUTO_DTYPE") or None


def all_isas_in_tests() -> bool:
    return os.environ.get("PAGEDSERVE_TEST_ALL_ISAS") == "1"
