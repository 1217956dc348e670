"""SchedulerOutput -> the worker's input batch -> flat tensors -> model -> sampler.

The runner keeps its own state of every request (worker/input_batch.py), updated from each plan's
difference; it never sees or mutates the scheduler's requests.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from pagedserve.attention.metadata import AttentionMetadata
from pagedserve.core.scheduler_output import GrammarOutput, ModelRunnerOutput, SchedulerOutput, SpecDecodeOutput
from pagedserve.model.layers.decoder_stack import BetweenLayers
from pagedserve.sample.grammar_bitmask import apply_grammar_bitmask
from pagedserve.sample.sampler import Sampler, SamplingBatch, SamplingRow, make_generator
from pagedserve.spec_decode.rejection_sampler import rejection_sample
from pagedserve.worker.input_batch import InputBatch
from pagedserve.worker.kv_cache import apply_block_ops
from pagedserve.worker.prompt_logprobs import compute_prompt_logprobs, prompt_span


@dataclass(slots=True)
class StepInputs:
    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    req_ids: list[str]       # batch order
    query_lens: list[int]
    starts: np.ndarray       # num_computed_tokens of each sequence when the step starts
    sample: np.ndarray       # bool per sequence: the step reaches its last token
    long_rope: torch.Tensor | None = None  # per token: its sequence uses longrope's long factors


class ModelRunner:
    def __init__(self, model: torch.nn.Module, kv_caches: list[torch.Tensor], block_size: int,
                 vocab_size: int, device: torch.device, max_num_reqs: int = 64, max_model_len: int = 2048,
                 seed: int = 0, driver: bool = True) -> None:
        self.model = model
        # False on tensor-parallel ranks 1..N-1: they run the model (their collectives included) and leave
        # sampling to rank 0.
        self.driver = driver
        self.kv_caches = kv_caches
        self.host_caches: list[torch.Tensor] = []  # the swap pool, set by the engine when swap_space > 0
        self.block_size = block_size
        self.vocab_size = vocab_size
        self.device = device
        self.sampler = Sampler()
        self.input_batch = InputBatch(max_num_reqs, max_model_len, block_size)
        # Requests without a seed draw from this one stream, seeded by the engine's seed (--seed), so a
        # restart with the same seed and the same requests samples the same tokens. A seeded request keeps
        # its own generator for its lifetime, so its draws do not depend on its batch mates.
        self.generator = make_generator(seed, device)
        # The current plan's token bitmask (structured outputs): the logits of rows under a grammar are masked.
        self.grammar: GrammarOutput | None = None

    def _make_generator(self, seed: int) -> torch.Generator:
        return make_generator(seed, self.device)

    def build_metadata(self, num_scheduled_tokens: dict[str, int]) -> StepInputs:
        # Python touches each scheduled request once (O(batch)); per-token work (token ids, positions,
        # slots) is vectorized in numpy over the input batch's rows, so a 512-token prefill chunk costs what
        # a 1-token decode does.
        batch = self.input_batch
        bs = self.block_size
        req_ids = list(num_scheduled_tokens)
        query_lens = list(num_scheduled_tokens.values())
        num_seqs = len(req_ids)
        rows = np.fromiter((batch.row_of(r) for r in req_ids), dtype=np.int64, count=num_seqs)
        starts = batch.num_computed_tokens[rows]
        seq_lens = starts + np.asarray(query_lens, dtype=np.int64)
        tables = batch.block_table[rows, :int(batch.num_blocks[rows].max())]
        qsl = np.zeros(num_seqs + 1, dtype=np.int64)
        np.cumsum(query_lens, out=qsl[1:])
        if qsl[-1] == num_seqs:  # pure decode: one token per sequence, at position seq_len - 1
            seq_idx = np.arange(num_seqs)
            positions = seq_lens - 1
        else:
            seq_idx = np.repeat(np.arange(num_seqs), query_lens)
            positions = np.arange(qsl[-1], dtype=np.int64) - qsl[seq_idx] + starts[seq_idx]
        num_spec = np.fromiter((len(batch.spec_token_ids.get(r, ())) for r in req_ids), dtype=np.int64,
                               count=num_seqs)
        input_ids = batch.token_ids[rows[seq_idx], positions].astype(np.int64)
        slots = tables[seq_idx, positions // bs] * bs + positions % bs
        dev = self.device
        as_tensor = lambda a: torch.from_numpy(a).to(dev)  # noqa: E731  (no copy on CPU)
        meta = AttentionMetadata(
            slot_mapping=as_tensor(slots), block_tables=as_tensor(tables), seq_lens=as_tensor(seq_lens),
            query_start_loc=as_tensor(qsl), seq_lens_list=seq_lens.tolist(), query_lens_list=query_lens,
            block_size=bs)
        # longrope: a sequence of more than the switch length uses the long factors at all its positions.
        # The scheduler recomputes a sequence's K/V when it grows past the switch (core/scheduler.py), so
        # its cached keys were always turned with the factors of its current length.
        switch = getattr(self.model, "longrope_switch", None)
        long_rope = None if switch is None else as_tensor((batch.num_tokens[rows] > switch)[seq_idx])
        return StepInputs(as_tensor(input_ids), as_tensor(positions), meta, req_ids, query_lens, starts,
                          seq_lens == batch.num_tokens[rows] + num_spec, long_rope)

    def execute(self, plan: SchedulerOutput) -> ModelRunnerOutput:
        self.update_states(plan)
        return self.execute_model(plan.num_scheduled_tokens)

    def update_states(self, plan: SchedulerOutput) -> None:
        # Bookkeeping only (the plan's diff into the input batch, block copies and swaps): done once per plan.
        self.input_batch.apply(plan, self._make_generator)
        self.grammar = plan.grammar  # for every execute_model of this plan (the core may run it in parts)
        apply_block_ops(plan.block_ops, self.kv_caches, self.host_caches)

    @torch.inference_mode()
    def execute_model(self, num_scheduled_tokens: dict[str, int],
                      draft_probs: dict[str, torch.Tensor | None] | None = None,
                      between_layers: BetweenLayers | None = None) -> ModelRunnerOutput:
        # Runs the scheduled tokens of requests already in the input batch and verifies the drafts the plan
        # carries (draft_probs: the draft model's q rows by request; None: point masses). Running it again for
        # a subset (the engine core isolating a failing request) recomputes the same K/V into the same slots.
        # Proposing the next drafts is the worker's (spec_decode/proposer.py).
        # between_layers: called between two layers when its flag is set; the engine core may run another plan
        # (update_states, then execute_model) of requests not in this step; this step's inputs are built by
        # then, and its plan's bitmask is kept for its sampling below.
        if not num_scheduled_tokens:  # finished ids and swap-outs only
            return ModelRunnerOutput([], [])
        step = self.build_metadata(num_scheduled_tokens)
        extra = {} if step.long_rope is None else {"long_rope": step.long_rope}
        grammar = self.grammar
        if between_layers is not None:
            extra["between_layers"] = between_layers
        hidden = self.model(step.input_ids, step.positions, self.kv_caches, step.meta, **extra)
        self.grammar = grammar

        # The LM head runs only on each sampled request's last token, plus every prompt row of requests that
        # asked for prompt logprobs (worker/prompt_logprobs.py).
        requests = self.input_batch.requests
        spec = self.input_batch.spec_token_ids
        sample_idx = []
        rows = []
        req_ids = []
        drafts = []
        prompt_spans = []
        end = 0
        for i, req_id in enumerate(step.req_ids):
            state = requests[req_id]
            num_new = step.query_lens[i]
            if state.params.prompt_logprobs is not None:
                span = prompt_span(req_id, state.prompt_token_ids, int(step.starts[i]), num_new,
                                   state.params.prompt_logprobs, end)
                if span is not None:
                    prompt_spans.append(span)
            end += num_new
            if not step.sample[i]:
                continue
            req_ids.append(req_id)
            gen = self.generator if state.generator is None else state.generator
            req_drafts = spec.get(req_id, [])
            drafts.append(req_drafts)
            # A request with k drafts samples at its last k + 1 positions; at each one, penalties and
            # min_tokens see the drafts before it as output tokens.
            for i in range(len(req_drafts) + 1):
                sample_idx.append(end - 1 - len(req_drafts) + i)
                out_ids = state.output_token_ids + req_drafts[:i] if i else state.output_token_ids
                rows.append(SamplingRow(state.params, state.prompt_token_ids, out_ids, gen, state.eos_token_ids))
        prompt_logprobs = compute_prompt_logprobs(self.model, hidden, prompt_spans) if prompt_spans else None
        if not rows:
            return ModelRunnerOutput([], [], prompt_logprobs=prompt_logprobs)
        logits = self.model.compute_logits(hidden[torch.tensor(sample_idx, device=hidden.device)])
        if not self.driver:
            return ModelRunnerOutput([], [])
        if self.grammar is not None:
            # One logits row per sampled position; requests under a grammar get no drafts (the engine core
            # skips them), so their only row is their last one and draft rows are never masked.
            row_req_ids = [rid if j == len(d) else None for rid, d in zip(req_ids, drafts) for j in range(len(d) + 1)]
            apply_grammar_bitmask(logits, row_req_ids, self.grammar)
        batch = SamplingBatch.build(rows, self.vocab_size, logits.device)
        if spec:
            out = verify_output(req_ids, drafts, logits, batch, prompt_logprobs,
                                self._draft_q(req_ids, drafts, draft_probs))
        else:
            s = self.sampler(logits, batch)
            out = ModelRunnerOutput(req_ids, s.sampled_token_ids, s.logprobs, s.top_logprobs, s.ranks,
                                    prompt_logprobs)
        return out

    def _draft_q(self, req_ids: list[str], drafts: list[list[int]],
                 draft_probs: dict[str, torch.Tensor | None] | None) -> torch.Tensor | None:
        # The draft distributions of the drafts being verified; the scheduler may have cut a request's
        # drafts short, never reordered them, so its first rows are the ones.
        if draft_probs is None:
            return None
        q = [(draft_probs[r], len(d)) for r, d in zip(req_ids, drafts) if d]
        if all(rows is None for rows, _ in q):
            return None  # every draft greedy (a greedy request is verified against the argmax only)
        # A greedy request proposed beside random ones has one-hot rows; alone it had none: one-hot them.
        return torch.cat([rows[:n] if rows is not None else
                          torch.nn.functional.one_hot(torch.tensor(d, device=self.device), self.vocab_size).float()
                          for (rows, n), d in zip(q, [d for d in drafts if d])])


def verify_output(req_ids: list[str], drafts: list[list[int]], logits: torch.Tensor, batch: SamplingBatch,
                  prompt_logprobs, draft_probs: torch.Tensor | None = None) -> ModelRunnerOutput:
    # Speculative step: each row's accepted drafts go in SpecDecodeOutput, its last token where a plain
    # step puts its sampled one.
    starts = np.cumsum([0] + [len(d) + 1 for d in drafts[:-1]])
    gens = [batch.generators[s] for s in starts]
    v = rejection_sample(logits, batch, drafts, gens, draft_probs)
    out = ModelRunnerOutput(req_ids, v.sampled_token_ids, prompt_logprobs=prompt_logprobs,
                            spec=SpecDecodeOutput(v.accepted_token_ids, [len(d) for d in drafts]))
    if v.logprobs is not None:
        out.logprobs = [lp[-1] for lp in v.logprobs]
        out.ranks = [r[-1] for r in v.ranks]
        out.top_logprobs = [t[-1] for t in v.top_logprobs]
        out.spec.logprobs = [lp[:-1] for lp in v.logprobs]
        out.spec.ranks = [r[:-1] for r in v.ranks]
        out.spec.top_logprobs = [t[:-1] for t in v.top_logprobs]
    return out
