"""glibc malloc settings for a long-running server, and giving freed heap back to the OS.

A server's transient buffers (prefill activations, dequantized weight tiles, logits) come and go every step
on the engine thread. With glibc's defaults each thread gets its own arena (up to 8 per core) and the mmap
threshold grows with every large free. Serving sets, before any engine thread starts: two arenas at most, a
fixed 32 MiB mmap threshold (the most glibc allows on 64-bit: a step's buffers come from the heap and are
reused) and a 64 MiB trim threshold (that much free heap stays mapped between steps). The environment
variables glibc reads (MALLOC_ARENA_MAX, MALLOC_MMAP_THRESHOLD_, MALLOC_TRIM_THRESHOLD_) still win when set.

A 1 MiB mmap / trim threshold (until issue 28) mapped and unmapped every buffer above 1 MiB each step: the
engine thread took ~1.2 million page faults and 2.0-2.5 s of system CPU on top of ~10.5 s of user CPU for
32 requests (64-512 prompt tokens, 16-128 out, 16 streams, embedded model, 1 thread), where the same work
offline (engine on the main thread, glibc's defaults) took none: that, not the event loop (~0.1 ms a token),
was most of HTTP's CPU over offline. 32 / 64 MiB: 50-66 thousand faults, 0.14-0.21 s, for +10-15 MB RSS
(1,512 vs 1,522-1,527 MB with a 1 GiB KV pool). Freed blocks in the middle of the heap stay resident whatever
the thresholds, so the load (after the tokenizer's parse) and the engine thread (each time it goes idle, and
every 2 s while busy) call malloc_trim: ~12 MB after requests.
Elsewhere (musl, macOS) these are no-ops.

Python's cyclic GC: once the model is loaded and warmed up, the server moves every object then alive (torch,
transformers, the tokenizer, the model's modules: ~1-2 million) into the permanent generation (gc.freeze, as
vLLM does), so a full collection no longer walks them. Before, full collections on the engine thread took 64-98 ms
each, a stall of every running request (3 of them in a server's start-up and 32 shared-prompt requests); after,
3.3 ms.
"""
from __future__ import annotations

import ctypes
import gc
import logging
import os

logger = logging.getLogger(__name__)

# mallopt parameters (malloc.h)
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD, _M_ARENA_MAX = -1, -3, -8
_SETTINGS = ((_M_ARENA_MAX, "MALLOC_ARENA_MAX", 2), (_M_MMAP_THRESHOLD, "MALLOC_MMAP_THRESHOLD_", 32 << 20),
             (_M_TRIM_THRESHOLD, "MALLOC_TRIM_THRESHOLD_", 64 << 20))


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


def freeze_startup_heap() -> None:
    # After loading and warm-up: collect once, then keep what is left out of every later collection.
    gc.collect()
    gc.freeze()


def release_free_memory() -> None:
    # glibc keeps freed heap pages mapped; malloc_trim returns them (after a load frees its dense copies).
    libc = _libc()
    if libc is not None and hasattr(libc, "malloc_trim"):
        libc.malloc_trim(0)
