"""SchedulerOutput -> flat tensors -> model -> sampler. Reads requests, never mutates them."""
from __future__ import annotations

import torch

from pagedserve.attention.metadata import AttentionMetadata
from pagedserve.worker.kv_cache import apply_block_ops
from pagedserve.core.scheduler_output import ModelRunnerOutput, SchedulerOutput
from pagedserve.sample.sampler import Sampler, SamplingBatch, SamplingRow, make_generator


class ModelRunner:
    def __init__(self, model: torch.nn.Module, kv_caches: list[torch.Tensor], block_size: int,
                 vocab_size: int, device: torch.device) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.host_caches: list[torch.Tensor] = []  # the swap pool, set by the engine when swap_space > 0
        self.block_size = block_size
        self.vocab_size = vocab_size
        self.device = device
        self.sampler = Sampler()
        # Per-request seeded generators live as long as the request, so a seed gives one stream of draws
        # whatever batch the request lands in.
        self.generators: dict[str, torch.Generator] = {}

    def build_metadata(self, plan: SchedulerOutput) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        bs = self.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        seq_lens: list[int] = []
        query_lens: list[int] = []
        for s in plan.scheduled:
            n = len(s.token_ids)
            input_ids.extend(s.token_ids)
            pos = range(s.start_pos, s.start_pos + n)
            positions.extend(pos)
            table = s.block_ids
            slots.extend(table[p // bs] * bs + p % bs for p in pos)
            seq_lens.append(s.start_pos + n)
            query_lens.append(n)
        max_blocks = max(len(s.block_ids) for s in plan.scheduled)
        tables = [s.block_ids + [0] * (max_blocks - len(s.block_ids)) for s in plan.scheduled]
        qsl = [0]
        for n in query_lens:
            qsl.append(qsl[-1] + n)
        dev = self.device
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.long, device=dev),
            block_tables=torch.tensor(tables, dtype=torch.long, device=dev),
            seq_lens=torch.tensor(seq_lens, dtype=torch.long, device=dev),
            query_start_loc=torch.tensor(qsl, dtype=torch.long, device=dev),
            seq_lens_list=seq_lens, query_lens_list=query_lens, block_size=bs)
        return (torch.tensor(input_ids, dtype=torch.long, device=dev),
                torch.tensor(positions, dtype=torch.long, device=dev), meta)

    @torch.inference_mode()
    def execute(self, plan: SchedulerOutput) -> ModelRunnerOutput:
        for req_id in plan.finished_req_ids:
            self.generators.pop(req_id, None)
        apply_block_ops(plan.block_ops, self.kv_caches, self.host_caches)
        input_ids, positions, meta = self.build_metadata(plan)
        hidden = self.model(input_ids, positions, self.kv_caches, meta)

        # The LM head runs only on each sampled request's last token.
        sample_idx = []
        rows = []
        req_ids = []
        end = 0
        for s in plan.scheduled:
            end += len(s.token_ids)
            if not s.sample:
                continue
            req = s.request
            sample_idx.append(end - 1)
            req_ids.append(req.req_id)
            rows.append(SamplingRow(req.params, req.prompt_token_ids, req.output_token_ids,
                                    self._generator(req), list(req.eos_token_ids)))
        if not rows:
            return ModelRunnerOutput([], [])
        logits = self.model.compute_logits(hidden[torch.tensor(sample_idx, device=hidden.device)])
        out = self.sampler(logits, SamplingBatch.build(rows, self.vocab_size, logits.device))
        return ModelRunnerOutput(req_ids, out.sampled_token_ids, out.logprobs, out.top_logprobs, out.ranks)

    def _generator(self, req) -> torch.Generator | None:
        if req.params.seed is None:
            return None
        gen = self.generators.get(req.req_id)
        if gen is None:
            gen = self.generators[req.req_id] = make_generator(req.params.seed, self.device)
        return gen
