from __future__ import annotations

import math

import pytest
import torch

from pagedserve.sample.sampler import (Sampler, SamplingBatch, SamplingRow, apply_penalties, make_generator,
                                       sample)
from pagedserve.sampling_params import SamplingParams

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def run(logits: torch.Tensor, rows: list[SamplingRow]):
    return sample(logits, SamplingBatch.build(rows, logits.shape[1], logits.device))


def row(output_ids=(), prompt_ids=(0,), generator=None, eos=(), **kwargs) -> SamplingRow:
    return SamplingRow(SamplingParams(**kwargs), list(prompt_ids), list(output_ids), generator, list(eos))


@pytest.fixture(autouse=True)
def _seed_default_generator():
    torch.manual_seed(1234)


def crafted_logits(num_rows: int) -> torch.Tensor:
    # Token probabilities 0.4, 0.3, 0.15, 0.1, 0.05 and 0 for the last two.
    probs = torch.tensor([0.4, 0.3, 0.15, 0.1, 0.05, 0.0, 0.0])
    return probs.log().expand(num_rows, -1).clone()


@pytest.mark.parametrize("device", DEVICES)
def test_greedy_is_argmax_fast_path_and_mixed(device):
    logits = torch.randn(6, 50, device=device)
    batch = SamplingBatch.build([row(temperature=0.0) for _ in range(6)], 50, device)
    assert batch.no_processing and batch.temperature is None and batch.output_counts is None
    assert sample(logits, batch).sampled_token_ids == logits.argmax(-1).tolist()
    mixed = [row(temperature=0.0) if i % 2 == 0 else row(temperature=1.0) for i in range(6)]
    out = Sampler()(logits, SamplingBatch.build(mixed, 50, device)).sampled_token_ids
    assert out[::2] == logits.argmax(-1).tolist()[::2]


def test_top_k_one_equals_greedy():
    logits = torch.randn(32, 100) * 3
    rows = [row(temperature=0.5 + i * 0.1, top_k=1, seed=i, generator=make_generator(i, "cpu")) for i in range(32)]
    assert run(logits, rows).sampled_token_ids == logits.argmax(-1).tolist()
    # Also through the sort path (top_p set) and with top_k larger than the vocabulary meaning "all".
    rows = [row(top_k=1, top_p=0.9) for _ in range(32)]
    assert run(logits, rows).sampled_token_ids == logits.argmax(-1).tolist()
    assert run(logits[:1], [row(top_k=10_000)]).sampled_token_ids[0] in range(100)


@pytest.mark.parametrize("device", DEVICES)
def test_seeded_row_independent_of_batch(device):
    vocab = 64
    target = torch.randn(vocab, device=device)

    def draw(position: int, num_rows: int, mate_seed: int | None) -> list[int]:
        gen = make_generator(7, device)
        mates_gen = None if mate_seed is None else make_generator(mate_seed, device)
        tokens = []
        for _ in range(5):
            logits = torch.randn(num_rows, vocab, device=device)
            logits[position] = target
            rows = [row(temperature=0.8, top_p=0.95, generator=mates_gen, seed=mate_seed) if i % 2 else
                    row(temperature=0.0) for i in range(num_rows)]
            rows[position] = row(temperature=0.9, top_k=40, seed=7, generator=gen)
            tokens.append(run(logits, rows).sampled_token_ids[position])
        return tokens

    reference = draw(0, 1, None)
    assert draw(3, 5, None) == reference
    assert draw(1, 8, 99) == reference
    assert len(set(reference)) > 1  # the row really samples


def _draw_many(logits: torch.Tensor, **kwargs) -> set[int]:
    return set(run(logits, [row(**kwargs) for _ in range(logits.shape[0])]).sampled_token_ids)


@pytest.mark.parametrize("kwargs, allowed", [
    (dict(top_k=2), {0, 1}),
    (dict(top_k=4), {0, 1, 2, 3}),
    (dict(top_p=0.65), {0, 1}),
    (dict(top_p=0.8), {0, 1, 2}),
    (dict(min_p=0.3), {0, 1, 2}),
    (dict(min_p=0.5), {0, 1}),
    (dict(top_k=3, top_p=0.65), {0, 1}),
    (dict(top_k=4, min_p=0.3), {0, 1, 2}),
    (dict(temperature=2.0, top_p=0.65), {0, 1, 2}),  # temperature applies before top-p
    (dict(), {0, 1, 2, 3, 4}),
])
def test_truncation_never_picks_excluded_tokens(kwargs, allowed):
    if kwargs.get("temperature") == 2.0:
        # At T=2 the probabilities are proportional to sqrt(p), so two tokens no longer reach 0.65.
        p = torch.tensor([0.4, 0.3, 0.15, 0.1, 0.05]).sqrt()
        p = p / p.sum()
        assert p[:2].sum() < 0.65 < p[:3].sum()
    assert _draw_many(crafted_logits(3000), **kwargs) == allowed


