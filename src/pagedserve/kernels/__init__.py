"""Compiled CPU kernels (csrc/*.cpp), built on first use with torch.utils.cpp_extension and cached.

`load()` returns torch.ops.pagedserve once the library is loaded, or None when it cannot be (no C++
compiler, no ninja, a non-x86 toolchain problem, PAGEDSERVE_KERNELS=0): callers then take their pure-torch
path, which is also the oracle the kernels are tested against. The build lives under the pagedserve cache
directory, keyed by the source, torch version and CPU flags (it is built with -march=native), so a
second process loads it in milliseconds; concurrent first builds are serialized by cpp_extension's lock.
`scripts/setup` builds it once so the first engine start does not pay the ~10-30 s compile.
"""
from __future__ import annotations

import hashlib
import logging
import os
import platform
import threading

import torch

logger = logging.getLogger(__name__)

_SOURCES = [os.path.join(os.path.dirname(__file__), "csrc", name)
            for name in ("paged_attention.cpp", "layer_ops.cpp")]
# Compile-only flags: -ffast-math must not reach the link step (it would link crtfastmath.o, which turns
# on flush-to-zero for the whole process). The kernels never produce inf/nan from finite inputs.
# -fopenmp: at::parallel_for is a header template that only goes parallel when compiled with OpenMP. The
# extension then needs libgomp.so.1, which resolves to the copy torch already loaded (same soname), so
# there is one OpenMP runtime and one thread pool in the process.
_CFLAGS = ["-O3", "-march=native", "-ffast-math", "-fopenmp", "-DNDEBUG"]
_LDFLAGS = ["-fopenmp"]
_lock = threading.Lock()
_state: dict[str, object] = {}


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return line
    except OSError:
        pass
    return platform.processor()


def _build_dir() -> str:
    from pagedserve.model.loader import cache_root

    h = hashlib.sha256(torch.__version__.encode() + _cpu_flags().encode() + " ".join(_CFLAGS + _LDFLAGS).encode())
    csrc = os.path.dirname(_SOURCES[0])
    for name in sorted(os.listdir(csrc)):  # sources and headers
        with open(os.path.join(csrc, name), "rb") as f:
            h.update(f.read())
    key = h.hexdigest()[:16]
    return os.path.join(cache_root(), "kernels", key)


def load():
    """torch.ops.pagedserve with the kernels registered, or None (see module doc)."""
    if "ops" in _state:
        return _state["ops"]
    with _lock:
        if "ops" not in _state:
            _state["ops"] = _load_uncached()
    return _state["ops"]


def _load_uncached():
    if os.environ.get("PAGEDSERVE_KERNELS", "1") == "0":
        return None
    try:
        from torch.utils.cpp_extension import load as cpp_load

        build_dir = _build_dir()
        os.makedirs(build_dir, exist_ok=True)
        cpp_load(name="pagedserve_cpu_ops", sources=_SOURCES, build_directory=build_dir, extra_cflags=_CFLAGS,
                 extra_ldflags=_LDFLAGS, is_python_module=False, verbose=False)
        ops = torch.ops.pagedserve
        ops.paged_attention, ops.rms_norm  # noqa: B018  (raises if registration failed)
        return ops
    except Exception as e:  # no compiler / ninja / headers: the pure-torch paths still work
        logger.warning("pagedserve CPU kernels unavailable, using the pure-torch paths: %s", e)
        return None


def available_for(device: torch.device | str, dtype: torch.dtype) -> bool:
    # The kernels are float32 CPU only; CUDA and other dtypes take the torch paths.
    return torch.device(device).type == "cpu" and dtype == torch.float32 and load() is not None


def ops_for(x: torch.Tensor):
    # The kernels for a float32 CPU activation, else None (the caller's torch path).
    if x.dtype != torch.float32 or x.device.type != "cpu":
        return None
    return _state["ops"] if "ops" in _state else load()
