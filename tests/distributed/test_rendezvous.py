"""The process group's two timeouts: a long one for the rendezvous, the short distributed_timeout for collectives."""
from __future__ import annotations

import multiprocessing as mp
import time

import pytest
import torch

from pagedserve.distributed.executor import _free_port, _without_main_script
from pagedserve.distributed.parallel_state import destroy_tensor_parallel, init_tensor_parallel

COLLECTIVE_TIMEOUT_S = 1.0
LATE_S = 3.0  # after its own start-up: rank 1 reaches the rendezvous this long after rank 0, at least


def _late_rank(init_method: str, results) -> None:
    time.sleep(LATE_S)
    tp = init_tensor_parallel(1, 2, init_method, torch.device("cpu"), COLLECTIVE_TIMEOUT_S)
    x = torch.ones(3)
    tp.all_reduce(x)
    results.put(x.tolist())
    time.sleep(600)  # alive, and never meets rank 0's next collective


def test_a_late_rank_joins_and_collectives_keep_the_short_timeout() -> None:
    # On a loaded machine a rank's interpreter can start seconds after rank 0 reaches the rendezvous; with the
    # collective timeout applied to it too, rank 0 gave up ("1/2 clients joined") before rank 1 arrived.
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    init_method = f"tcp://127.0.0.1:{_free_port()}"
    with _without_main_script():
        proc = ctx.Process(target=_late_rank, args=(init_method, results), daemon=True)
        proc.start()
    try:
        tp = init_tensor_parallel(0, 2, init_method, torch.device("cpu"), COLLECTIVE_TIMEOUT_S)
        x = torch.ones(3)
        tp.all_reduce(x)
        assert x.tolist() == results.get(timeout=60) == [2.0, 2.0, 2.0]
        # A collective the other rank never joins fails after the short timeout (a long one would hang here).
        with pytest.raises(RuntimeError, match="(?i)timed out|timeout"):
            tp.all_reduce(torch.ones(3))
    finally:
        proc.kill()
        proc.join(10)
        destroy_tensor_parallel()
