"""SchedulerOutput -> flat tensors -> model -> sampler. Reads requests, never mutates them."""
from __future__ import annotations

import itertools

import numpy as np
import torch

from pagedserve.attention.metadata import AttentionMetadata
from pagedserve.worker.kv_cache import apply_block_ops
from pagedserve.worker.prompt_logprobs import compute_prompt_logprobs, prompt_span
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
        # Python touches each scheduled request once (O(batch)); per-token work (positions, slots) is
        # vectorized in numpy, so a 512-token prefill chunk costs what a 1-token decode does.
        bs = self.block_size
        scheduled = plan.scheduled
        num_seqs = len(scheduled)
        query_lens = [len(s.token_ids) for s in scheduled]
        seq_lens = [s.start_pos + n for s, n in zip(scheduled, query_lens)]
        input_ids = np.fromiter(itertools.chain.from_iterable(s.token_ids for s in scheduled), dtype=np.int64,
                                count=sum(query_lens))
        max_blocks = max(len(s.block_ids) for s in scheduled)
        tables = np.zeros((num_seqs, max_blocks), dtype=np.int64)  # padded with block 0, never read
        for i, s in enumerate(scheduled):
            tables[i, :len(s.block_ids)] = s.block_ids
        qsl = np.zeros(num_seqs + 1, dtype=np.int64)
        np.cumsum(query_lens, out=qsl[1:])
        if qsl[-1] == num_seqs:  # pure decode: one token per sequence, at position seq_len - 1
            seq_idx = np.arange(num_seqs)
            positions = np.asarray(seq_lens, dtype=np.int64) - 1
        else:
            seq_idx = np.repeat(np.arange(num_seqs), query_lens)
            starts = np.asarray([s.start_pos for s in scheduled], dtype=np.int64)
            positions = np.arange(qsl[-1], dtype=np.int64) - qsl[seq_idx] + starts[seq_idx]
        slots = tables[seq_idx, positions // bs] * bs + positions % bs
        dev = self.device
        as_tensor = lambda a: torch.from_numpy(a).to(dev)  # noqa: E731  (no copy on CPU)
        meta = AttentionMetadata(
            slot_mapping=as_tensor(slots), block_tables=as_tensor(tables),
            seq_lens=torch.tensor(seq_lens, dtype=torch.long, device=dev), query_start_loc=as_tensor(qsl),
            seq_lens_list=seq_lens, query_lens_list=query_lens, block_size=bs)
        return as_tensor(input_ids), as_tensor(positions), meta

    @torch.inference_mode()
    def execute(self, plan: SchedulerOutput) -> ModelRunnerOutput:
        for req_id in plan.finished_req_ids:
            self.generators.pop(req_id, None)
        apply_block_ops(plan.block_ops, self.kv_caches, self.host_caches)
        if plan.is_empty:
            return ModelRunnerOutput([], [])
        input_ids, positions, meta = self.build_metadata(plan)
        hidden = self.model(input_ids, positions, self.kv_caches, meta)

        # The LM head runs only on each sampled request's last token, plus every prompt row of requests that
        # asked for prompt logprobs (worker/prompt_logprobs.py).
        sample_idx = []
        rows = []
        req_ids = []
        prompt_spans = []
        end = 0
        for s in plan.scheduled:
            req = s.request
            if req.params.prompt_logprobs is not None and (span := prompt_span(s, end)) is not None:
                prompt_spans.append(span)
            end += len(s.token_ids)
            if not s.sample:
                continue
            sample_idx.append(end - 1)
            req_ids.append(req.req_id)
            rows.append(SamplingRow(req.params, req.prompt_token_ids, req.output_token_ids,
                                    self._generator(req), list(req.eos_token_ids)))
        prompt_logprobs = compute_prompt_logprobs(self.model, hidden, prompt_spans) if prompt_spans else None
        if not rows:
            return ModelRunnerOutput([], [], prompt_logprobs=prompt_logprobs)
        logits = self.model.compute_logits(hidden[torch.tensor(sample_idx, device=hidden.device)])
        out = self.sampler(logits, SamplingBatch.build(rows, self.vocab_size, logits.device))
        return ModelRunnerOutput(req_ids, out.sampled_token_ids, out.logprobs, out.top_logprobs, out.ranks,
                                 prompt_logprobs)

    def _generator(self, req) -> torch.Generator | None:
        if req.params.seed is None:
            return None
        gen = self.generators.get(req.req_id)
        if gen is None:
            gen = self.generators[req.req_id] = make_generator(req.params.seed, self.device)
        return gen
