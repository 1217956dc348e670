"""Background threads (tokenizer, grammar compiles) run at a low priority, on the cycles the engine leaves."""
from __future__ import annotations

import os
import threading

# Tokenizer work yields the CPU to the engine's threads: on a machine with as many cores as OpenMP threads, a
# busy tokenizer thread would otherwise stall every parallel region of every step (a burst of 200 long
# /tokenize calls made decode 4x slower); at this niceness it runs on the cycles the engine leaves idle.
TOKENIZER_NICENESS = 19


def yield_cpu_to_the_engine() -> None:
    # For the calling thread (a thread pool's initializer).
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), TOKENIZER_NICENESS)
    except (AttributeError, OSError):  # not Linux, or not allowed: run at normal priority
        pass
