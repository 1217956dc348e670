"""LLM used from another thread: same tokens, and one warning about the CPU slowdown."""
from __future__ import annotations

import logging
import threading

from pagedserve import SamplingParams


def test_generate_on_another_thread_warns_once_and_matches(llm, caplog):
    params = SamplingParams(temperature=0.0, max_tokens=8)
    want = llm.generate("The capital of France is", params, use_tqdm=False)[0].outputs[0].token_ids
    got: list[list[int]] = []

    def run():
        for _ in range(2):
            got.append(llm.generate("The capital of France is", params, use_tqdm=False)[0].outputs[0].token_ids)

    with caplog.at_level(logging.WARNING, logger="pagedserve.llm"):
        thread = threading.Thread(target=run)
        thread.start()
        thread.join()
    assert got == [want, want]
    warnings = [r for r in caplog.records if "different thread" in r.getMessage()]
    assert len(warnings) == 1
