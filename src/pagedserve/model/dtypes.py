"""Which floating-point type the model computes in (`--dtype`), decided at run time from the device.

`auto` picks bfloat16 where the hardware multiplies it natively (CUDA with bf16 support; a CPU with AMX or
AVX512-BF16, where oneDNN's bf16 GEMM is several times faster than fp32, see issue 11) and float32
everywhere else: without those instructions bf16 matmuls are converted to fp32 on the fly and run no faster,
so `auto` is never slower than float32. An explicit dtype is taken as asked. Norm statistics, rotary angles,
softmax and sampling run in float32 whatever the dtype (layers/norm.py, rotary.py, sample/sampler.py).
"""
from __future__ import annotations

import dataclasses
import logging

import torch

from pagedserve import envs, kv_dtypes
from pagedserve.attention.kv_quant import storage_dtype
from pagedserve.config import EngineConfig
from pagedserve.kernels import isa

logger = logging.getLogger(__name__)

# /proc/cpuinfo flags with native bf16 dot products.
CPU_BF16_FLAGS = ("amx_bf16", "avx512_bf16")


def resolve_dtype(requested: str, device: torch.device, cpu_flags: frozenset[str] | None = None
                  ) -> tuple[torch.dtype, str]:
    # (dtype, why): why is logged at start-up so a user can see what `auto` decided.
    if requested != "auto":
        return getattr(torch, requested), f"--dtype {requested}"
    pinned = envs.auto_dtype()
    if pinned is not None:
        if pinned not in ("float32", "bfloat16", "float16"):
            raise ValueError(f"PAGEDSERVE_AUTO_DTYPE={pinned!r}; use float32, bfloat16 or float16")
        return getattr(torch, pinned), f"auto: PAGEDSERVE_AUTO_DTYPE={pinned}"
    if device.type == "cuda":
        if torch.cuda.is_bf16_supported():
            return torch.bfloat16, "auto: CUDA device with bf16 support"
        return torch.float16, "auto: CUDA device without bf16 support"
    if device.type != "cpu":
        return torch.float32, f"auto: {device.type} device"
    flags = isa.cpu_flags() if cpu_flags is None else cpu_flags
    found = [f for f in CPU_BF16_FLAGS if f in flags]
    if found:
        return torch.bfloat16, f"auto: this CPU multiplies bf16 natively ({', '.join(found)})"
    return torch.float32, "auto: this CPU has neither AMX nor AVX512-BF16, so bf16 would be no faster"


def resolve_engine_dtypes(config: EngineConfig) -> EngineConfig:
    # The model dtype and the KV dtype, resolved before any rank starts, so every rank builds the same model.
    dtype, why = resolve_dtype(config.model.dtype, torch.device(config.device.resolve()))
    dtype_name = str(dtype).removeprefix("torch.")
    logger.info("model dtype %s (%s)", dtype_name, why)
    kv_name = kv_dtypes.resolve(config.cache.cache_dtype, dtype_name)
    storage_dtype(kv_name)  # ValueError naming the flag where this torch lacks the type
    if kv_name == "float16" and config.model.attention_backend == "cpu":
        raise ValueError(f"--kv-cache-dtype {kv_name} needs --attention-backend auto or reference: the "
                         "compiled 'cpu' backend reads float32, bfloat16, int8 and fp8_e4m3 caches")
    return dataclasses.replace(config, model=dataclasses.replace(config.model, dtype=dtype_name),
                               cache=dataclasses.replace(config.cache, cache_dtype=kv_name))
