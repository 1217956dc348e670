"""Shared fixtures. Test helpers live beside this file (e.g. tests/paged_metadata.py) and import as
`tests.<module>`."""
from __future__ import annotations

import os

import pytest

# The suite's oracles (transformers, the reference backend) run in float32: `--dtype auto` stays float32 in
# every test and every server a test starts, whatever this CPU has. The dtype tests set dtypes explicitly.
os.environ.setdefault("PAGEDSERVE_AUTO_DTYPE", "float32")
# GGUF k-quant weights multiply float32 activations, never int8-quantized ones (csrc/gguf_int8.h): the
# exact-equality tests (against transformers, dequantized weights, other batch sizes) hold. The int8 tests
# turn it on (tests/model/test_gguf_int8.py).
os.environ.setdefault("PAGEDSERVE_GGUF_INT8", "0")


@pytest.fixture(scope="session")
def embedded_model():
    # The embedded SmolLM2 GGUF, loaded once per session in float32 on CPU. The first load in a fresh
    # cache converts the GGUF (tens of seconds); later loads read the cached safetensors.
    import torch

    from pagedserve.model.loader import load_model

    return load_model(None, device="cpu", dtype=torch.float32)


# Numerical differences the tests measured (name -> value), printed after the run with this CPU's model and the
# kernel variant it ran: the same code lands on different CPUs (AVX2 EPYC, AVX-512/AMX Xeon) and a bound that
# holds on one may be near its edge on another. A test records with `numerics[name] = value`.
NUMERICS: dict[str, float] = {}


@pytest.fixture(scope="session")
def numerics() -> dict[str, float]:
    return NUMERICS


def pytest_terminal_summary(terminalreporter) -> None:
    if not NUMERICS:
        return
    from pagedserve import kernels
    from pagedserve.kernels import isa
    from pagedserve.model.layers.linear import onednn_keeps_fp32

    model = "unknown CPU"
    if os.path.exists("/proc/cpuinfo"):
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            model = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), model)
    flags = " ".join(f for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16") if f in isa.cpu_flags())
    terminalreporter.write_line(f"numerics on {model!r} ({flags}, {os.cpu_count()} cpus), kernels "
                                f"{kernels.selected_isa()}, oneDNN fp32 {onednn_keeps_fp32()}: "
                                + ", ".join(f"{k}={v:.3g}" for k, v in sorted(NUMERICS.items())))
