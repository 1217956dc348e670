"""The engine core's one handle on the workers (vLLM's Executor): this one runs a single Worker in this process;
distributed/executor.py's MultiprocExecutor runs rank 0 here and ranks 1..N-1 in their own processes.

    EngineCore                                  Executor
    kv_cache_spec(), kv_budget_bytes(),   --->  rank 0's answers (every rank holds the same block count)
    draft_kv()
    initialize(KVCacheConfig)             --->  every worker allocates its caches, builds its runner
    apply_plan(plan)                      --->  the plan's diff, block copies and swaps (once per plan)
    execute_model(scheduled)              --->  forward, sample, drafts; again on a subset when the core
                                                isolates a request whose step failed; where
                                                runs_between_layers, what the model calls between two layers
                                                when its flag is set (the core runs an urgent plan there)
"""
from __future__ import annotations

import torch

from pagedserve.config import EngineConfig
from pagedserve.core.scheduler_output import ModelRunnerOutput, SchedulerOutput
from pagedserve.distributed.parallel_state import TensorParallelGroup
from pagedserve.kv_spec import KVCacheSpec
from pagedserve.model.loader import LoadedModel
from pagedserve.model.layers.decoder_stack import BetweenLayers
from pagedserve.spec_decode.proposer import Proposer
from pagedserve.worker.memory import DraftKV
from pagedserve.worker.model_runner import ModelRunner
from pagedserve.worker.worker import KVCacheConfig, Worker


class Executor:
    # One worker in this process: a step may run another between its layers. Tensor-parallel ranks would all
    # have to, in step (distributed/executor.py: not yet).
    runs_between_layers = True

    def __init__(self, config: EngineConfig, device: torch.device) -> None:
        self.worker = Worker(config, device, self._tp_group())
        self.worker.load_model()
        self._loaded_everywhere()

    # Hooks for the multi-process executor: its process group, and the other ranks' load.
    def _tp_group(self) -> TensorParallelGroup | None:
        return None

    def _loaded_everywhere(self) -> None:
        pass

    @property
    def loaded(self) -> LoadedModel:
        # Rank 0's model, tokenizer and chat template; the front-end takes the text parts from here.
        return self.worker.loaded

    @property
    def model_runner(self) -> ModelRunner:
        # Rank 0's runner, for tests and benchmarks that inspect the input batch and the caches.
        return self.worker.model_runner

    @property
    def proposer(self) -> Proposer | None:
        # Rank 0's drafter (n-gram or draft model), for tests and benchmarks.
        return self.worker.proposer

    def kv_cache_spec(self) -> KVCacheSpec:
        return self.worker.kv_cache_spec()

    def draft_kv(self) -> DraftKV | None:
        return self.worker.draft_kv()

    def kv_budget_bytes(self) -> int:
        return self.worker.kv_budget_bytes()

    def initialize(self, kv_config: KVCacheConfig) -> None:
        self.worker.initialize(kv_config)

    def apply_plan(self, plan: SchedulerOutput) -> None:
        self.worker.apply_plan(plan)

    def disk_block_reader(self):
        return self.worker.disk_block_reader()  # the disk tier runs without tensor parallelism: rank 0's

    def execute_model(self, num_scheduled_tokens: dict[str, int], propose_drafts: bool = True,
                      between_layers: BetweenLayers | None = None) -> ModelRunnerOutput:
        return self.worker.execute_model(num_scheduled_tokens, propose_drafts, between_layers)

    def shutdown(self) -> None:
        pass  # one worker in this process holds nothing that needs stopping
