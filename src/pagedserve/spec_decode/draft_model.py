"""Draft-model speculation (vLLM's "draft_model" method): a second, smaller or cheaper model proposes k tokens.

KV: the draft's paged pool mirrors the target's physical blocks (same block ids, same slots), so the KV
manager allocates nothing for it. Invariant: after every step that proposes, the draft's K/V is valid at
every position the target has verified (num_computed_tokens), prefix-cache hits included (the request that
filled a cached block ran the draft on it as well). A step that proposes nothing (the batch is above
disable_by_batch_size) runs no draft forward: the draft lags, and catches up in one pass from where it
stopped (catch_up_start) when proposing resumes, so above the cut-off draft_model costs what speculation off
does. A block filled while the draft lagged may enter the prefix cache without the draft's K/V; a request
that hits it drafts worse there (acceptance only: the output stays the target's).

One step of the draft, after the target's step has verified its drafts (step()):

    position:   ... s ............ V-1 | V | V+1 ... V+k-1
    first pass:     [L, V): catch-up   | bonus -> d1          (one forward, all rows)
    next passes:                         d1 -> d2 ... -> dk   (k-1 single-token forwards, proposing rows)

Proposing feeds the draft the tokens the next step verifies (bonus, d1 .. d_{k-1}) at their positions, so
their K/V is already what a catch-up would compute: L skips every position whose proposed token was accepted
and whose slot is still the same. A round costs k draft forwards, not k + 1: the catch-up of an accepted
round is one token (dk, beside the bonus token). Positions past the request's allocated blocks go to scratch
blocks after the mirrored ones (one set per proposing row) and are recomputed.

Greedy requests draft the argmax; random ones sample from the request's own distribution (temperature,
top-k, top-p, min-p), and that q goes to the rejection sampler, which keeps the output exactly the target's
either way. A wrong draft K/V can only lower acceptance, never change the output.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np
import torch

from pagedserve.attention.kv_quant import storage_dtype
from pagedserve.attention.metadata import AttentionMetadata
from pagedserve.config import SpeculativeConfig
from pagedserve.core.scheduler_output import SchedulerOutput
from pagedserve.kv_spec import KVCacheSpec
from pagedserve.model.loader import LoadedModel, load_model
from pagedserve.model.weight_quant import apply_quantization, resolve_quantization
from pagedserve.sample.sampler import SamplingBatch, draw, random_probs
from pagedserve.sampling_params import SamplingParams
from pagedserve.spec_decode.proposer import Proposer, SampledStep
from pagedserve.worker.kv_cache import allocate, apply_block_ops


def draft_dtype(spec: SpeculativeConfig, target_dtype: torch.dtype) -> torch.dtype:
    return target_dtype if spec.dtype in (None, "auto") else getattr(torch, spec.dtype)


def load_draft(spec: SpeculativeConfig, device: torch.device, dtype: torch.dtype, attn_backend: str,
               tokenizer: str | None) -> LoadedModel:
    # "int8" on a GGUF file: dense fp32 first, then every weight requantized to Q8_0 blocks. On CPUs where
    # the Q8_0 kernel is much faster than Q4_1's (AVX2 without AVX-512: benchmarks/HISTORY.md, "Speculative
    # decoding") this is a self-draft several times cheaper than the target it approximates.
    requantize = spec.quantization == "int8" and not os.path.isdir(os.path.expanduser(spec.model))
    loaded = load_model(spec.model, device, dtype, attn_backend, tokenizer,
                        quantization="none" if requantize else spec.quantization)
    if requantize:
        resolve_quantization("int8", None, dtype, device)  # ValueError where the block kernels cannot run
        apply_quantization(loaded.model, "int8")
        loaded.quantization = "int8"
    return loaded


def check_same_vocab(target: LoadedModel, draft: LoadedModel) -> None:
    # Draft token ids are verified as target token ids: the two must mean the same text by the same id.
    if target.hf_config.vocab_size != draft.hf_config.vocab_size:
        raise ValueError(f"the draft model's vocabulary ({draft.hf_config.vocab_size} tokens) does not match "
                         f"the target's ({target.hf_config.vocab_size})")
    if target.tokenizer.get_vocab() != draft.tokenizer.get_vocab():
        raise ValueError("the draft model's tokenizer vocabulary differs from the target's")


@dataclass(slots=True)
class DraftRow:
    # One request of the target's step, as the draft sees it after verification.
    req_id: str
    blocks: np.ndarray              # the request's allocated block ids
    start: int                      # num_computed_tokens when the step started
    verified: int                   # num_computed_tokens after it (accepted drafts included)
    token_ids: np.ndarray           # the tokens at positions [start, verified)
    bonus: int | None = None        # the token sampled at `verified`; None = catch up only, no drafts
    params: SamplingParams | None = None
    generator: torch.Generator | None = None


@dataclass(slots=True)
class _Proposal:
    # What the last proposal fed the draft at positions start, start + 1, ..., in real (not scratch) slots.
    start: int
    token_ids: np.ndarray
    slots: np.ndarray


class DraftModel(Proposer):
    def __init__(self, loaded: LoadedModel, k: int, num_blocks: int, kv_spec: KVCacheSpec, max_num_reqs: int,
                 max_model_len: int, device: torch.device, prefault: bool = True) -> None:
        hf = loaded.hf_config
        self.model = loaded.model
        self.dtype = storage_dtype(kv_spec.kv_dtype)  # the draft's KV is stored in its model dtype
        self.quantization = loaded.quantization
        self.vocab_size = hf.vocab_size
        self.k = k
        self.num_blocks = num_blocks
        self.block_size = block_size = kv_spec.block_size
        self.max_model_len = max_model_len
        self.device = device
        # Proposing reaches k positions past the step's last allocated slot: ceil(k / bs) + 1 scratch blocks
        # per row cover it wherever the row's last block ends.
        self.num_scratch = num_scratch_blocks(k, block_size)
        self.kv_caches = allocate(kv_spec, num_blocks + max_num_reqs * self.num_scratch, device, prefault)
        self.host_caches: list[torch.Tensor] = []  # the swap pool's draft half, set by the worker
        self.load_offset = 0  # where the draft's K/V starts in a block loaded from disk (past the target's)
        self._proposals: dict[str, _Proposal] = {}
        self._valid: dict[str, int] = {}  # per request: the draft's K/V is valid below this position
        self.draft_probs: dict[str, torch.Tensor | None] = {}  # the proposed drafts' q rows ([k, V] or None)

    def apply_plan(self, plan: SchedulerOutput) -> None:
        # The draft's pool mirrors the target's block ids: the same copies, swaps and disk loads apply.
        apply_block_ops(plan.block_ops, self.kv_caches, self.host_caches, self.load_offset)
        for req_id in plan.finished_req_ids:
            self.draft_probs.pop(req_id, None)
            self._proposals.pop(req_id, None)
            self._valid.pop(req_id, None)

    def propose(self, step: SampledStep) -> dict[str, list[int]]:
        # Catches up on the step's verified tokens and drafts after each sampled token. A row's next token
        # sits at seq_len - drafts + accepted; rows too close to max_model_len only catch up; while drafting
        # is off the draft runs nothing and lags.
        batch, out = step.batch, step.out
        sampled = {r: j for j, r in enumerate(out.req_ids)}
        rows = []
        for req_id, num_tokens in step.num_scheduled_tokens.items():
            state = batch.requests[req_id]
            step_start = int(batch.num_computed_tokens[state.row])
            verified = step_start + num_tokens
            start = self.catch_up_start(req_id, step_start)
            row = DraftRow(req_id, batch.block_table[state.row, :batch.num_blocks[state.row]], start, verified,
                           batch.token_ids[state.row, start:verified])
            j = sampled.get(req_id)
            if j is not None:
                if out.spec is not None:
                    row.verified += len(out.spec.accepted_token_ids[j]) - out.spec.num_draft_tokens[j]
                    row.token_ids = row.token_ids[:row.verified - start]
                if step.drafting and req_id not in step.undrafted and row.verified + self.k <= self.max_model_len - 1:
                    row.bonus = out.sampled_token_ids[j]
                    row.params = state.params
                    row.generator = step.generator if state.generator is None else state.generator
            rows.append(row)
        draft_ids, q = self.step(rows)
        self.draft_probs.update(q)
        return draft_ids

    def catch_up_start(self, req_id: str, start: int) -> int:
        # The first position this step's draft may need: where the draft stopped if it lagged, else the
        # target's start (lower after a preemption; a new request's cached prefix counts as drafted).
        return min(self._valid.get(req_id, start), start)

    def _valid_until(self, row: DraftRow) -> int:
        # First position in [start, verified) whose draft K/V must be computed now.
        prop = self._proposals.get(row.req_id)
        if prop is None or prop.start != row.start:
            return row.start
        n = min(len(prop.token_ids), row.verified - row.start)
        pos = np.arange(row.start, row.start + n)
        same = (prop.token_ids[:n] == row.token_ids[:n]) & (prop.slots[:n] == self._slots(row.blocks, pos))
        return row.start + (n if same.all() else int(np.argmin(same)))

    def _slots(self, table: np.ndarray, pos: np.ndarray) -> np.ndarray:
        bs = self.block_size
        return table[pos // bs] * bs + pos % bs

    @torch.inference_mode()
    def step(self, rows: list[DraftRow]) -> tuple[dict[str, list[int]], dict[str, torch.Tensor | None]]:
        """Catches the draft's K/V up to each row's verified tokens and proposes k drafts for rows with a
        bonus token. Returns the drafts and their distributions q ([k, V]; None for greedy rows)."""
        k, dev = self.k, self.device
        if all(row.bonus is None for row in rows):  # nothing proposes: no forward, the draft lags
            for row in rows:
                self._valid[row.req_id] = row.start  # catch_up_start's: lower after a preemption
            return {}, {}
        runs, proposing = [], []
        for row in rows:
            first = self._valid_until(row)
            ids = row.token_ids[first - row.start:]
            if row.bonus is not None:
                ids = np.append(ids, row.bonus)
                proposing.append(len(runs))
            if len(ids):
                runs.append((row, first, ids))
        for row in rows:
            self._proposals.pop(row.req_id, None)
            self._valid[row.req_id] = row.verified
        # One table per run: its blocks, then scratch blocks past them (proposing rows only write there).
        ends = [first + len(ids) + (k - 1 if row.bonus is not None else 0) for row, first, ids in runs]
        width = max((e - 1) // self.block_size + 1 for e in ends)
        table = np.empty((len(runs), width), dtype=np.int64)
        for i, (row, _, _) in enumerate(runs):
            n = min(len(row.blocks), width)
            table[i, :n] = row.blocks[:n]
            scratch = self.num_blocks + i * self.num_scratch
            table[i, n:] = scratch + np.arange(width - n) % self.num_scratch
        query_lens = [len(ids) for _, _, ids in runs]
        positions = np.concatenate([np.arange(first, first + len(ids)) for _, first, ids in runs])
        seq_idx = np.repeat(np.arange(len(runs)), query_lens)
        slots = table[seq_idx, positions // self.block_size] * self.block_size + positions % self.block_size
        seq_lens = np.asarray([first + len(ids) for _, first, ids in runs], dtype=np.int64)
        qsl = np.zeros(len(runs) + 1, dtype=np.int64)
        np.cumsum(query_lens, out=qsl[1:])
        as_tensor = lambda a: torch.from_numpy(a).to(dev)  # noqa: E731  (no copy on CPU)
        meta = AttentionMetadata(
            slot_mapping=as_tensor(slots), block_tables=as_tensor(table), seq_lens=as_tensor(seq_lens),
            query_start_loc=as_tensor(qsl), seq_lens_list=seq_lens.tolist(), query_lens_list=query_lens,
            block_size=self.block_size)
        input_ids = as_tensor(np.concatenate([ids for _, _, ids in runs]).astype(np.int64))
        hidden = self.model(input_ids, as_tensor(positions), self.kv_caches, meta)
        last = torch.from_numpy(qsl[1:][proposing] - 1).to(dev)
        prop_rows = [runs[i][0] for i in proposing]
        ids, q = self._propose(hidden[last], table[proposing], seq_lens[proposing], prop_rows)
        return ({r.req_id: d for r, d in zip(prop_rows, ids)},
                {r.req_id: None if q is None else q[i] for i, r in enumerate(prop_rows)})

    def _propose(self, hidden: torch.Tensor, table: np.ndarray, seq_lens: np.ndarray, rows: list[DraftRow]
                 ) -> tuple[list[list[int]], torch.Tensor | None]:
        # hidden: each row's state at its bonus token (position seq_len - 1); k - 1 more single-token passes.
        k, bs, dev, num_rows = self.k, self.block_size, self.device, len(rows)
        sampling = SamplingBatch.build_distribution([r.params for r in rows], [r.generator for r in rows],
                                                    self.vocab_size, dev)
        greedy = None if sampling.all_greedy else (
            sampling.is_greedy if sampling.is_greedy is not None else torch.zeros(num_rows, dtype=torch.bool))
        # Every later pass's positions, slots and lengths at once: the loop only slices them.
        steps = seq_lens[None, :] + np.arange(k - 1)[:, None]                            # [k - 1, rows]
        slots = torch.from_numpy(table[np.arange(num_rows)[None, :], steps // bs] * bs + steps % bs)
        positions, lens = torch.from_numpy(steps), torch.from_numpy(steps + 1)
        lens_lists = (steps + 1).tolist()
        qsl = torch.arange(num_rows + 1, device=dev)
        table_t = torch.from_numpy(table).to(dev)
        query_lens = [1] * num_rows
        drafts, probs = [], []
        for j in range(k):
            if j:
                meta = AttentionMetadata(
                    slot_mapping=slots[j - 1].to(dev), block_tables=table_t, seq_lens=lens[j - 1].to(dev),
                    query_start_loc=qsl, seq_lens_list=lens_lists[j - 1], query_lens_list=query_lens,
                    block_size=bs)
                hidden = self.model(tokens, positions[j - 1].to(dev), self.kv_caches, meta)
            logits = self.model.compute_logits(hidden)
            tokens = logits.argmax(dim=-1)
            if greedy is not None:
                # The request's own distribution, as the target samples: the closer q is to p, the more
                # drafts are accepted; exactness needs only q as drawn from.
                q = random_probs(logits.float(), sampling)
                q = torch.where(greedy.unsqueeze(1), torch.nn.functional.one_hot(tokens, q.shape[1]).to(q.dtype), q)
                tokens = torch.where(greedy, tokens, draw(q, sampling.generators))
                probs.append(q)
            drafts.append(tokens)
        draft_ids = torch.stack(drafts, dim=1).tolist()
        # Remember what was fed where (bonus, d1 .. d_{k-1}), in real slots only, for the next step's catch-up.
        fed = np.column_stack([[r.bonus for r in rows]] + [[d[j] for d in draft_ids] for j in range(k - 1)])
        for i, r in enumerate(rows):
            pos = seq_lens[i] - 1 + np.arange(k)
            real = int(np.searchsorted(pos // bs, len(r.blocks)))  # positions inside allocated blocks
            self._proposals[r.req_id] = _Proposal(int(pos[0]), fed[i, :real].astype(np.int64),
                                                  self._slots(r.blocks, pos[:real]))
        return draft_ids, None if greedy is None else torch.stack(probs, dim=1)


def num_scratch_blocks(k: int, block_size: int) -> int:
    return -(-k // block_size) + 1
