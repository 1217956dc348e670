"""The worker's own copy of the requests it runs, updated from each plan's difference (vLLM V1's InputBatch).

Every request the worker has seen has a CachedRequestState (its tokens, sampling params, seeded generator)
from its first plan until the plan that reports it finished. A request that can run holds one row of the
preallocated numpy arrays below; preemption frees the row and keeps the state, and resuming takes a row again
with the whole new block table. The runner gathers a step's inputs from the rows, vectorized.

    row r:  token_ids[r, :num_tokens[r]]        prompt + outputs the worker knows of
            block_table[r, :num_blocks[r]]      the request's block table
            num_computed_tokens[r]              tokens whose K/V is in the cache when the step starts
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch

from pagedserve.core.scheduler_output import CachedRequestData, NewRequestData, SchedulerOutput
from pagedserve.sampling_params import SamplingParams


@dataclass(slots=True)
class CachedRequestState:
    req_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    params: SamplingParams
    eos_token_ids: list[int]
    generator: torch.Generator | None  # a seeded request's own stream; None draws from the runner's
    row: int | None = None             # None while preempted
    num_blocks: int = 0                # of its block table the row holds

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)


class InputBatch:
    def __init__(self, max_num_reqs: int, max_model_len: int, block_size: int) -> None:
        self.requests: dict[str, CachedRequestState] = {}
        max_num_reqs = max(max_num_reqs, 1)
        max_blocks = -(-max_model_len // block_size)
        # int32 as in vLLM: this array is max_num_seqs x max_model_len (256 x 128k would be 128 MiB).
        self.token_ids = np.zeros((max_num_reqs, max_model_len), dtype=np.int32)
        self.num_tokens = np.zeros(max_num_reqs, dtype=np.int64)
        self.num_computed_tokens = np.zeros(max_num_reqs, dtype=np.int64)
        # Padded with block 0 past num_blocks; attention never reads past a sequence's length.
        self.block_table = np.zeros((max_num_reqs, max_blocks), dtype=np.int64)
        self.num_blocks = np.zeros(max_num_reqs, dtype=np.int64)
        self.free_rows = list(range(max_num_reqs - 1, -1, -1))  # pop() hands out row 0 first
        # This plan's draft tokens by request. They sit in token_ids right after a row's num_tokens tokens,
        # which they never count in: the next plan's tokens overwrite them.
        self.spec_token_ids: dict[str, list[int]] = {}

    def row_of(self, req_id: str) -> int:
        row = self.requests[req_id].row
        if row is None:
            raise KeyError(f"request {req_id!r} is preempted and holds no batch row")
        return row

    def apply(self, plan: SchedulerOutput, make_generator: Callable[[int], torch.Generator]) -> None:
        for req_id in plan.finished_req_ids:
            state = self.requests.pop(req_id, None)
            if state is not None:
                self._free_row(state)
        for req_id in plan.preempted_req_ids:
            self._free_row(self.requests[req_id])
        for new in plan.scheduled_new_reqs:
            self._add(new, make_generator)
        self._update(plan.scheduled_cached_reqs)
        self.spec_token_ids = plan.scheduled_spec_decode_tokens
        for req_id, drafts in self.spec_token_ids.items():
            row = self.row_of(req_id)
            n = int(self.num_tokens[row])
            self._ensure_columns(n + len(drafts), 0)
            self.token_ids[row, n:n + len(drafts)] = drafts

    def _add(self, new: NewRequestData, make_generator: Callable[[int], torch.Generator]) -> None:
        p = new.sampling_params
        state = CachedRequestState(new.req_id, new.prompt_token_ids, [], p, list(new.eos_token_ids),
                                   None if p.seed is None else make_generator(p.seed))
        self.requests[new.req_id] = state
        row = self._take_row(state)
        n = len(new.prompt_token_ids)
        self._ensure_columns(n, len(new.block_ids))
        self.token_ids[row, :n] = new.prompt_token_ids
        self.num_tokens[row] = n
        self.num_computed_tokens[row] = new.num_computed_tokens
        m = len(new.block_ids)
        self.block_table[row, :m] = new.block_ids
        self.num_blocks[row] = state.num_blocks = m

    def _update(self, cached: CachedRequestData) -> None:
        # Python touches each request once; the array writes are gathered into one numpy call per array
        # (a decode step appends one token to each row).
        rows: list[int] = []
        states: list[CachedRequestState] = []
        tok_rows: list[int] = []
        tok_cols: list[int] = []
        tok_ids: list[int] = []
        blk_rows: list[int] = []
        blk_cols: list[int] = []
        blk_ids: list[int] = []
        for i, req_id in enumerate(cached.req_ids):
            state = self.requests[req_id]
            first_token = state.num_tokens
            state.output_token_ids.extend(cached.new_token_ids[i])
            if cached.resumed_from_preemption[i]:
                # The row was freed on preemption: write the whole request again.
                row = self._take_row(state)
                first_token = state.num_blocks = 0
                tokens = state.prompt_token_ids + state.output_token_ids
            else:
                row = state.row
                tokens = cached.new_token_ids[i]
            blocks = cached.new_block_ids[i]
            tok_rows += [row] * len(tokens)
            tok_cols += range(first_token, first_token + len(tokens))
            tok_ids += tokens
            blk_rows += [row] * len(blocks)
            blk_cols += range(state.num_blocks, state.num_blocks + len(blocks))
            blk_ids += blocks
            state.num_blocks += len(blocks)
            rows.append(row)
            states.append(state)
        if not rows:
            return
        self._ensure_columns(max(tok_cols, default=0) + 1, max(blk_cols, default=0) + 1)
        self.token_ids[tok_rows, tok_cols] = tok_ids
        self.block_table[blk_rows, blk_cols] = blk_ids
        self.num_tokens[rows] = [st.num_tokens for st in states]
        self.num_blocks[rows] = [st.num_blocks for st in states]
        self.num_computed_tokens[rows] = cached.num_computed_tokens

    def _take_row(self, state: CachedRequestState) -> int:
        if not self.free_rows:
            self._grow_rows()
        state.row = self.free_rows.pop()
        return state.row

    def _free_row(self, state: CachedRequestState) -> None:
        if state.row is not None:
            self.free_rows.append(state.row)
            state.row = None

    # The arrays are sized from max_num_seqs and max_model_len, which the scheduler never exceeds; growing
    # keeps a wrong bound from failing every request in flight.
    def _grow_rows(self) -> None:
        n = len(self.num_tokens)
        for name in ("token_ids", "num_tokens", "num_computed_tokens", "block_table", "num_blocks"):
            a = getattr(self, name)
            setattr(self, name, np.concatenate([a, np.zeros_like(a)]))
        self.free_rows = list(range(2 * n - 1, n - 1, -1))

    def _ensure_columns(self, num_tokens: int, num_blocks: int) -> None:
        if num_tokens > self.token_ids.shape[1]:
            self.token_ids = _widen(self.token_ids, num_tokens)
        if num_blocks > self.block_table.shape[1]:
            self.block_table = _widen(self.block_table, num_blocks)


def _widen(a: np.ndarray, min_cols: int) -> np.ndarray:
    out = np.zeros((a.shape[0], max(min_cols, 2 * a.shape[1])), dtype=a.dtype)
    out[:, :a.shape[1]] = a
    return out
