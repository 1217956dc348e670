"""The rejection sampler keeps the target distribution exactly (chi-square over 20k draws, fp64)."""
from __future__ import annotations

import torch

from pagedserve.spec_decode.rejection_sampler import verify_drafts

N = 20_000
V = 6


def chi_square_p(counts: torch.Tensor, probs: torch.Tensor) -> float:
    # Pearson's test against the exact probabilities; cells the target never produces must stay empty.
    probs = probs.double()
    assert counts[probs == 0].sum() == 0, "a token the target gives probability 0 was emitted"
    keep = probs > 0
    n = counts.sum().double()
    expected = n * probs[keep] / probs[keep].sum()
    stat = ((counts[keep].double() - expected) ** 2 / expected).sum()
    df = int(keep.sum()) - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64), stat / 2))


def run(rows: list[torch.Tensor], drafts: list[int], num: int = N, seed: int = 0, draft_probs=None):
    # num identical requests in one batch: each has the target rows `rows` and the same drafts.
    probs = torch.stack(rows).repeat(num, 1)
    gen = torch.Generator().manual_seed(seed)
    q = None if draft_probs is None else torch.stack(draft_probs).repeat(num, 1)
    num_accepted, final = verify_drafts(probs, [list(drafts)] * num, [False] * num, [gen] * num, q)
    return torch.tensor(num_accepted), final


def dist(*values: float) -> torch.Tensor:
    p = torch.tensor(values, dtype=torch.float64)
    return p / p.sum()


P0 = dist(0.1, 0.35, 0.05, 0.2, 0.25, 0.05)
P1 = dist(0.3, 0.0, 0.1, 0.2, 0.15, 0.25)
P2 = dist(0.05, 0.05, 0.4, 0.1, 0.2, 0.2)


def first_tokens(num_accepted, final, drafts):
    return torch.where(num_accepted > 0, torch.tensor(drafts[0]), final)


def test_mixed_draft_emits_the_target_at_each_position():
    drafts = [1, 3]  # accepted with probability 0.35, then 0.2
    num_accepted, final = run([P0, P1, P2], drafts)
    first = first_tokens(num_accepted, final, drafts)
    assert chi_square_p(torch.bincount(first, minlength=V), P0) > 0.01
    # Given the first draft was accepted, the next token is P1's: d2 accepted or a recovered token.
    after = num_accepted >= 1
    second = torch.where(num_accepted[after] > 1, torch.tensor(drafts[1]), final[after])
    assert chi_square_p(torch.bincount(second, minlength=V), P1) > 0.01
    # And given both were accepted, the bonus token is P2's.
    assert chi_square_p(torch.bincount(final[num_accepted == 2], minlength=V), P2) > 0.01
    assert 0.3 < after.double().mean() < 0.4


def test_always_wrong_draft_recovers_the_target():
    # The draft has target probability 0: always rejected, and the recovered token alone carries P1.
    num_accepted, final = run([P1, P2], [1])
    assert (num_accepted == 0).all()
    assert chi_square_p(torch.bincount(final, minlength=V), P1) > 0.01


def test_always_right_draft_gets_the_bonus_token():
    sure = torch.zeros(V, dtype=torch.float64)
    sure[4] = 1.0
    num_accepted, final = run([sure, sure, P2], [4, 4])
    assert (num_accepted == 2).all()
    assert chi_square_p(torch.bincount(final, minlength=V), P2) > 0.01


def test_non_one_hot_draft_distribution():
    # A draft model proposes from q; acceptance min(1, p/q) and the residual max(0, p - q) give back p.
    q0 = dist(0.3, 0.3, 0.1, 0.1, 0.1, 0.1)
    gen = torch.Generator().manual_seed(1)
    drafts = torch.multinomial(q0, N, replacement=True, generator=gen).tolist()
    probs = torch.stack([P0, P2]).repeat(N, 1)
    num_accepted, final = verify_drafts(probs, [[d] for d in drafts], [False] * N, [gen] * N,
                                        q0.unsqueeze(0).repeat(N, 1))
    first = torch.where(torch.tensor(num_accepted) > 0, torch.tensor(drafts), final)
    assert chi_square_p(torch.bincount(first, minlength=V), P0) > 0.01


def test_the_check_can_fail():
    # The same statistic rejects a sampler that ignores the draft's residual (samples P0 after a rejection).
    num_accepted, final = run([P0, P1], [1])
    wrong = torch.where(num_accepted > 0, torch.tensor(1), torch.multinomial(P0, N, replacement=True))
    assert chi_square_p(torch.bincount(wrong, minlength=V), P0) < 1e-6


def test_greedy_accepts_while_the_draft_is_the_argmax():
    logits = torch.tensor([[0.0, 5.0, 1.0], [3.0, 0.0, 1.0], [0.0, 0.0, 9.0]])
    num_accepted, final = verify_drafts(logits, [[1, 2]], [True], [None])
    assert num_accepted == [1] and final.tolist() == [0]   # d2 = 2 is not the argmax 0: emit 0
    num_accepted, final = verify_drafts(logits, [[1, 0]], [True], [None])
    assert num_accepted == [2] and final.tolist() == [2]   # all accepted: the bonus argmax


def test_seeded_requests_are_reproducible_whatever_the_batch():
    rows = torch.stack([P0, P1, P2])

    def one(seed, mates):
        probs = torch.cat([rows] * (1 + mates))
        gens = [torch.Generator().manual_seed(seed)] + [torch.Generator().manual_seed(100 + i) for i in range(mates)]
        acc, fin = verify_drafts(probs, [[1, 3]] * (1 + mates), [False] * (1 + mates), gens)
        return acc[0], int(fin[0])

    runs = [[one(seed, mates) for seed in range(30)] for mates in (0, 3)]
    assert runs[0] == runs[1]


def test_a_draft_equal_to_the_target_is_always_accepted_in_bf16():
    # A bf16 model: the target's logits are bf16, the draft's q rows float32 (random_probs of the same logits).
    # With q == p every draft is accepted; rounding q to bf16 before the ratio rejected 5 of these 2,000.
    from pagedserve.sample.sampler import SamplingBatch, SamplingRow
    from pagedserve.sampling_params import SamplingParams
    from pagedserve.worker.model_runner import verify_output

    num, vocab = 2_000, 8
    gen = torch.Generator().manual_seed(3)
    logits = (torch.randn(num, 2, vocab, generator=gen) * 2).to(torch.bfloat16)
    drafts = torch.multinomial(logits[:, 0].float().softmax(-1), 1, generator=gen).squeeze(1).tolist()
    params = SamplingParams(temperature=1.0, seed=0)
    rows = [SamplingRow(params, [0], [0] * j, gen) for _ in range(num) for j in range(2)]
    batch = SamplingBatch.build(rows, vocab, torch.device("cpu"))
    q = logits[:, 0].float().softmax(-1)
    out = verify_output([str(i) for i in range(num)], [[d] for d in drafts], logits.reshape(2 * num, vocab),
                        batch, None, q)
    assert [len(a) for a in out.spec.accepted_token_ids] == [1] * num
