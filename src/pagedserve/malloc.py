"""glibc malloc settings for a long-running server, and giving freed heap back to the OS.

A server's transient buffers (prefill activations, dequantized weight tiles, logits) come and go every step
on the engine thread. With glibc's defaults each thread gets its own arena (up to 8 per core) and the mmap
threshold grows with every large free, so such buffers end up on arena heaps that keep their pages resident
after the free. Serving sets, before any engine thread starts: two arenas at most, and a fixed 1 MiB mmap
threshold (a freed large buffer goes straight back to the OS) and trim threshold. The environment variables
glibc reads (MALLOC_ARENA_MAX, MALLOC_MMAP_THRESHOLD_, MALLOC_TRIM_THRESHOLD_) still win when set. Measured
on the embedded model's server: 543 -> 517 MB RSS after the first requests (benchmarks/HISTORY.md, memory.py).
Freed small blocks in the middle of the heap stay resident whatever the thresholds, so the load (after the
tokenizer's parse) and the engine thread (each time it goes idle, and every 2 s while busy) call malloc_trim:
~12 MB after requests.
Elsewhere (musl, macOS) these are no-ops.
"""
from __future__ import annotations

import ctypes
import logging
import os

logger = logging.getLogger(__name__)

# mallopt parameters (malloc.h)
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD, _M_ARENA_MAX = -1, -3, -8
_SETTINGS = ((_M_ARENA_MAX, "MALLOC_ARENA_MAX", 2), (_M_MMAP_THRESHOLD, "MALLOC_MMAP_THRESHOLD_", 1 << 20),
             (_M_TRIM_THRESHOLD, "MALLOC_TRIM_THRESHOLD_", 1 << 20))


def _libc():
    try:
        return ctypes.CDLL("libc.so.6")
    except OSError:
        return None


def tune_for_serving() -> None:
    libc = _libc()
    if libc is None or not hasattr(libc, "mallopt"):
        return
    for param, env, value in _SETTINGS:
        if os.environ.get(env) is None:
            libc.mallopt(param, value)


def release_free_memory() -> None:
    # glibc keeps freed heap pages mapped; malloc_trim returns them (after a load frees its dense copies).
    libc = _libc()
    if libc is not None and hasattr(libc, "malloc_trim"):
        libc.malloc_trim(0)
