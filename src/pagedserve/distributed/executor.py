"""Rank 0's side of tensor parallelism: an Executor (worker/executor.py) that starts ranks 1..N-1, mirrors every
call to their workers, and turns any rank's death into EngineDeadError instead of a hang.

The engine core keeps one scheduler and one set of block tables and calls this executor exactly as the
single-process one. Each call goes to every rank's process first (a pipe per rank: the step's inputs are the
pickled scheduler plan, a few KB), then runs on rank 0's own Worker, whose collectives (gloo / NCCL) meet the
other ranks' inside the model; then every rank answers ok or its error.

    call ok on rank 0, every worker ok       -> rank 0's result (it sampled)
    same error on every rank                 -> that error (a request's own failure: the core isolates it)
    anything else: a worker exited, a pipe closed, an answer later than the collective timeout, ranks that
    disagree                                 -> EngineDeadError; the workers are stopped, and every later call
                                                raises it at once

A worker that stops responding without exiting (SIGSTOP, a frozen host) would hold rank 0 inside a collective
until its timeout: each worker beats a shared clock every 0.5 s, and a watchdog thread here kills a worker
whose beat is HEARTBEAT_TIMEOUT_S old, which ends rank 0's collective at once with the reason.

Ranks start by spawn (a fresh interpreter: no forked torch thread pools or CUDA state) without re-running the
user's main script: a script that builds LLM(tensor_parallel_size=N) at top level, with no
`if __name__ == "__main__":`, would otherwise build it again in every rank.
"""
from __future__ import annotations

import contextlib
import dataclasses
import logging
import multiprocessing as mp
import socket
import sys
import threading
import time
import weakref
from multiprocessing.connection import Connection

import torch

from pagedserve.config import EngineConfig
from pagedserve.core.scheduler_output import ModelRunnerOutput, SchedulerOutput
from pagedserve.distributed.parallel_state import (TensorParallelGroup, check_divisible, destroy_tensor_parallel,
                                                   init_tensor_parallel)
from pagedserve.distributed.rank_process import run_worker
from pagedserve.messages import EngineDeadError, describe_error
from pagedserve.model.loader import read_config, resolve_model_dir
from pagedserve.worker.executor import Executor
from pagedserve.worker.worker import KVCacheConfig

logger = logging.getLogger(__name__)

# Loading a slice of the model can take minutes for a big checkpoint; a worker that is alive gets this long.
LOAD_TIMEOUT_S = 1800.0
# After the slowest collective, a worker still returns from the model and writes its answer.
ANSWER_GRACE_S = 10.0
# A worker whose heartbeat (rank_process.HEARTBEAT_INTERVAL_S) is this old is stopped or frozen.
HEARTBEAT_TIMEOUT_S = 5.0


def answer_wait_s(timeout_s: float) -> float:
    # A worker blocked in a collective gives up after timeout_s, then answers.
    return timeout_s + min(ANSWER_GRACE_S, timeout_s)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def _without_main_script():
    # multiprocessing's spawn re-imports the parent's __main__ in the child (by path, or by module name for
    # `python -m`), which re-runs a script's top level. The ranks need nothing from __main__ (their target and
    # arguments live in pagedserve), so hide it while the processes start.
    main = sys.modules.get("__main__")
    saved = {k: main.__dict__[k] for k in ("__file__", "__spec__") if main is not None and k in main.__dict__}
    try:
        for k in saved:
            setattr(main, k, None)
        yield
    finally:
        for k, v in saved.items():
            setattr(main, k, v)


def _stop_workers(procs: list, conns: list[Connection]) -> None:
    for conn in conns:
        try:
            conn.send(("shutdown", ()))
        except (OSError, ValueError):
            pass
    deadline = time.monotonic() + 5.0
    for proc in procs:
        proc.join(max(0.0, deadline - time.monotonic()))
        if proc.is_alive():
            proc.kill()
            proc.join(1.0)
    for conn in conns:
        conn.close()
    destroy_tensor_parallel()


