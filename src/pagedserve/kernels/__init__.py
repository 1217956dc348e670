"""Compiled CPU kernels (csrc/*.cpp), built on first use with torch.utils.cpp_extension and cached.

`load()` returns the op namespace of the ISA variant this process runs (torch.ops.pagedserve_avx512, ...;
see isa.py) once its library is loaded, or None when it cannot be (no C++ compiler, no ninja, a toolchain
problem, or PAGEDSERVE_KERNELS=0): callers then take their pure-torch path, which is also the oracle the
kernels are tested against. Under PAGEDSERVE_REQUIRE_KERNELS=1 (CI) a build that fails raises RuntimeError
instead, so a broken toolchain fails the run rather than skipping the kernel tests. The variant is chosen once per process from this CPU's flags, best first
(PAGEDSERVE_CPU_ISA forces one; forcing one the CPU cannot run raises ValueError), and logged;
`selected_isa()` names it. Each variant's build lives under the pagedserve cache directory, keyed by the
sources, the torch install and the variant's flags, never by the CPU that built it, so a cache can move
between machines; a second process loads the finished library directly (milliseconds, no cpp_extension
import), and concurrent first builds are serialized by cpp_extension's lock. Variants are built lazily, only
when loaded: `scripts/setup` builds the chosen one and `baseline` (what the tests compare; about two minutes
each on two busy cores), so the first engine start and the tests do not pay the compile. A variant this CPU
cannot run is never built here; `syntax_check` still compiles its sources (without code generation) so CI on
any x86 machine catches a broken AVX-512 path.
"""
from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import sys
import threading

import torch

from pagedserve import envs
from pagedserve.kernels import isa

logger = logging.getLogger(__name__)

_SOURCES = [os.path.join(os.path.dirname(__file__), "csrc", name)
            for name in ("paged_attention.cpp", "layer_ops.cpp",
                          "gguf_gemm.cpp", "gguf_amx.cpp", "gguf_int8.cpp", "gguf_bf16.cpp",
                          "sampling_ops.cpp", "decoder_layers.cpp")]
# Compile-only flags: -ffast-math must not reach the link step (it would link crtfastmath.o, which turns
# on flush-to-zero for the whole process). The kernels never produce inf/nan from finite inputs.
# -fopenmp: at::parallel_for is a header template that only goes parallel when compiled with OpenMP. The
# extension then needs libgomp.so.1, which resolves to the copy torch already loaded (same soname), so
# there is one OpenMP runtime and one thread pool in the process.
_CFLAGS = ["-O3", "-ffast-math", "-fopenmp", "-DNDEBUG"]
_LDFLAGS = ["-fopenmp"]
_lock = threading.Lock()
_state: dict[str, object] = {}  # "ops" (namespace or None) and "isa" (name or None): this process's choice
_variant_ops: dict[str, object] = {}  # variant name -> its loaded op namespace


def _cflags(variant: isa.Variant) -> list[str]:
    return [*_CFLAGS, *variant.cflags, f"-DPAGEDSERVE_OPS_NS={variant.namespace}"]


def _build_dir(variant: isa.Variant) -> str:
    # One build per torch install (it links that install's libraries) and variant.
    h = hashlib.sha256(f"{torch.__version__}|{torch.__file__}|{sys.version}|{_cflags(variant)}|{_LDFLAGS}".encode())
    csrc = os.path.dirname(_SOURCES[0])
    for name in sorted(os.listdir(csrc)):  # sources and headers
        with open(os.path.join(csrc, name), "rb") as f:
            h.update(f.read())
    return os.path.join(envs.cache_dir(), "kernels", f"{variant.name}-{h.hexdigest()[:16]}")


def load():
    """This process's op namespace with the kernels registered, or None (see module doc)."""
    if "ops" in _state:
        return _state["ops"]
    with _lock:
        if "ops" not in _state:
            _state["isa"], _state["ops"] = _load_uncached()
    return _state["ops"]


def selected_isa() -> str | None:
    # The variant load() chose ("amx", "avx512", "avx2", "baseline"), or None when the kernels are off or unavailable.
    load()
    return _state["isa"]


def fast_paths_enabled() -> bool:
    # PAGEDSERVE_KERNELS=0 turns off every CPU fast path (these kernels and the oneDNN-packed linears),
    # leaving plain torch ops: the A/B baseline in benchmarks/profile_step.py, and a debugging escape hatch.
    return envs.kernels_enabled()