@pytest.mark.parametrize("top_p", [1e-46, 1e-30])
def test_tiny_top_p_keeps_the_most_likely_token(top_p):
    # 1e-46 is 0 in fp32: every token's mass_before (>= 0) reached it, the whole row became -inf, and the
    # NaN softmax sampled token 0 (here never the most likely one).
    logits = torch.randn(64, 50) * 2
    logits[:, 0] = -10.0
    for kwargs in (dict(top_p=top_p), dict(top_p=top_p, top_k=5)):
        rows = [row(temperature=1.0, **kwargs) for _ in range(64)]
        assert run(logits, rows).sampled_token_ids == logits.argmax(-1).tolist()


def test_temperature_frequencies_match_softmax():
    logits = torch.tensor([1.0, 0.5, 0.0, -0.5, -1.0, 2.0])
    temperature = 0.7
    num_draws = 6000
    counts = torch.zeros(6)
    gen = make_generator(2024, "cpu")
    rows = [row(temperature=temperature, seed=2024, generator=gen) for _ in range(num_draws)]
    tokens = run(logits.expand(num_draws, -1).clone(), rows).sampled_token_ids
    counts += torch.bincount(torch.tensor(tokens), minlength=6)
    expected = (logits / temperature).softmax(-1) * num_draws
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    assert chi2 < 25.0, (counts, expected)  # df=5: p(chi2 > 20.5) = 0.001


def test_penalties_hand_computed():
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0]])
    rows = [row(prompt_ids=[0], output_ids=[2, 2, 1], repetition_penalty=2.0, frequency_penalty=0.5,
                presence_penalty=0.25)]
    batch = SamplingBatch.build(rows, 4, "cpu")
    # repetition (seen = {0, 1, 2}): 1.0, -2.0, 0.25, 3.0; frequency (counts 0,1,2,0): 1.0, -2.5, -0.75, 3.0;
    # presence: 1.0, -2.75, -1.0, 3.0
    assert apply_penalties(logits.clone(), batch).tolist() == [[1.0, -2.75, -1.0, 3.0]]


def test_presence_only_touches_output_tokens_and_changes_greedy():
    logits = torch.tensor([[3.0, 2.9, 0.0]])
    assert run(logits, [row(temperature=0.0, prompt_ids=[0], presence_penalty=0.5)]).sampled_token_ids == [0]
    assert run(logits, [row(temperature=0.0, output_ids=[0], presence_penalty=0.5)]).sampled_token_ids == [1]
    assert run(logits, [row(temperature=0.0, prompt_ids=[0], repetition_penalty=1.2)]).sampled_token_ids == [1]


def test_repetition_penalty_matches_transformers():
    from transformers import RepetitionPenaltyLogitsProcessor

    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 40, generator=gen) * 4
    histories = [([1, 5, 5, 9], [3, 1]), ([0], []), ([39, 20], [20, 7, 7, 7])]
    penalties = [1.3, 1.0, 0.7]
    rows = [row(prompt_ids=p, output_ids=o, repetition_penalty=r) for (p, o), r in zip(histories, penalties)]
    ours = apply_penalties(logits.clone(), SamplingBatch.build(rows, 40, "cpu"))
    for i, ((prompt, output), penalty) in enumerate(zip(histories, penalties)):
        theirs = RepetitionPenaltyLogitsProcessor(penalty)(torch.tensor([prompt + output]), logits[i:i + 1].clone())
        torch.testing.assert_close(ours[i:i + 1], theirs)


def test_min_tokens_masks_eos_and_stop_tokens():
    logits = torch.tensor([[0.0, 5.0, 4.0, 3.0]])  # eos = 1, stop token 2
    def greedy(n_out, **kw):
        return run(logits, [row(temperature=0.0, output_ids=[3] * n_out, eos=[1], stop_token_ids=[2],
                                **kw)]).sampled_token_ids[0]
    assert greedy(1, min_tokens=3) == 3
    assert greedy(3, min_tokens=3) == 1
    assert greedy(0) == 1
    assert greedy(1, min_tokens=3, ignore_eos=True) == 1  # eos would not stop, so it stays allowed
    # Random rows are masked too.
    rows = [row(output_ids=[], eos=[1], stop_token_ids=[2], min_tokens=1) for _ in range(500)]
    assert set(run(logits.expand(500, -1).clone(), rows).sampled_token_ids) <= {0, 3}


