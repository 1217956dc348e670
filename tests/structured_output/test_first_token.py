"""check_first_token: which first tokens a grammar allows, computed without a thread team off the engine thread."""
from __future__ import annotations

import os
import threading

import pytest

from pagedserve.sampling_params import SamplingParams
from pagedserve.structured_output.backend import check_first_token

# Above torch's grain (32,768 elements): a torch op over the vocabulary runs a parallel region.
VOCAB_SIZE = 40_000


@pytest.fixture(scope="module")
def grammar():
    import xgrammar as xgr

    info = xgr.TokenizerInfo([f"w{i}" for i in range(VOCAB_SIZE)], stop_token_ids=[0])
    return xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False).compile_regex("w(30001|37777)")


def test_allowed_first_tokens(grammar):
    # w30001 and w37777 can begin the text (so can w3, w30, w300, w3000, w37, ...); w5 and w39999 cannot.
    check_first_token(grammar, SamplingParams(allowed_token_ids=[30001]))
    check_first_token(grammar, SamplingParams(allowed_token_ids=[37777, 5]))
    for ids in ([5], [39999, 30002], [0]):
        with pytest.raises(ValueError, match="none of allowed_token_ids"):
            check_first_token(grammar, SamplingParams(allowed_token_ids=ids))


def test_no_thread_team_on_the_calling_thread(grammar):
    # The check runs on the server's event loop. A parallel region there started an OpenMP team of the torch
    # thread count on that thread; with the engine's own team libgomp then managed more threads than CPUs and
    # throttled every team's spin-wait: later decode steps paid a futex wake-up per parallel region. The
    # worker threads such a team starts show in /proc/self/task while its thread lives.
    import torch

    added: list[set[str]] = []

    def check() -> None:
        before = set(os.listdir("/proc/self/task"))
        check_first_token(grammar, SamplingParams(allowed_token_ids=[30001]))
        added.append(set(os.listdir("/proc/self/task")) - before)

    saved = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        thread = threading.Thread(target=check)
        thread.start()
        thread.join()
    finally:
        torch.set_num_threads(saved)
    assert added == [set()]
