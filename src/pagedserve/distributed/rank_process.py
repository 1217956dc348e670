"""A tensor-parallel rank other than 0: its own process, a Worker (worker/worker.py) with its slice of the model
and of every KV block.

The engine process (rank 0, distributed/executor.py) drives it over a pipe with the executor's calls, in the
order rank 0 makes them:

    rank 0 (engine)                                  rank r (this process)
    (after spawn) <------------------------------- ("ok", None) when it starts the rendezvous
                  <------------------------------- ("ok", None) once Worker.load_model() is done
    send ("initialize", (kv_config,)) -------------> Worker.initialize: the same block counts as rank 0
    send ("step", (plan, scheduled, propose)) -----> Worker.apply_plan(plan)      (batch rows, block ops)
                                                     Worker.execute_model(...)    (collectives with rank 0)
    <--------------------------------------------- ("ok", None) or ("error", message)
    send ("execute_model", (scheduled, propose)) --> a subset again, when the core isolates a failing request

Commands travel over a pipe, not a collective: a worker waits for the next step without a timeout (an idle
engine is not a dead one), while every collective inside the step has one.

The plan is the scheduler's, unchanged: block tables live in the scheduler and every rank applies the same
diff, so all ranks address the same slots. This rank's worker never samples (rank 0 does).
"""
from __future__ import annotations

import logging
import threading
import time
from multiprocessing.connection import Connection

from pagedserve.config import EngineConfig
from pagedserve.distributed.parallel_state import bind_rank, destroy_tensor_parallel, init_tensor_parallel
from pagedserve.messages import describe_error

logger = logging.getLogger(__name__)


HEARTBEAT_INTERVAL_S = 0.5


def _beat(heartbeat) -> None:
    # CLOCK_MONOTONIC is one clock for every process on the machine: rank 0 compares it with its own. A stopped
    # (SIGSTOP) or frozen process stops beating; a busy one keeps beating (torch releases the GIL).
    while True:
        heartbeat.value = time.monotonic()
        time.sleep(HEARTBEAT_INTERVAL_S)


def run_worker(rank: int, config: EngineConfig, init_method: str, conn: Connection, heartbeat=None) -> None:
    """Process entry point; returns when rank 0 says shutdown or its end of the pipe closes. heartbeat: a
    shared double this process sets to the monotonic clock every HEARTBEAT_INTERVAL_S."""
    if heartbeat is not None:
        threading.Thread(target=_beat, args=(heartbeat,), name="pagedserve-heartbeat", daemon=True).start()
    try:
        _serve(rank, config, init_method, conn)
    except (EOFError, BrokenPipeError, KeyboardInterrupt):
        pass  # the engine process is gone: nothing left to serve
    finally:
        destroy_tensor_parallel()


def _serve(rank: int, config: EngineConfig, init_method: str, conn: Connection) -> None:
    from pagedserve.worker.worker import Worker

    par = config.parallel
    device = bind_rank(config, rank)
    conn.send(("ok", None))  # joining: rank 0 starts the rendezvous once every rank has said so
    tp = init_tensor_parallel(rank, par.tensor_parallel_size, init_method, device, par.distributed_timeout_s)
    worker = Worker(config, device, tp)
    try:
        worker.load_model()
    except Exception as exc:  # noqa: BLE001 (rank 0 hits the same error and reports it)
        conn.send(("error", describe_error(exc)))
        return
    conn.send(("ok", None))
    while True:
        method, args = conn.recv()
        if method == "shutdown":
            return
        try:
            if method == "initialize":
                worker.initialize(*args)
            elif method == "step":  # a new plan, then its forward pass
                plan, num_scheduled_tokens, propose_drafts = args
                worker.apply_plan(plan)
                worker.execute_model(num_scheduled_tokens, propose_drafts)
            else:
                worker.execute_model(*args)
        except Exception as exc:  # noqa: BLE001 (reported to rank 0, which decides)
            logger.exception("rank %d: %s failed", rank, method)
            conn.send(("error", describe_error(exc)))
            continue
        conn.send(("ok", None))