def _load_uncached() -> tuple[str | None, object]:
    if not fast_paths_enabled():
        return None, None
    requested = envs.cpu_isa()
    candidates = isa.choose(requested)  # raises on a forced variant this CPU cannot run
    for variant in candidates:
        try:
            ops = _load_variant(variant)
        except Exception as e:  # no compiler / ninja / headers / -m flag: the next variant, else torch
            logger.warning("pagedserve CPU kernels: the %s variant is unavailable: %s", variant.name, e)
            if _cache_unwritable(e):
                break  # every other variant's build would fail the same way, each after minutes
            continue
        how = "forced by PAGEDSERVE_CPU_ISA" if requested != isa.AUTO else "the best this CPU runs"
        logger.info("pagedserve CPU kernels: %s variant (%s)", variant.name, how)
        return variant.name, ops
    if envs.kernels_required():
        raise RuntimeError("pagedserve CPU kernels could not be built or loaded and PAGEDSERVE_REQUIRE_KERNELS=1 "
                           "(the warnings above say why)")
    logger.warning("pagedserve CPU kernels unavailable, using the pure-torch paths")
    return None, None


def _cache_unwritable(error: Exception) -> bool:
    # A full disk or a read-only cache, as an OSError or in the build's output (ninja reports it as text).
    import errno

    if isinstance(error, OSError) and error.errno in (errno.ENOSPC, errno.EROFS, errno.EDQUOT, errno.EACCES):
        return True
    return any(m in str(error) for m in ("No space left on device", "Read-only file system", "Disk quota exceeded"))


def _load_variant(variant: isa.Variant):
    if variant.name in _variant_ops:
        return _variant_ops[variant.name]
    name, build_dir = f"pagedserve_cpu_ops_{variant.name}", _build_dir(variant)
    library = os.path.join(build_dir, f"{name}.so")
    with _build_dir_lock(build_dir):
        if not _load_built(library):
            from torch.utils.cpp_extension import load as cpp_load

            cpp_load(name=name, sources=_SOURCES, build_directory=build_dir, extra_cflags=_cflags(variant),
                     extra_ldflags=_LDFLAGS, is_python_module=False, verbose=False)
            _record_hash(library)
    ops = getattr(torch.ops, variant.namespace)
    ops.paged_attention, ops.rms_norm  # noqa: B018  (raises if registration failed)
    if ops.compiled_isa() != variant.name:
        raise RuntimeError(f"the {variant.name} build targets {ops.compiled_isa()}; flags {_cflags(variant)}")
    _variant_ops[variant.name] = ops
    return ops


def _load_built(library: str) -> bool:
    # The build directory's key covers everything the library depends on (_build_dir), so a finished build
    # there is this one: loaded directly, without cpp_extension (setuptools and a ninja run: ~3 MB resident
    # and ~80 ms per start). Not a library whose bytes changed since its build, nor one that fails to load.
    if not os.path.isfile(library) or not _verified(library):
        return False
    try:
        torch.ops.load_library(library)
    except (OSError, RuntimeError) as e:
        logger.warning("pagedserve CPU kernels: %s does not load (%s); building it again", library, e)
        return False
    return True


