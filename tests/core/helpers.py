from dataclasses import dataclass

from pagedserve.core.request import Request
from pagedserve.core.scheduler_output import ModelRunnerOutput, SchedulerOutput
from pagedserve.sampling_params import SamplingParams


def make_request(req_id: str, prompt_len: int, max_tokens: int = 8, first_token: int = 0) -> Request:
    prompt = [(first_token + i) % 1000 + 3 for i in range(prompt_len)]
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    return Request(req_id, prompt, params, max_tokens, eos_token_ids=(2,))


@dataclass(frozen=True, slots=True)
class Scheduled:
    # One scheduled request as the worker sees it after applying a plan.
    req_id: str
    token_ids: list[int]    # tokens whose K/V this step computes
    start_pos: int          # num_computed_tokens before the step
    block_ids: list[int]    # the whole block table
    sample: bool            # the step reaches the last token


class WorkerMirror:
    """A worker's view rebuilt from plans alone (what worker/input_batch.py keeps, without numpy), checked
    against the scheduler's own requests and block tables after every plan."""

    def __init__(self, sched) -> None:
        self.sched = sched
        self.tokens: dict[str, list[int]] = {}
        self.blocks: dict[str, list[int] | None] = {}   # None while preempted
        self.computed: dict[str, int] = {}

    def schedule(self) -> tuple[SchedulerOutput, list[Scheduled]]:
        plan = self.sched.schedule()
        return plan, self.apply(plan)

    def step(self, token: int = 7) -> tuple[SchedulerOutput, list[Scheduled]]:
        plan, scheduled = self.schedule()
        self.sched.update(plan, fake_run(scheduled, token))
        return plan, scheduled

    def apply(self, plan: SchedulerOutput) -> list[Scheduled]:
        for req_id in plan.finished_req_ids:
            del self.tokens[req_id], self.blocks[req_id], self.computed[req_id]
        for req_id in plan.preempted_req_ids:
            assert self.blocks[req_id] is not None
            self.blocks[req_id] = None
        for new in plan.scheduled_new_reqs:
            assert new.req_id not in self.tokens
            self.tokens[new.req_id] = list(new.prompt_token_ids)
            self.blocks[new.req_id] = list(new.block_ids)
            self.computed[new.req_id] = new.num_computed_tokens
        c = plan.scheduled_cached_reqs
        for req_id, resumed, tokens, blocks, computed in zip(c.req_ids, c.resumed_from_preemption, c.new_token_ids,
                                                             c.new_block_ids, c.num_computed_tokens):
            self.tokens[req_id] += tokens
            assert resumed == (self.blocks[req_id] is None)
            self.blocks[req_id] = list(blocks) if resumed else self.blocks[req_id] + blocks
            self.computed[req_id] = computed
        assert len(plan.scheduled_new_reqs) + c.num_reqs == len(plan.num_scheduled_tokens)
        assert sum(plan.num_scheduled_tokens.values()) == plan.total_num_scheduled_tokens
        out = []
        for req_id, n in plan.num_scheduled_tokens.items():
            req = self.sched.requests[req_id]
            tokens, start = self.tokens[req_id], self.computed[req_id]
            # The worker's copy equals the scheduler's truth.
            assert tokens == req.all_token_ids and start == req.num_computed_tokens
            assert self.blocks[req_id] == self.sched.kv.block_ids(req_id)
            out.append(Scheduled(req_id, tokens[start:start + n], start, self.blocks[req_id], start + n == len(tokens)))
        assert plan.num_sampling_reqs == sum(s.sample for s in out)
        return out


def fake_run(scheduled: list[Scheduled], token: int = 7) -> ModelRunnerOutput:
    ids = [s.req_id for s in scheduled if s.sample]
    return ModelRunnerOutput(ids, [token] * len(ids))
