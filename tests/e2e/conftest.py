from __future__ import annotations

import pytest

# Small, explicit KV budgets keep each engine's pool tiny on the 2-core, 24 GiB CI machine.
KV_BYTES = 64 << 20


@pytest.fixture(scope="session")
def llm():
    from pagedserve import LLM

    return LLM(kv_cache_memory_bytes=KV_BYTES, max_num_batched_tokens=512, max_num_seqs=16)


@pytest.fixture(scope="session")
def hf_smol():
    # transformers' own GGUF loader dequantizes to the same fp32 weights: the independent reference.
    import os

    import torch
    from transformers import AutoModelForCausalLM

    from pagedserve.model.loader import default_model_path

    path = default_model_path()
    model = AutoModelForCausalLM.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path),
                                                 torch_dtype=torch.float32)
    return model.eval()