class MultiprocExecutor(Executor):
    runs_between_layers = False  # every rank would have to run the same other plan at the same layer

    def __init__(self, config: EngineConfig, device: torch.device) -> None:
        par = config.parallel
        if torch.distributed.is_initialized():
            raise ValueError("a tensor-parallel engine is already running in this process; shut it down first "
                             "(one process group per process)")
        # The heads must divide before any process starts.
        check_divisible(read_config(resolve_model_dir(config.model.model)[0]), par.tensor_parallel_size)
        self.world_size = par.tensor_parallel_size
        self.timeout_s = par.distributed_timeout_s
        self.dead: str | None = None
        self._plan: SchedulerOutput | None = None  # applied on rank 0, not yet sent
        init_method = f"tcp://127.0.0.1:{_free_port()}"
        ctx = mp.get_context("spawn")  # a fresh interpreter: no forked torch thread pools or CUDA state
        self.procs: list = []
        self.conns: list[Connection] = []
        self.heartbeats = [ctx.Value("d", 0.0, lock=False) for _ in range(1, self.world_size)]
        self.lost: str | None = None  # set by the watchdog: why a worker was killed
        with _without_main_script():
            for rank in range(1, self.world_size):
                parent_end, child_end = ctx.Pipe()
                proc = ctx.Process(target=run_worker, args=(rank, config, init_method, child_end,
                                                            self.heartbeats[rank - 1]),
                                   name=f"pagedserve-tp-rank{rank}", daemon=True)
                proc.start()
                child_end.close()
                self.procs.append(proc)
                self.conns.append(parent_end)
        # Workers are stopped when the engine is shut down, garbage-collected, or the interpreter exits.
        self._finalizer = weakref.finalize(self, _stop_workers, self.procs, self.conns)
        self._stop_watchdog = threading.Event()
        threading.Thread(target=_watchdog, args=(weakref.ref(self), self._stop_watchdog), daemon=True,
                         name="pagedserve-tp-watchdog").start()
        try:
            # Every rank's interpreter has started (a rank that exited on the way is named here, at once); then
            # the rendezvous, which waits for the slowest one (parallel_state.RENDEZVOUS_TIMEOUT_S).
            self._answers(LOAD_TIMEOUT_S)
            self.tp: TensorParallelGroup = init_tensor_parallel(0, self.world_size, init_method, device,
                                                                self.timeout_s)
            super().__init__(config, device)  # rank 0's worker loads its slice, then waits for the others'
        except BaseException:
            self.shutdown()
            raise

    def _tp_group(self) -> TensorParallelGroup:
        return self.tp

    @property
    def worker_pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    def shutdown(self) -> None:
        self._stop_watchdog.set()
        self._finalizer()

    def check_heartbeats(self, now: float) -> None:
        # Watchdog thread. Killing the silent worker ends rank 0's collective with it at once (the peer closes);
        # the engine thread then finds the worker dead and reports self.lost.
        for rank, (proc, beat) in enumerate(zip(self.procs, self.heartbeats), start=1):
            if beat.value and now - beat.value > HEARTBEAT_TIMEOUT_S and proc.is_alive() and self.lost is None:
                self.lost = (f"tensor-parallel rank {rank} (pid {proc.pid}) stopped responding: no heartbeat "
                             f"for {now - beat.value:.1f}s")
                logger.error("%s; killing it", self.lost)
                proc.kill()

    def _loaded_everywhere(self) -> None:
        # Each worker answers once its slice of the model is loaded (or with the error that stopped it).
        errors = self._answers(LOAD_TIMEOUT_S)
        if any(errors):
            self.shutdown()
            raise ValueError(f"a tensor-parallel rank failed to load the model: {next(e for e in errors if e)}")

    def initialize(self, kv_config: KVCacheConfig) -> None:
        super().initialize(kv_config)
        self._send("initialize", (kv_config,))
        errors = self._answers(LOAD_TIMEOUT_S)
        if any(errors):
            raise self._die(f"a rank failed to allocate its KV cache: {next(e for e in errors if e)}")

    def apply_plan(self, plan: SchedulerOutput) -> None:
        # Applied on rank 0 now; the plan travels to the other ranks with the next execute_model, so a step
        # costs one message and one answer per rank.
        try:
            super().apply_plan(plan)
        except Exception as exc:
            # Rank 0's batch has part of the plan and the others none of it: the ranks cannot agree again.
            raise self._die(f"rank 0 failed to apply a plan: {describe_error(exc)}") from exc
        # Only rank 0 samples: the grammar bitmask (KBs a constrained request) stays here.
        self._plan = plan if plan.grammar is None else dataclasses.replace(plan, grammar=None)

    def execute_model(self, num_scheduled_tokens: dict[str, int], propose_drafts: bool = True,
                      between_layers=None) -> ModelRunnerOutput:
        if between_layers is not None:
            raise ValueError("tensor-parallel steps do not run other plans between their layers")
        # Every worker runs the step (with the plan applied on rank 0 since the last one; a call without a new
        # plan, the core isolating a failing request, sends only the ids), rank 0 here; then the ranks must agree.
        plan, self._plan = self._plan, None
        method = "execute_model" if plan is None else "step"
        self._send(method, (num_scheduled_tokens, propose_drafts) if plan is None
                   else (plan, num_scheduled_tokens, propose_drafts))
        try:
            result = super().execute_model(num_scheduled_tokens, propose_drafts)
        except Exception as exc:  # noqa: BLE001 (classified below against the workers' answers)
            errors = self._answers(answer_wait_s(self.timeout_s), cause=exc)
            if all(e == describe_error(exc) for e in errors):
                raise  # the same failure everywhere: the request's, not the group's
            raise self._die(f"rank 0 failed with {describe_error(exc)} while the other ranks answered "
                            f"{errors}") from exc
        errors = self._answers(answer_wait_s(self.timeout_s))
        if any(errors):
            raise self._die(f"rank {1 + next(i for i, e in enumerate(errors) if e)} failed in {method}: "
                            f"{next(e for e in errors if e)}")
        return result

    def _send(self, method: str, args: tuple) -> None:
        if self.dead is not None:
            raise EngineDeadError(self.dead)
        if self.lost is not None:
            raise self._die(self.lost)
        for rank, conn in enumerate(self.conns, start=1):
            try:
                conn.send((method, args))
            except (OSError, ValueError) as exc:
                raise self._die(f"tensor-parallel rank {rank} is gone ({describe_error(exc)})") from exc

    def _answers(self, wait_s: float, cause: BaseException | None = None) -> list[str | None]:
        # One answer per worker: None for ok, else its error message.
        deadline = time.monotonic() + wait_s
        out: list[str | None] = []
        for rank, (proc, conn) in enumerate(zip(self.procs, self.conns), start=1):
            while not conn.poll(0.05):
                if not proc.is_alive():
                    raise self._die(f"tensor-parallel rank {rank} (pid {proc.pid}) exited with code "
                                    f"{proc.exitcode}") from cause
                if time.monotonic() > deadline:
                    raise self._die(f"tensor-parallel rank {rank} did not answer within {wait_s:g}s") from cause
            try:
                status, message = conn.recv()
            except (EOFError, OSError) as exc:
                raise self._die(f"tensor-parallel rank {rank} closed its pipe ({describe_error(exc)})") from exc
            out.append(None if status == "ok" else message)
        return out

    def _die(self, reason: str) -> EngineDeadError:
        # The group is broken (a collective may be half done); stop everything rather than guess.
        if self.dead is None:
            self.dead = f"{self.lost} ({reason})" if self.lost is not None else reason
            logger.error("tensor-parallel engine is dead: %s", reason)
            for proc in self.procs:  # no goodbye: a worker may be stuck in a collective or stopped
                if proc.is_alive():
                    proc.kill()
            self.shutdown()
        return EngineDeadError(self.dead)


def _watchdog(executor_ref: weakref.ref, stop: threading.Event) -> None:
    # Holds only a weak reference, so an executor dropped without shutdown is still garbage-collected.
    while not stop.wait(HEARTBEAT_TIMEOUT_S / 5):
        executor = executor_ref()
        if executor is None or executor.dead is not None:
            return
        executor.check_heartbeats(time.monotonic())
        del executor
