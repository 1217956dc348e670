"""A tensor-parallel rank other than 0: its own process, its slice of the model and of every KV block.

The engine process (rank 0) drives it over a pipe with the runner's two calls, in the order rank 0 makes them:

    rank 0 (engine)                                  rank r (this process)
    send ("step", (plan, scheduled)) --------------> runner.update_states(plan)   (batch rows, block ops)
                                                     runner.execute_model(...)    (collectives with rank 0)
    <--------------------------------------------- ("ok", None) or ("error", message)
    send ("execute_model", (scheduled,)) ----------> a subset again, when the core isolates a failing request

Commands travel over a pipe, not a collective: a worker waits for the next step without a timeout (an idle
engine is not a dead one), while every collective inside the step has one.

The plan is the scheduler's, unchanged: block tables live in the scheduler and every rank applies the same
diff, so all ranks address the same slots. The worker's runner never samples (rank 0 does).
"""
from __future__ import annotations

import logging
from multiprocessing.connection import Connection

import torch

from pagedserve.config import EngineConfig
from pagedserve.distributed.parallel_state import (destroy_tensor_parallel, init_tensor_parallel, rank_device,
                                                   threads_per_rank)

logger = logging.getLogger(__name__)


def describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


def run_worker(rank: int, config: EngineConfig, init_method: str, conn: Connection) -> None:
    """Process entry point; returns when rank 0 says shutdown or its end of the pipe closes."""
    try:
        _serve(rank, config, init_method, conn)
    except (EOFError, BrokenPipeError, KeyboardInterrupt):
        pass  # the engine process is gone: nothing left to serve
    finally:
        destroy_tensor_parallel()


def _serve(rank: int, config: EngineConfig, init_method: str, conn: Connection) -> None:
    from pagedserve.attention.kv_quant import storage_dtype
    from pagedserve.model.loader import load_model
    from pagedserve.worker.kv_cache import allocate_host_caches, allocate_kv_caches
    from pagedserve.worker.model_runner import ModelRunner

    par = config.parallel
    world_size = par.tensor_parallel_size
    torch.set_num_threads(threads_per_rank(config.device.num_threads, world_size))
    device = rank_device(torch.device(config.device.resolve()), rank)
    tp = init_tensor_parallel(rank, world_size, init_method, device, par.distributed_timeout_s)
    runner = None
    try:
        loaded = load_model(config.model.model, device, getattr(torch, config.model.dtype),
                            config.model.attention_backend, config.model.tokenizer, "none", tp=tp,
                            load_format=config.model.load_format)
    except Exception as exc:  # noqa: BLE001 (rank 0 hits the same error and reports it)
        conn.send(("error", describe(exc)))
        return
    conn.send(("ok", None))
    while True:
        method, args = conn.recv()
        if method == "shutdown":
            return
        try:
            if method == "init_cache":
                # rank 0 sized the pool; every rank holds the same block count, each with its KV heads.
                resolved, num_blocks, num_host_blocks = args
                hf, bs = loaded.hf_config, resolved.cache.block_size
                dtype = storage_dtype(resolved.cache.cache_dtype)  # the KV storage type rank 0 resolved
                num_kv_heads = hf.num_key_value_heads // world_size
                head_dim = loaded.model.head_dim
                kv = allocate_kv_caches(hf.num_hidden_layers, num_blocks, bs, num_kv_heads, head_dim, dtype, device,
                                        resolved.cache.prefault_kv_cache)
                runner = ModelRunner(loaded.model, kv, bs, hf.vocab_size, device, resolved.scheduler.max_num_seqs,
                                     resolved.model.max_model_len, resolved.model.seed, driver=False)
                if num_host_blocks:
                    runner.host_caches = allocate_host_caches(hf.num_hidden_layers, num_host_blocks, bs,
                                                              num_kv_heads, head_dim, dtype, device)
            elif method == "step":  # a new plan, then its forward pass
                plan, num_scheduled_tokens = args
                runner.update_states(plan)
                runner.execute_model(num_scheduled_tokens)
            else:
                runner.execute_model(*args)
        except Exception as exc:  # noqa: BLE001 (reported to rank 0, which decides)
            logger.exception("rank %d: %s failed", rank, method)
            conn.send(("error", describe(exc)))
            continue
        conn.send(("ok", None))
