"""Batched next-token sampling over logits rows [N, V].

Order per step (as in vLLM): allowed_token_ids -> logit_bias -> min_tokens masking -> repetition / frequency /
presence penalties -> greedy rows take the argmax; random rows go through temperature -> top-k -> top-p ->
min-p -> one draw. Logprobs describe the raw model distribution (log_softmax before any of the above), which is vLLM's default.

A draw is an exponential race: argmax(p / q) with q ~ Exp(1) i.i.d. picks token i with probability p_i, and
needs neither normalized probabilities nor a cumulative sum. A seeded row draws its q from its own generator,
V numbers per step whatever the batch holds, so its tokens do not depend on its batch mates or position.
q is drawn as -log(U), U uniform: on CPU torch's exponential_ took 27.4 ms for 16 x 49,152 values against
6.0 ms for rand + log (2 threads, the Xeon of benchmarks/HISTORY.md), as long as the model's whole 16-stream
decode step.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from pagedserve import kernels
from pagedserve.sampling_params import SamplingParams

_NEG_INF = float("-inf")


def make_generator(seed: int, device: torch.device | str) -> torch.Generator:
    # The generator must live on the logits' device: exponential_ on a CUDA tensor rejects a CPU generator.
    return torch.Generator(device=torch.device(device)).manual_seed(seed)


@dataclass(slots=True)
class SamplingRow:
    params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    generator: torch.Generator | None = None  # from make_generator(params.seed, ...); None = shared default
    eos_token_ids: list[int] = field(default_factory=list)


@dataclass(slots=True)
class SamplingBatch:
    num_rows: int
    vocab_size: int
    all_greedy: bool
    all_random: bool
    # Each tensor below is None when no row in the batch uses that feature, so the step skips it.
    is_greedy: torch.Tensor | None = None  # [N] bool, only when greedy and random rows mix
    temperature: torch.Tensor | None = None  # [N] fp32, 1.0 on greedy rows
    top_k: torch.Tensor | None = None  # [N] int64, 0 = disabled on that row
    max_top_k: int = 0
    top_p: torch.Tensor | None = None  # [N] fp32
    min_p: torch.Tensor | None = None  # [N] fp32
    repetition_penalty: torch.Tensor | None = None  # [N, 1]
    frequency_penalty: torch.Tensor | None = None  # [N, 1]
    presence_penalty: torch.Tensor | None = None  # [N, 1]
    output_counts: torch.Tensor | None = None  # [N, V] fp32: occurrences of each token in the output
    prompt_mask: torch.Tensor | None = None  # [N, V] bool: token occurs in the prompt
    # Flat (row, token) pairs to ban: stop/eos tokens of rows still short of min_tokens.
    banned_rows: torch.Tensor | None = None
    banned_token_ids: torch.Tensor | None = None
    # Flat (row, token, value) triples of logit_bias; [N, V] bool mask of allowed_token_ids (True = keep).
    bias_rows: torch.Tensor | None = None
    bias_token_ids: torch.Tensor | None = None
    bias_values: torch.Tensor | None = None
    allowed_mask: torch.Tensor | None = None
    generators: list[torch.Generator | None] = field(default_factory=list)
    num_logprobs: list[int | None] = field(default_factory=list)
    max_num_logprobs: int | None = None  # None: no row asked for logprobs

    @property
    def no_processing(self) -> bool:
        return (self.all_greedy and self.output_counts is None and self.banned_rows is None
                and self.bias_rows is None and self.allowed_mask is None and self.max_num_logprobs is None)

    @classmethod
    def build(cls, rows: list[SamplingRow], vocab_size: int, device: torch.device | str) -> SamplingBatch:
        device = torch.device(device)
        params = [r.params for r in rows]
        greedy = [p.is_greedy for p in params]
        batch = cls(num_rows=len(rows), vocab_size=vocab_size, all_greedy=all(greedy),
                     all_random=not any(greedy), generators=[r.generator for r in rows],
                     num_logprobs=[p.logprobs for p in params])
        requested = [k for k in batch.num_logprobs if k is not None]
        if requested:
            batch.max_num_logprobs = min(max(requested), vocab_size)

        def vec(values, dtype=torch.float32):
            return torch.tensor(values, dtype=dtype, device=device)

        batch._build_distribution(params, vec)
        if any(p.has_penalties for p in params):
            batch._build_penalties(rows, device)

        banned_rows: list[int] = []
        banned_ids: list[int] = []
        for i, r in enumerate(rows):
            if len(r.output_token_ids) < r.params.min_tokens:
                # ignore_eos means eos would not end the request anyway, so it need not be banned.
                stops = list(r.params.stop_token_ids) + ([] if r.params.ignore_eos else list(r.eos_token_ids))
                ids = sorted({t for t in stops if 0 <= t < vocab_size})
                banned_rows += [i] * len(ids)
                banned_ids += ids
        if banned_rows:
            batch.banned_rows = vec(banned_rows, torch.int64)
            batch.banned_token_ids = vec(banned_ids, torch.int64)
        biased = [(i, t, v) for i, p in enumerate(params) for t, v in (p.logit_bias or {}).items()]
        if biased:
            rows_, ids_, values = zip(*biased)
            batch.bias_rows, batch.bias_token_ids = vec(rows_, torch.int64), vec(ids_, torch.int64)
            batch.bias_values = vec(values)
        if any(p.allowed_token_ids is not None for p in params):
            mask = torch.ones(batch.num_rows, vocab_size, dtype=torch.bool, device=device)
            for i, p in enumerate(params):
                if p.allowed_token_ids is not None:
                    mask[i] = False
                    mask[i, vec(p.allowed_token_ids, torch.int64)] = True
            batch.allowed_mask = mask
        return batch

    @classmethod
    def build_distribution(cls, params: list[SamplingParams], generators: list[torch.Generator | None],
                           vocab_size: int, device: torch.device | str) -> SamplingBatch:
        # Temperature, top-k, top-p and min-p only (random_probs' inputs): what a draft model samples with.
        greedy = [p.is_greedy for p in params]
        batch = cls(num_rows=len(params), vocab_size=vocab_size, all_greedy=all(greedy),
                    all_random=not any(greedy), generators=list(generators))
        batch._build_distribution(params, lambda v, dtype=torch.float32: torch.tensor(v, dtype=dtype, device=device))
        return batch

    def _build_distribution(self, params: list[SamplingParams], vec) -> None:
        if self.all_greedy:
            return
        greedy = [p.is_greedy for p in params]
        if not self.all_random:
            self.is_greedy = vec(greedy, torch.bool)
        self.temperature = vec([1.0 if g else p.temperature for g, p in zip(greedy, params)])
        if any(p.top_k >= 1 for p in params):
            ks = [min(p.top_k, self.vocab_size) if p.top_k >= 1 else 0 for p in params]
            self.top_k, self.max_top_k = vec(ks, torch.int64), max(ks)
        if any(p.top_p < 1.0 for p in params):
            self.top_p = vec([p.top_p for p in params])
        if any(p.min_p > 0.0 for p in params):
            self.min_p = vec([p.min_p for p in params])

    def _build_penalties(self, rows: list[SamplingRow], device: torch.device) -> None:
        n, v = self.num_rows, self.vocab_size
        penalized = [r.params.has_penalties for r in rows]

        def padded(lists: list[list[int]]) -> torch.Tensor:
            # Pad with v: counts land in a spare column v that is sliced off. Unpenalized rows stay empty.
            width = max((len(ids) for ids in lists), default=0)
            data = [ids + [v] * (width - len(ids)) for ids in lists]
            return torch.tensor(data, dtype=torch.int64).reshape(n, width).to(device)

        out_ids = padded([r.output_token_ids if p else [] for r, p in zip(rows, penalized)])
        counts = torch.zeros(n, v + 1, dtype=torch.float32, device=device)
        counts.scatter_add_(1, out_ids, torch.ones_like(out_ids, dtype=torch.float32))
        self.output_counts = counts[:, :v]
        params = [r.params for r in rows]
        column = lambda vals: torch.tensor(vals, dtype=torch.float32, device=device).unsqueeze(1)  # noqa: E731
        if any(p.repetition_penalty != 1.0 for p in params):
            self.repetition_penalty = column([p.repetition_penalty for p in params])
            prompt_ids = padded([r.prompt_token_ids if p.repetition_penalty != 1.0 else []
                                 for r, p in zip(rows, params)])
            mask = torch.zeros(n, v + 1, dtype=torch.bool, device=device)
            mask.scatter_(1, prompt_ids, True)
            self.prompt_mask = mask[:, :v]
        if any(p.frequency_penalty != 0.0 for p in params):
            self.frequency_penalty = column([p.frequency_penalty for p in params])
        if any(p.presence_penalty != 0.0 for p in params):
            self.presence_penalty = column([p.presence_penalty for p in params])


@dataclass(slots=True)
class SamplerOutput:
    sampled_token_ids: list[int]
    # The three below are None when no row asked for logprobs; otherwise filled for every row
    # (top_logprobs is [] on rows that did not ask).
    logprobs: list[float] | None = None  # logprob of each sampled token
    ranks: list[int] | None = None  # 1-based rank of each sampled token
    top_logprobs: list[list[tuple[int, float]]] | None = None  # (token id, logprob), most likely first


def greedy(logits: torch.Tensor) -> torch.Tensor:
    # logits.argmax(dim=-1); on CPU through the compiled kernel, which picks the same index (first maximum,
    # NaN first) about 10x faster than torch's (kernels/csrc/sampling_ops.cpp).
    ops = kernels.ops_for(logits, kernels.LAYER_DTYPES) if logits.dim() == 2 and logits.stride(-1) == 1 else None
    return logits.argmax(dim=-1) if ops is None else ops.argmax_rows(logits)


def sample(logits: torch.Tensor, batch: SamplingBatch) -> SamplerOutput:
    assert logits.shape == (batch.num_rows, batch.vocab_size), (tuple(logits.shape), batch.vocab_size)
    if batch.no_processing:
        return SamplerOutput(sampled_token_ids=greedy(logits).tolist())

    raw_logprobs = logits.float().log_softmax(dim=-1) if batch.max_num_logprobs is not None else None
    logits = apply_logits_processors(logits, batch)

    greedy_ids = None if batch.all_random else greedy(logits)
    if batch.all_greedy:
        token_ids = greedy_ids
    else:
        token_ids = _sample_random(logits, batch)
        if batch.is_greedy is not None:
            token_ids = torch.where(batch.is_greedy, greedy_ids, token_ids)

    out = SamplerOutput(sampled_token_ids=token_ids.tolist())
    if raw_logprobs is not None:
        out.logprobs, out.ranks, out.top_logprobs = compute_logprobs(raw_logprobs, token_ids, batch.num_logprobs)
    return out


def apply_logits_processors(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    # Everything before greedy / random selection, on a private fp32 copy (the caller's logits stay intact).
    # Speculative decoding runs the same steps on each draft position (spec_decode/rejection_sampler.py).
    logits = logits.to(torch.float32, copy=True)
    if batch.allowed_mask is not None:
        logits.masked_fill_(~batch.allowed_mask, _NEG_INF)
    if batch.bias_rows is not None:
        logits.index_put_((batch.bias_rows, batch.bias_token_ids), batch.bias_values, accumulate=True)
    if batch.banned_rows is not None:
        logits[batch.banned_rows, batch.banned_token_ids] = _NEG_INF
    if batch.output_counts is not None:
        logits = apply_penalties(logits, batch)
    return logits


class Sampler:
    # Stateless; a class so the model runner can hold one (vLLM's shape) and later variants can keep buffers.
    def __call__(self, logits: torch.Tensor, batch: SamplingBatch) -> SamplerOutput:
        return sample(logits, batch)


def apply_penalties(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    counts = batch.output_counts
    if batch.repetition_penalty is not None:
        # HF / CTRL style: a seen token's logit moves towards "less likely" whatever its sign.
        seen = batch.prompt_mask | (counts > 0)
        penalty = torch.where(seen, batch.repetition_penalty, 1.0)
        logits = torch.where(logits > 0, logits / penalty, logits * penalty)
    if batch.frequency_penalty is not None:
        logits = logits - batch.frequency_penalty * counts
    if batch.presence_penalty is not None:
        logits = logits - batch.presence_penalty * (counts > 0).float()
    return logits


def _sample_random(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    return draw(random_probs(logits, batch), batch.generators)


def random_probs(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    # temperature -> top-k -> top-p -> softmax -> min-p. Rows are not renormalized after min-p.
    logits = logits / batch.temperature.unsqueeze(1)
    if batch.top_k is not None or batch.top_p is not None:
        logits = apply_top_k_top_p(logits, batch.top_k, batch.max_top_k, batch.top_p)
    probs = logits.softmax(dim=-1)
    if batch.min_p is not None:
        # The race in draw() is scale-invariant per row, so masked probs need no renormalization.
        threshold = batch.min_p.unsqueeze(1) * probs.amax(dim=-1, keepdim=True)
        probs = probs.masked_fill(probs < threshold, 0.0)
    return probs


def draw(probs: torch.Tensor, generators: list[torch.Generator | None]) -> torch.Tensor:
    # One token per row with probability proportional to the row (unnormalized is fine): the exponential race.
    q = torch.empty_like(probs)
    gens = generators
    if all(g is gens[0] for g in gens):  # one stream for the whole batch (the engine's, or torch's default)
        q.uniform_(generator=gens[0] if gens else None)
    else:
        for i, g in enumerate(gens):
            q[i].uniform_(generator=g)
    # Exp(1) as -log(U). On CPU U is in [0, 1): U = 0 (p = 2^-24) gives inf, and that token only loses this
    # race. CUDA's U is in (0, 1]: U = 1 gives 0, and a zero would turn a masked 0/0 into NaN.
    q.log_().neg_()
    q.clamp_(min=torch.finfo(q.dtype).tiny)
    return greedy(probs / q)


def apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor | None, max_top_k: int,
                      top_p: torch.Tensor | None) -> torch.Tensor:
    # top-k keeps every token tied with the k-th largest logit, like vLLM, so k=1 equals argmax
    # unless the maximum is tied.
    if top_p is None:
        kth = logits.topk(max_top_k, dim=-1).values.gather(1, (top_k - 1).clamp(min=0).unsqueeze(1))
        kth = kth.masked_fill(top_k.unsqueeze(1) == 0, _NEG_INF)
        return logits.masked_fill(logits < kth, _NEG_INF)
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    if top_k is not None:
        kth = sorted_logits.gather(1, (top_k - 1).clamp(min=0).unsqueeze(1))
        kth = kth.masked_fill(top_k.unsqueeze(1) == 0, _NEG_INF)
        sorted_logits = sorted_logits.masked_fill(sorted_logits < kth, _NEG_INF)
    probs = sorted_logits.softmax(dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs
    # Keep the smallest prefix reaching top_p: drop a token once the tokens before it already hold top_p.
    # The most likely token always stays: a top_p below fp32's smallest subnormal (1e-46) is 0 here, and
    # 0 >= 0 would drop every token (an all -inf row samples garbage). Rows with top_p == 1 skip this
    # entirely so rounding in the cumsum cannot drop their tail.
    drop = (mass_before >= top_p.unsqueeze(1)) & (top_p < 1.0).unsqueeze(1)
    drop[:, 0] = False
    sorted_logits = sorted_logits.masked_fill(drop, _NEG_INF)
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)


def compute_logprobs(logprobs: torch.Tensor, token_ids: torch.Tensor, num_top: list[int | None]
                     ) -> tuple[list[float], list[int], list[list[tuple[int, float]]]]:
    # logprobs: [N, V] log_softmax rows; token_ids: [N] chosen tokens. Also serves prompt logprobs
    # (rows = prompt positions, token_ids = the next prompt tokens).
    chosen = logprobs.gather(1, token_ids.long().unsqueeze(1))
    ranks = (logprobs >= chosen).sum(dim=-1)  # ties count against the token, as in vLLM
    max_k = max((k for k in num_top if k is not None), default=0)
    top_lists: list[list[tuple[int, float]]] = [[] for _ in num_top]
    if max_k > 0:
        values, indices = logprobs.topk(min(max_k, logprobs.shape[1]), dim=-1)
        values, indices = values.tolist(), indices.tolist()
        for i, k in enumerate(num_top):
            if k:
                top_lists[i] = list(zip(indices[i][:k], values[i][:k]))
    return chosen.squeeze(1).tolist(), ranks.tolist(), top_lists
