from __future__ import annotations

import gc

import pytest

from tests.server.helpers import ENGINE_KWARGS


@pytest.fixture(scope="module")
def llm():
    # Wide batches: the schema sweep decodes hundreds of short sequences side by side.
    from pagedserve import LLM

    engine = LLM(**{**ENGINE_KWARGS, "max_num_seqs": 256, "num_threads": 2})
    yield engine
    del engine
    gc.collect()
