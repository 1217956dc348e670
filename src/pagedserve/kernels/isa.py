"""The ISA variants of the compiled CPU kernels and which one this process runs.

Every variant compiles the same sources with its own -m flags (never -march=native, so a cached build says
nothing about the machine that made it) into its own library and op namespace, torch.ops.pagedserve_<name>.
The sources take their AVX-512 paths under `#if defined(__AVX512F__)` and plain loops the compiler
vectorizes otherwise, so `avx2` is the portable code vectorized for AVX2/FMA and `baseline` is the same code
with the compiler's default target (SSE2 on x86-64, NEON on aarch64). A variant's library is only ever
loaded on a CPU that has its flags: its code, static initializers included, may use any instruction the
flags allow.
"""
from __future__ import annotations

import platform
from dataclasses import dataclass

AUTO = "auto"


@dataclass(frozen=True, slots=True)
class Variant:
    name: str
    cflags: tuple[str, ...]
    cpu_flags: frozenset[str]  # /proc/cpuinfo flags the CPU needs to run it

    @property
    def namespace(self) -> str:
        return f"pagedserve_{self.name}"


_AVX2_FLAGS = ("-mavx2", "-mfma", "-mf16c")
# x86-64-v4's AVX-512 subset (Skylake-SP and later, AMD Zen 4). AVX512-BF16 is left out on purpose:
# requiring it would send Skylake-to-Ice-Lake CPUs to avx2; the bf16 code that needs it lives in `amx`.
_AVX512_FLAGS = _AVX2_FLAGS + ("-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq")
_AVX512_CPU = frozenset({"avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512dq"})
_AVX512 = Variant("avx512", _AVX512_FLAGS, _AVX512_CPU)
# Sapphire Rapids and later: avx512 plus AMX tiles with bf16 dot products (the bf16 block GEMM,
# csrc/gguf_amx.cpp) and AVX512-BF16's conversions. The OS must also grant the tile state to the process
# (arch_prctl, done by the kernel before its first tile instruction).
_AMX = Variant("amx", _AVX512_FLAGS + ("-mavx512bf16", "-mamx-tile", "-mamx-bf16"),
               _AVX512_CPU | {"avx512_bf16", "amx_tile", "amx_bf16"})
_AVX2 = Variant("avx2", _AVX2_FLAGS, frozenset({"avx2", "fma", "f16c"}))
BASELINE = Variant("baseline", (), frozenset())


def variants(machine: str | None = None) -> tuple[Variant, ...]:
    # Best first: `auto` takes the first one the CPU runs.
    machine = (machine or platform.machine()).lower()
    if machine in ("x86_64", "amd64"):
        return (_AMX, _AVX512, _AVX2, BASELINE)
    return (BASELINE,)


def cpu_flags() -> frozenset[str]:
    # Linux lists what the CPU and the kernel both support (AVX-512 needs the OS to save its registers).
    # Elsewhere nothing is known, so only `baseline` runs.
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def runnable(flags: frozenset[str] | None = None, machine: str | None = None) -> list[Variant]:
    flags = cpu_flags() if flags is None else flags
    return [v for v in variants(machine) if v.cpu_flags <= flags]


def choose(requested: str, flags: frozenset[str] | None = None, machine: str | None = None) -> list[Variant]:
    # The variants to try, in order: every runnable one, best first, for `auto` (a variant that fails to
    # build falls through to the next); exactly the requested one otherwise. Forcing a variant this CPU
    # cannot run is an error, never a silent fallback: the caller asked for that code.
    flags = cpu_flags() if flags is None else flags
    ok = runnable(flags, machine)
    if requested == AUTO:
        return ok
    known = {v.name: v for v in variants(machine)}
    names = ", ".join([AUTO, *(v.name for v in ok)])
    if requested not in known:
        raise ValueError(f"PAGEDSERVE_CPU_ISA={requested!r} is not a kernel variant of this {platform.machine()} "
                         f"build; this CPU can use: {names}")
    variant = known[requested]
    if variant not in ok:
        missing = " ".join(sorted(variant.cpu_flags - flags))
        raise ValueError(f"PAGEDSERVE_CPU_ISA={requested!r}: this CPU lacks {missing}; it can use: {names}")
    return [variant]
