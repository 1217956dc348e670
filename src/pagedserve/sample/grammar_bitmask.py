"""Structured outputs on the worker: the plan's token bitmask (core/scheduler_output.GrammarOutput) applied to
the logits before sampling. The worker holds no grammar: the engine core's matchers filled the bitmask.

    logits rows   [r0 a] [r1 a] [r2 d1] [r2 a] ...      a: a request's last row, d: a draft's row
    bitmask rows  grammar.req_ids = [r2, r0]            rows of requests under a grammar, any order
    -> logits row 0 masked with bitmask row 1, row 3 with row 0; the rest untouched
"""
from __future__ import annotations

import numpy as np
import torch

from pagedserve.core.scheduler_output import GrammarOutput


def apply_grammar_bitmask(logits: torch.Tensor, row_req_ids: list[str | None], grammar: GrammarOutput) -> None:
    """Sets, in place, logits[i, t] to -inf where row_req_ids[i] has a bitmask row that forbids token t; rows
    whose request has none (or whose id is None: draft rows) are left as they are."""
    src = {req_id: j for j, req_id in enumerate(grammar.req_ids)}
    rows = [(i, src[r]) for i, r in enumerate(row_req_ids) if r in src]
    if not rows:
        return
    import xgrammar as xgr

    # xgrammar's kernel takes one bitmask row per logits row and masks only the listed ones.
    indices = [i for i, _ in rows]
    bitmask = np.full((logits.shape[0], grammar.bitmask.shape[1]), -1, dtype=np.int32)
    bitmask[indices] = grammar.bitmask[[j for _, j in rows]]
    xgr.apply_token_bitmask_inplace(logits, torch.from_numpy(bitmask).to(logits.device, non_blocking=True),
                                    vocab_size=logits.shape[-1], indices=indices)
