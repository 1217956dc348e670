"""Every environment variable pagedserve reads, in one place. Each is read when its accessor is called, so a
test or a launcher that sets one before the first use is obeyed.

    PAGEDSERVE_CACHE_DIR  root of converted GGUF models and built kernels (default ~/.cache/pagedserve)
    PAGEDSERVE_KERNELS    "0" turns off the compiled CPU kernels and oneDNN-packed linears (default on)
"""
from __future__ import annotations

import os


def cache_dir() -> str:
    return os.environ.get("PAGEDSERVE_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "pagedserve")


def kernels_enabled() -> bool:
    return os.environ.get("PAGEDSERVE_KERNELS", "1") != "0"
