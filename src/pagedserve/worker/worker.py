"""One device or tensor-parallel rank: its models, its KV caches and the steps it runs (vLLM's Worker).

Rank 0 (in the engine process) and ranks 1..N-1 (distributed/rank_process.py) are this same class; only
rank 0 samples and proposes drafts. The executor drives it in this order:

    load_model()                 the target's weights (this rank's slice) and, for draft_model, the draft's
    kv_cache_spec() / draft_kv() the KV geometry here (rank 0's answers size the pool for every rank)
    kv_budget_bytes()            what this device offers the KV pools
    initialize(kv_config)        device, host (swap) and draft caches; the model runner and the proposer
    apply_plan(plan)             the plan's diff into the input batch, block copies and swaps (target and draft)
    execute_model(scheduled)     forward pass and sampling (the runner), then every request's drafts for the
                                 next step (the proposer: n-gram lookup or the draft model, one interface in
                                 spec_decode/proposer.py)
    disk_block_reader()          reads blocks just cached for the disk tier (--kv-offload-dir)
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from functools import partial

import torch

from pagedserve.config import EngineConfig
from pagedserve.core.scheduler_output import ModelRunnerOutput, SchedulerOutput
from pagedserve.distributed.parallel_state import TensorParallelGroup
from pagedserve.model.loader import LoadedModel, load_model
from pagedserve.model.layers.decoder_stack import BetweenLayers
from pagedserve.spec_decode.acceptance import AcceptanceTracker
from pagedserve.spec_decode.draft_model import (DraftModel, check_same_vocab, draft_dtype, load_draft,
                                                 num_scratch_blocks)
from pagedserve.spec_decode.ngram_proposer import NgramProposer
from pagedserve.spec_decode.proposer import Proposer, SampledStep
from pagedserve.kv_spec import KVCacheSpec, kv_cache_spec
from pagedserve.worker.gemm_caches import bound_gemm_caches
from pagedserve.worker.kv_cache import allocate, allocate_host
from pagedserve.worker.kv_offload import BlockViews, block_nbytes, read_block_groups
from pagedserve.worker.memory import DraftKV, kv_budget_bytes
from pagedserve.worker.model_runner import ModelRunner

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class KVCacheConfig:
    # What the engine core decided from rank 0's spec and budget; every rank allocates the same block counts.
    num_blocks: int
    num_host_blocks: int
    max_model_len: int


class Worker:
    def __init__(self, config: EngineConfig, device: torch.device, tp: TensorParallelGroup | None = None) -> None:
        self.config = config  # model dtype and KV dtype already resolved by the engine core
        self.device = device
        self.tp = tp
        self.is_driver = tp is None or tp.is_driver
        self.dtype = getattr(torch, config.model.dtype)
        self.loaded: LoadedModel | None = None
        self.draft: LoadedModel | None = None
        self.model_runner: ModelRunner | None = None
        self.proposer: Proposer | None = None  # rank 0's drafter: NgramProposer or DraftModel
        # Requests whose drafts are rarely accepted stop getting any (disable_by_acceptance_rate); rank 0 only.
        self.acceptance: AcceptanceTracker | None = None
        bound_gemm_caches()  # before the first forward (worker/gemm_caches.py)

    def load_model(self) -> LoadedModel:
        m = self.config.model
        # Ranks 1..N-1 load with "none": rank 0 resolved --quantization, and a quantized model refuses TP.
        self.loaded = load_model(m.model, self.device, self.dtype, m.attention_backend, m.tokenizer,
                                 m.quantization if self.is_driver else "none", tp=self.tp, load_format=m.load_format)
        if m.batch_invariant:
            self.loaded.model.set_batch_invariant(True)
        spec = self.config.speculative
        if spec is not None and spec.method == "draft_model":
            dtype = draft_dtype(spec, self.dtype)
            self.draft = load_draft(spec, self.device, dtype, m.attention_backend, m.tokenizer)
            check_same_vocab(self.loaded, self.draft)
            logger.info("draft model %s (%s, quantization %s), %d speculative tokens", self.draft.model_name,
                        dtype, self.draft.quantization, spec.num_speculative_tokens)
        return self.loaded

    def kv_cache_spec(self) -> KVCacheSpec:
        tp_size = self.tp.world_size if self.tp else 1
        return kv_cache_spec(self.loaded.hf_config, self.config.cache.block_size, self.config.cache.cache_dtype,
                             tp_size)

    def draft_kv_spec(self) -> KVCacheSpec | None:
        if self.draft is None:
            return None
        dtype_name = str(draft_dtype(self.config.speculative, self.dtype)).removeprefix("torch.")
        return kv_cache_spec(self.draft.hf_config, self.config.cache.block_size, dtype_name)

    def draft_kv(self) -> DraftKV | None:
        # The draft's bytes per mirrored block and its scratch blocks: the memory plan counts both.
        spec = self.draft_kv_spec()
        if spec is None:
            return None
        scratch = num_scratch_blocks(self.config.speculative.num_speculative_tokens, spec.block_size)
        return DraftKV(spec.bytes_per_block, self.config.scheduler.max_num_seqs * scratch)

    def kv_budget_bytes(self) -> int:
        return kv_budget_bytes(self.config.cache, self.device)

    def initialize(self, kv: KVCacheConfig) -> None:
        cfg, dev = self.config, self.device
        spec = self.kv_cache_spec()
        runner = ModelRunner(self.loaded.model, allocate(spec, kv.num_blocks, dev, cfg.cache.prefault_kv_cache), spec.block_size,
                             self.loaded.hf_config.vocab_size, dev, cfg.scheduler.max_num_seqs, kv.max_model_len,
                             cfg.model.seed, driver=self.is_driver)
        runner.host_caches = allocate_host(spec, kv.num_host_blocks, dev)
        self.model_runner = runner
        spec_cfg = cfg.speculative
        if self.draft is not None:
            draft_spec = self.draft_kv_spec()
            self.proposer = DraftModel(self.draft, spec_cfg.num_speculative_tokens, kv.num_blocks, draft_spec,
                                       cfg.scheduler.max_num_seqs, kv.max_model_len, dev, cfg.cache.prefault_kv_cache)
            self.proposer.host_caches = allocate_host(draft_spec, kv.num_host_blocks, dev)
            self.proposer.load_offset = block_nbytes(runner.kv_caches)  # a disk block: target's K/V, then draft's
        elif spec_cfg is not None and spec_cfg.method == "ngram" and self.is_driver:
            self.proposer = NgramProposer(spec_cfg.num_speculative_tokens, spec_cfg.prompt_lookup_min,
                                          spec_cfg.prompt_lookup_max)
        self.acceptance = AcceptanceTracker.from_config(spec_cfg) if self.is_driver else None

    def apply_plan(self, plan: SchedulerOutput) -> None:
        self.model_runner.update_states(plan)
        if self.proposer is not None:
            self.proposer.apply_plan(plan)
        if self.acceptance is not None:
            for req_id in plan.finished_req_ids:
                self.acceptance.forget(req_id)

    def disk_block_reader(self):
        # For the disk tier (worker/kv_offload.py): (block ids -> each block's K/V in file order, whether those
        # are views of the pool that the KV manager must pin until written).
        # With a draft model its mirrored block follows the target's.
        runner = self.model_runner
        groups = [runner.kv_caches] + ([self.proposer.kv_caches] if isinstance(self.proposer, DraftModel) else [])
        if self.device.type == "cpu":
            return BlockViews([cache for group in groups for cache in group]), True
        return partial(read_block_groups, groups), False

    def execute_model(self, num_scheduled_tokens: dict[str, int], propose_drafts: bool = True,
                      between_layers: BetweenLayers | None = None) -> ModelRunnerOutput:
        # propose_drafts is off in steps whose batch is above disable_by_batch_size: drafts would cost more
        # than they save (the draft model still records how far it lags). between_layers: the runner's.
        proposer = self.proposer
        out = self.model_runner.execute_model(num_scheduled_tokens, proposer.draft_probs if proposer else None,
                                              between_layers)
        if self.acceptance is not None and out.spec is not None:
            for req_id, drafted, accepted in zip(out.req_ids, out.spec.num_draft_tokens, out.spec.accepted_token_ids):
                self.acceptance.record(req_id, drafted, len(accepted))
        if proposer is not None and num_scheduled_tokens:
            undrafted = self.acceptance.disabled if self.acceptance is not None else frozenset()
            drafts = proposer.propose(SampledStep(self.model_runner.input_batch, num_scheduled_tokens, out,
                                                  self.model_runner.generator, propose_drafts, undrafted))
            if out.req_ids:
                out.draft_token_ids = drafts
        return out
