"""Compiled CPU kernels (csrc/*.cpp), built on first use with torch.utils.cpp_extension and cached.

`load()` returns torch.ops.pagedserve once the library is loaded, or None when it cannot be (no C++
compiler, no ninja, a toolchain problem, or PAGEDSERVE_KERNELS=0): callers then take their pure-torch
path, which is also the oracle the kernels are tested against. The build lives under the pagedserve cache
directory, keyed by the sources, the torch install and the CPU flags (it is built with -march=native), so a
second process loads it in milliseconds; concurrent first builds are serialized by cpp_extension's lock.
`scripts/setup` builds it once so the first engine start does not pay the ~10-30 s compile.
"""
from __future__ import annotations

import hashlib
import logging
import os
import platform
import sys
import threading

import torch

from pagedserve import envs

logger = logging.getLogger(__name__)

_SOURCES = [os.path.join(os.path.dirname(__file__), "csrc", name)
            for name in ("paged_attention.cpp", "layer_ops.cpp", "quant_gemm.cpp", "quant_pack.cpp")]
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
    # One build per torch install (it links that install's libraries) and CPU (-march=native).
    h = hashlib.sha256(f"{torch.__version__}|{torch.__file__}|{sys.version}|{_cpu_flags()}|{_CFLAGS}|{_LDFLAGS}"
                       .encode())
    csrc = os.path.dirname(_SOURCES[0])
    for name in sorted(os.listdir(csrc)):  # sources and headers
        with open(os.path.join(csrc, name), "rb") as f:
            h.update(f.read())
    key = h.hexdigest()[:16]
    return os.path.join(envs.cache_dir(), "kernels", key)


def load():
    """torch.ops.pagedserve with the kernels registered, or None (see module doc)."""
    if "ops" in _state:
        return _state["ops"]
    with _lock:
        if "ops" not in _state:
            _state["ops"] = _load_uncached()
    return _state["ops"]


def fast_paths_enabled() -> bool:
    # PAGEDSERVE_KERNELS=0 turns off every CPU fast path (these kernels and the oneDNN-packed linears),
    # leaving plain torch ops: the A/B baseline in benchmarks/profile_step.py, and a debugging escape hatch.
    return envs.kernels_enabled()


def _load_uncached():
    if not fast_paths_enabled():
        return None
    try:
        from torch.utils.cpp_extension import load as cpp_load

        build_dir = _build_dir()
        os.makedirs(build_dir, exist_ok=True)
        _remove_stale_lock(os.path.join(build_dir, "lock"))
        cpp_load(name="pagedserve_cpu_ops", sources=_SOURCES, build_directory=build_dir, extra_cflags=_CFLAGS,
                 extra_ldflags=_LDFLAGS, is_python_module=False, verbose=False)
        ops = torch.ops.pagedserve
        ops.paged_attention, ops.rms_norm  # noqa: B018  (raises if registration failed)
        return ops
    except Exception as e:  # no compiler / ninja / headers: the pure-torch paths still work
        logger.warning("pagedserve CPU kernels unavailable, using the pure-torch paths: %s", e)
        return None


def _remove_stale_lock(path: str, max_age_s: float = 600.0) -> None:
    # cpp_extension waits forever on the lock file of a build whose process died; a build takes well
    # under a minute, so a lock this old is a leftover.
    import time

    try:
        if time.time() - os.path.getmtime(path) > max_age_s:
            os.remove(path)
    except OSError:
        pass


def ops_for(x: torch.Tensor):
    # The kernels for a float32 CPU activation, else None (the caller's torch path).
    if x.dtype != torch.float32 or x.device.type != "cpu":
        return None
    return _state["ops"] if "ops" in _state else load()
