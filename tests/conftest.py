"""Shared fixtures. Test helpers live beside this file (e.g. tests/paged_metadata.py) and import as
`tests.<module>`."""
from __future__ import annotations

import os

import pytest

# The suite's oracles (transformers, the reference backend) run in float32: `--dtype auto` stays float32 in
# every test and every server a test starts, whatever this CPU has. The dtype tests set dtypes explicitly.
os.environ.setdefault("PAGEDSERVE_AUTO_DTYPE", "float32")


@pytest.fixture(scope="session")
def embedded_model():
    # The embedded SmolLM2 GGUF, loaded once per session in float32 on CPU. The first load in a fresh
    # cache converts the GGUF (tens of seconds); later loads read the cached safetensors.
    import torch

    from pagedserve.model.loader import load_model

    return load_model(None, device="cpu", dtype=torch.float32)