def _library_hash(library: str) -> str:
    with open(library, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def _record_hash(library: str) -> None:
    with open(f"{library}.sha256", "w") as f:
        f.write(_library_hash(library))


def _verified(library: str) -> bool:
    # Loading a truncated library ends the process with SIGBUS, an overwritten one with SIGTRAP, and neither
    # leaves a log line; so a library is loaded only when its bytes hash as they did right after its build.
    try:
        with open(f"{library}.sha256") as f:
            recorded = f.read().strip()
    except FileNotFoundError:
        return _trusted_legacy_build(library)
    if _library_hash(library) != recorded:
        logger.warning("pagedserve CPU kernels: %s differs from the library that was built there (truncated or "
                       "overwritten); building it again", library)
        return False
    return True


def _trusted_legacy_build(library: str) -> bool:
    # A build from before hashes were recorded: trusted (and its hash recorded) once it loads in a child
    # process, where a crash ends only the child; a rebuild would cost minutes.
    import subprocess

    loads = subprocess.run([sys.executable, "-c", "import sys, torch; torch.ops.load_library(sys.argv[1])",
                            library], capture_output=True).returncode == 0
    if loads:
        _record_hash(library)
    else:
        logger.warning("pagedserve CPU kernels: %s does not load; building it again", library)
    return loads


@contextlib.contextmanager
def _build_dir_lock(build_dir: str):
    # One process at a time loads or builds in build_dir. An flock, unlike cpp_extension's own `lock` file
    # (which it waits on forever when its builder died), is released by the OS with the process that held
    # it; so once this one is held, a `lock` file there is a dead build's leftover and goes.
    import fcntl

    os.makedirs(build_dir, exist_ok=True)
    try:
        held = open(os.path.join(build_dir, "pagedserve.lock"), "a")
    except OSError as e:  # a read-only cache: a finished library still loads, a build fails and says why
        logger.warning("pagedserve CPU kernels: cannot lock %s (%s)", build_dir, e)
        yield
        return
    with held:
        fcntl.flock(held, fcntl.LOCK_EX)
        with contextlib.suppress(FileNotFoundError):
            os.remove(os.path.join(build_dir, "lock"))
        yield


def load_isa(name: str):
    """The op namespace of variant `name`, built if needed; ValueError when this CPU cannot run it."""
    (variant,) = isa.choose(name)
    with _lock:
        return _load_variant(variant)


def runnable_isas() -> list[str]:
    # Every variant this CPU runs, best first.
    return [v.name for v in isa.runnable()]


def parity_isas() -> list[str]:
    # The variants the parity tests run: this process's choice and the portable baseline, so CI builds at
    # most two libraries (each costs minutes); PAGEDSERVE_TEST_ALL_ISAS=1 adds every other runnable one.
    chosen = selected_isa()
    if chosen is None:
        return []
    if envs.all_isas_in_tests():
        return runnable_isas()
    return list(dict.fromkeys([chosen, isa.BASELINE.name]))


def syntax_check(name: str, sources: list[str]) -> None:
    """Compiles `sources` as one translation unit with variant `name`'s flags but without code generation
    (-fsyntax-only; torch's headers parsed once: seconds), on any CPU; raises RuntimeError with the compiler's
    errors. For variants this CPU cannot run. The sources must not define the same names twice."""
    import subprocess
    import sysconfig
    import tempfile

    from torch.utils.cpp_extension import include_paths

    variant = {v.name: v for v in isa.variants()}[name]
    includes = [f"-I{p}" for p in [*include_paths(), sysconfig.get_paths()["include"]]]
    with tempfile.NamedTemporaryFile("w", suffix=".cpp") as unit:
        unit.write("".join(f'#include "{os.path.abspath(src)}"\n' for src in sources))
        unit.flush()
        proc = subprocess.run([os.environ.get("CXX", "c++"), "-std=c++20", "-fsyntax-only", "-w",
                               *_cflags(variant), *includes, unit.name], capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"the {name} variant does not compile:\n{proc.stderr[-4000:]}")


@contextlib.contextmanager
def use_isa(name: str):
    # Runs this process's kernel calls (load(), ops_for()) on variant `name` inside the block, then restores
    # the process's own choice. For tests that compare variants in one process; the engine never switches.
    ops = load_isa(name)
    saved = dict(_state)
    _state.update(ops=ops, isa=name)
    try:
        yield ops
    finally:
        _state.clear()
        _state.update(saved)


def prebuild() -> list[str]:
    # Builds (and loads) the variants the engine and the tests use; scripts/setup calls it. Returns their names.
    built = []
    for name in parity_isas():
        try:
            load_isa(name)
            built.append(name)
        except Exception as e:
            if envs.kernels_required():
                raise
            logger.warning("pagedserve CPU kernels: the %s variant did not build: %s", name, e)
    return built


# Activation dtypes of the fused layer ops (rms_norm, fused_add_rms_norm_, rotary_embedding_, silu_and_mul) and
# the attention kernel; gemm_gguf takes both, gemm_gguf_amx (amx variant only) bfloat16 only.
LAYER_DTYPES = (torch.float32, torch.bfloat16)


def ops_for(x: torch.Tensor, dtypes: tuple[torch.dtype, ...] = (torch.float32,)):
    # The kernels for a CPU activation of one of `dtypes`, else None (the caller's torch path).
    if x.dtype not in dtypes or x.device.type != "cpu":
        return None
    return _state["ops"] if "ops" in _state else load()
