"""The server's glibc settings (pagedserve/malloc.py): a step's buffers are reused, not mapped again each step."""
import os
import subprocess
import sys

import pytest

# A thread (like the engine thread) allocates, fills and frees an 8 MiB buffer 40 times; it prints its own page
# faults. A buffer mapped afresh faults again (about 1,000 times for 8 MiB here).
PROBE = """
import resource, sys, threading
import torch
from pagedserve.malloc import _SETTINGS, _libc, tune_for_serving
if sys.argv[1] == "1mib":  # the settings before issue 28
    for param, _, value in _SETTINGS:
        _libc().mallopt(param, 2 if value == 2 else 1 << 20)
else:
    tune_for_serving()

def step():
    torch.ones(1 << 21).sum()  # warm: the first buffer faults whatever the settings
    before = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt
    for _ in range(40):
        torch.ones(1 << 21).sum()
    print(resource.getrusage(resource.RUSAGE_THREAD).ru_minflt - before)

t = threading.Thread(target=step)
t.start()
t.join()
"""


def faults(mode: str) -> int:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    out = subprocess.run([sys.executable, "-c", PROBE, mode], env=env, capture_output=True, text=True, timeout=120,
                         check=True)
    return int(out.stdout.split()[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc")
def test_a_threads_step_buffers_are_not_mapped_again_every_step():
    # 40 fresh 8 MiB mappings fault ~41,000 times (measured); reused heap pages fault once (the heap grows to a
    # few buffers' worth: ~5,100).
    assert faults("1mib") > 16 * 2048  # the probe sees the cost it guards against
    assert faults("serving") < 4 * 2048


def test_the_startup_heap_leaves_the_cyclic_gc():
    # freeze_startup_heap (called by `serve` after warm-up): what is alive then moves to the permanent generation,
    # so a later full collection walks only what serving allocates (torch alone: ~100k objects it would walk).
    code = """
import gc, torch
from pagedserve.malloc import freeze_startup_heap
alive = len(gc.get_objects())
freeze_startup_heap()
print(alive, gc.get_freeze_count(), len(gc.get_objects()))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    alive, frozen, left = map(int, out.split())
    assert frozen > 0.9 * alive and alive > 10_000
    assert left < 0.01 * alive
