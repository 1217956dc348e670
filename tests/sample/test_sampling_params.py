from __future__ import annotations

import dataclasses

import pytest

from pagedserve.sampling_params import RequestOutputKind, BeamSearchParams, SamplingParams, SamplingType

# vLLM's SamplingParams defaults for the fields pagedserve supports.
VLLM_DEFAULTS = dict(
    n=1, best_of=None, presence_penalty=0.0, frequency_penalty=0.0, repetition_penalty=1.0,
    temperature=1.0, top_p=1.0, top_k=0, min_p=0.0, seed=None, stop=[], stop_token_ids=[],
    ignore_eos=False, max_tokens=16, min_tokens=0, logprobs=None, prompt_logprobs=None,
    skip_special_tokens=True, spaces_between_special_tokens=True, include_stop_str_in_output=False,
    logit_bias=None, allowed_token_ids=None, output_kind=RequestOutputKind.CUMULATIVE, structured_outputs=None,
)


def test_defaults_match_vllm():
    params = SamplingParams()
    assert {f.name: getattr(params, f.name) for f in dataclasses.fields(params)} == VLLM_DEFAULTS
    assert params.sampling_type is SamplingType.RANDOM
    assert not params.is_greedy


def test_stop_normalized_to_lists():
    assert SamplingParams(stop="###").stop == ["###"]
    assert SamplingParams(stop=("a", "b")).stop == ["a", "b"]
    assert SamplingParams(stop_token_ids=(5, 7)).stop_token_ids == [5, 7]


def test_greedy_clears_truncation_and_types():
    params = SamplingParams(temperature=0.0, top_p=0.5, top_k=3, min_p=0.2)
    assert params.is_greedy and params.sampling_type is SamplingType.GREEDY
    assert (params.top_p, params.top_k, params.min_p) == (1.0, 0, 0.0)
    assert SamplingParams(seed=3).sampling_type is SamplingType.RANDOM_SEED


def test_tiny_temperature_raised_like_vllm():
    assert SamplingParams(temperature=1e-6).temperature == pytest.approx(1e-2)


def test_valid_edges_accepted():
    SamplingParams(top_k=-1)
    SamplingParams(top_k=1, top_p=1.0, min_p=1.0, presence_penalty=-2.0, frequency_penalty=2.0)
    SamplingParams(max_tokens=None, min_tokens=100)
    SamplingParams(n=2, best_of=2, logprobs=0, prompt_logprobs=0, max_tokens=3, min_tokens=3)
    SamplingParams(seed=2 ** 64 - 3, n=3)
    SamplingParams(seed=-2 ** 63, n=1, best_of=4)
    SamplingParams(temperature=2, repetition_penalty=3, top_p=1)  # ints are numbers too


@pytest.mark.parametrize("kwargs, field", [
    (dict(n=0), "n"),
    (dict(n=3, best_of=2), "best_of"),
    (dict(presence_penalty=2.5), "presence_penalty"),
    (dict(presence_penalty=-2.1), "presence_penalty"),
    (dict(frequency_penalty=-3.0), "frequency_penalty"),
    (dict(frequency_penalty=2.01), "frequency_penalty"),
    (dict(repetition_penalty=0.0), "repetition_penalty"),
    (dict(repetition_penalty=-1.0), "repetition_penalty"),
    (dict(temperature=-0.1), "temperature"),
    (dict(temperature=float("nan")), "temperature"),
    (dict(top_p=0.0), "top_p"),
    (dict(top_p=1.1), "top_p"),
    (dict(top_k=-2), "top_k"),
    (dict(min_p=-0.1), "min_p"),
    (dict(min_p=1.5), "min_p"),
    (dict(max_tokens=0), "max_tokens"),
    (dict(min_tokens=-1), "min_tokens"),
    (dict(max_tokens=4, min_tokens=5), "min_tokens"),
    (dict(logprobs=-1), "logprobs"),
    (dict(prompt_logprobs=-1), "prompt_logprobs"),
    (dict(stop=["ok", ""]), "stop"),
    (dict(stop=""), "stop"),
    (dict(n=2, temperature=0.0), "n"),
    # Values that used to pass and then raise (or turn NaN) inside a shared engine step.
    (dict(seed=2 ** 64), "seed"),
    (dict(seed=-2 ** 63 - 1), "seed"),
    (dict(seed=2 ** 64 - 2, n=3), "seed"),           # sample 2 would use seed + 2
    (dict(seed=2 ** 64 - 2, n=1, best_of=3), "seed"),
    (dict(temperature=float("inf")), "temperature"),
    (dict(temperature=1e300), "temperature"),         # inf in the sampler's fp32
    (dict(repetition_penalty=float("inf")), "repetition_penalty"),
    (dict(repetition_penalty=float("nan")), "repetition_penalty"),
    (dict(presence_penalty=float("nan")), "presence_penalty"),
    (dict(frequency_penalty=float("inf")), "frequency_penalty"),
    (dict(top_p=float("nan")), "top_p"),
    (dict(min_p=float("nan")), "min_p"),
    (dict(top_k=2.5), "top_k"),
    (dict(n=True), "n"),
    (dict(seed=1.5), "seed"),
    (dict(max_tokens="8"), "max_tokens"),
    (dict(temperature="hot"), "temperature"),
    (dict(stop=["ok", 3]), "stop"),
    (dict(stop=5), "stop"),
    (dict(stop_token_ids=[1, None]), "stop_token_ids"),
    (dict(allowed_token_ids=["x"]), "allowed_token_ids"),
    (dict(logit_bias={1: float("inf")}), "logit_bias"),
    (dict(logit_bias={1: 1e300}), "logit_bias"),
    (dict(logit_bias={float("inf"): 1.0}), "logit_bias"),
])
def test_invalid_values_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=rf"\b{field}\b"):
        SamplingParams(**kwargs)


def test_clone_is_independent():
    params = SamplingParams(stop=["x"], stop_token_ids=[1])
    copy = params.clone()
    copy.stop.append("y")
    copy.stop_token_ids.append(2)
    assert params.stop == ["x"] and params.stop_token_ids == [1]


def test_beam_search_params():
    params = BeamSearchParams(beam_width=4, max_tokens=8)
    assert (params.ignore_eos, params.temperature, params.length_penalty) == (False, 0.0, 1.0)
    for kwargs, field in [(dict(beam_width=0, max_tokens=8), "beam_width"),
                          (dict(beam_width=2, max_tokens=0), "max_tokens"),
                          (dict(beam_width=2, max_tokens=8, temperature=-1.0), "temperature")]:
        with pytest.raises(ValueError, match=field):
            BeamSearchParams(**kwargs)