def test_logprobs_are_raw_log_softmax_with_ranks_and_top_k():
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(4, 30, generator=gen)
    original = logits.clone()
    rows = [row(temperature=0.0, logprobs=5, repetition_penalty=1.5, output_ids=[int(logits[0].argmax())]),
            row(temperature=1.3, top_k=3, logprobs=2),
            row(temperature=0.9),
            row(temperature=0.0, logprobs=0)]
    out = run(logits, rows)
    assert torch.equal(logits, original)  # the caller's logits are left alone
    raw = original.log_softmax(-1)
    for i, tok in enumerate(out.sampled_token_ids):
        assert out.logprobs[i] == pytest.approx(float(raw[i, tok]), abs=1e-6)
        assert out.ranks[i] == int((raw[i] >= raw[i, tok]).sum())
    assert out.ranks[0] > 1  # the penalty moved the choice off the raw argmax
    assert out.ranks[3] == 1
    top = out.top_logprobs
    assert [t for t, _ in top[0]] == raw[0].topk(5).indices.tolist()
    assert [lp for _, lp in top[0]] == pytest.approx(raw[0].topk(5).values.tolist(), abs=1e-6)
    assert [t for t, _ in top[1]] == raw[1].topk(2).indices.tolist()
    assert top[2] == [] and top[3] == []
    assert all(a[1] >= b[1] for a, b in zip(top[0], top[0][1:]))


def test_no_logprobs_when_not_requested():
    out = run(torch.randn(2, 10), [row(), row(temperature=0.0, presence_penalty=1.0)])
    assert out.logprobs is None and out.ranks is None and out.top_logprobs is None


def test_sampling_never_returns_masked_token_under_extreme_temperature():
    logits = torch.full((200, 8), -math.inf)
    logits[:, 3] = 0.0
    logits[:, 5] = -200.0
    assert set(run(logits, [row(temperature=100.0) for _ in range(200)]).sampled_token_ids) <= {3, 5}


@pytest.mark.parametrize("device", DEVICES)
def test_logit_bias_moves_greedy_and_random_rows(device):
    logits = torch.randn(4, 40, device=device)
    low = logits.argmin(-1).tolist()
    rows = [row(temperature=0.0, logit_bias={low[0]: 100.0}), row(temperature=0.0),
            row(temperature=1.0, logit_bias={low[2]: 100.0}), row(temperature=0.0, logit_bias={low[3]: -0.0})]
    batch = SamplingBatch.build(rows, 40, device)
    assert not batch.no_processing
    out = sample(logits, batch).sampled_token_ids
    argmax = logits.argmax(-1).tolist()
    assert out == [low[0], argmax[1], low[2], argmax[3]]
    # -100 removes the argmax in practice; the caller's logits are untouched.
    before = logits.clone()
    banned = run(logits[:1], [row(temperature=0.0, logit_bias={argmax[0]: -100.0})]).sampled_token_ids[0]
    assert banned == logits[0].topk(2).indices[1].item() and torch.equal(logits, before)


@pytest.mark.parametrize("device", DEVICES)
def test_allowed_token_ids_restrict_every_draw(device):
    vocab = 30
    logits = torch.randn(8, vocab, device=device)
    allowed = [3, 17, 29]
    rows = [row(temperature=1.0, allowed_token_ids=allowed) for _ in range(4)] + [row(temperature=1.0)] * 2 \
        + [row(temperature=0.0, allowed_token_ids=allowed), row(temperature=0.0)]
    for _ in range(20):
        out = run(logits, rows).sampled_token_ids
        assert all(t in allowed for t in out[:4] + out[6:7])
    assert out[6] == allowed[int(logits[6, allowed].argmax())]
    assert out[7] == logits[7].argmax().item()
    # Logprobs still describe the raw distribution, not the restricted one.
    raw = run(logits[:1], [row(temperature=0.0, allowed_token_ids=allowed, logprobs=1)])
    assert raw.logprobs[0] == pytest.approx(logits[0].log_softmax(-1)[raw.sampled_token_ids[0]].item(), abs=1e-5)


def test_logit_bias_and_allowed_ids_validation():
    assert SamplingParams(logit_bias={"5": 1}).logit_bias == {5: 1.0}
    with pytest.raises(ValueError, match="allowed_token_ids"):
        SamplingParams(allowed_token_ids=[])
    with pytest.raises(ValueError, match="logit_bias"):
        SamplingParams(logit_bias={"x": 1.0})
    with pytest.raises(ValueError, match="logit_bias"):
        SamplingParams(logit_bias={1: float("nan")})
