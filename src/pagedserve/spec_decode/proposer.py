"""One interface for every drafter (n-gram lookup, draft model), driven by the Worker; the model runner only
executes the plan and verifies the drafts it carries.

After each forward and sampling the Worker hands its proposer a SampledStep and puts the answer into the step's
ModelRunnerOutput.draft_token_ids; the engine core turns those into the next plan's spec tokens:

    Worker.apply_plan(plan)      -> proposer.apply_plan(plan)    its own caches' block copies and swaps, and
                                                                 forgetting finished requests
    Worker.execute_model(...)    -> runner.execute_model(scheduled, proposer.draft_probs)
                                 -> proposer.propose(SampledStep) the next step's drafts by request

A proposer is called after every step that ran tokens, drafting or not (step.drafting is off above
disable_by_batch_size): the draft model records how far it lags.
"""
from __future__ import annotations

from collections.abc import Set
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from pagedserve.core.scheduler_output import ModelRunnerOutput, SchedulerOutput

if TYPE_CHECKING:
    import torch

    from pagedserve.worker.input_batch import InputBatch


@dataclass(frozen=True, slots=True)
class SampledStep:
    # What a proposer reads after a step. The input batch's rows still hold the step's starting state
    # (num_computed_tokens, num_tokens): the next plan updates them.
    batch: InputBatch
    num_scheduled_tokens: dict[str, int]
    out: ModelRunnerOutput
    generator: torch.Generator | None  # the runner's stream for requests without a seed
    drafting: bool                     # off above disable_by_batch_size: propose nothing
    undrafted: Set[str]                # switched off for low acceptance (spec_decode/acceptance.py)

    def tokens_after(self, j: int) -> np.ndarray:
        # Sampled row j's tokens after this step: the known tokens, the drafts it accepted (they sit right
        # after them in token_ids) and the token it sampled.
        out, batch = self.out, self.batch
        row = batch.row_of(out.req_ids[j])
        n = int(batch.num_tokens[row]) + (len(out.spec.accepted_token_ids[j]) if out.spec is not None else 0)
        return np.append(batch.token_ids[row, :n], out.sampled_token_ids[j])


class Proposer:
    # The drafts' distributions q by request ([k, V] rows; None for a greedy request), for the rejection
    # sampler of the step that verifies them. None: every draft is a point mass (n-gram).
    draft_probs: dict | None = None

    def apply_plan(self, plan: SchedulerOutput) -> None:
        pass  # n-gram lookup keeps no state between steps

    def propose(self, step: SampledStep) -> dict[str, list[int]]:
        raise NotImplementedError

