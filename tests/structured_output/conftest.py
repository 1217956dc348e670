from __future__ import annotations

import gc

import pytest

from tests.server.helpers import ENGINE_KWARGS


@pytest.fixture(scope="module")
def llm():
    # Wide batches: the schema sweep decodes its 400 short sequences side by side, in one wave, with KV room
    # for all of them (the server tests' small pool would preempt and recompute most of them).
    from pagedserve import LLM

    engine = LLM(**{**ENGINE_KWARGS, "kv_cache_memory_bytes": 640 << 20, "max_num_seqs": 400,
                    "max_num_batched_tokens": 2048, "num_threads": 2})
    yield engine
    del engine
    gc.collect()
