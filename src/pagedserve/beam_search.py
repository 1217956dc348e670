"""Beam search as vLLM runs it: each step asks the engine for one token per live beam with its top
2 x beam_width logprobs, then keeps the best beam_width continuations.

Beams of one prompt share their prefix through the block pool: every step's requests find the previous
step's full blocks in the prefix cache, so a beam only computes the tokens of its last, partial block.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from pagedserve.engine.processor import cache_salt_of
from pagedserve.outputs import Logprob
from pagedserve.sampling_params import BeamSearchParams, SamplingParams


@dataclass(slots=True)
class BeamSearchSequence:
    tokens: list[int]                 # prompt + generated
    logprobs: list[dict[int, Logprob]] = field(default_factory=list)
    cum_logprob: float = 0.0
    text: str | None = None
    finish_reason: str | None = None  # "stop" (eos) or "length"


@dataclass(slots=True)
class BeamSearchOutput:
    sequences: list[BeamSearchSequence]


def beam_score(tokens: list[int], cum_logprob: float, eos_token_id: int | None, length_penalty: float) -> float:
    # vLLM's (and HF's original) score: cumulative logprob over sequence length ** length_penalty, where the
    # length counts the prompt and leaves out a final eos.
    seq_len = len(tokens) - (1 if tokens and tokens[-1] == eos_token_id else 0)
    return cum_logprob / (seq_len ** length_penalty)


def run_beam_search(llm, prompts: list, params: BeamSearchParams) -> list[BeamSearchOutput]:
    engine = llm.llm_engine
    eos = engine.processor.eos_token_ids(SamplingParams())
    eos_id = eos[0] if eos else None
    width = params.beam_width
    step_params = SamplingParams(max_tokens=1, logprobs=2 * width, temperature=params.temperature,
                                 ignore_eos=True)

    def score(beam: BeamSearchSequence) -> float:
        return beam_score(beam.tokens, beam.cum_logprob, eos_id, params.length_penalty)

    prompt_ids = [engine.processor.tokenize(p)[1] for p in prompts]
    salts = [cache_salt_of(p) for p in prompts]  # every step's requests keep their prompt's cache salt
    for ids in prompt_ids:
        engine.processor.resolve_max_tokens(ids, SamplingParams(max_tokens=params.max_tokens))
    live = [[BeamSearchSequence(list(ids))] for ids in prompt_ids]
    completed: list[list[BeamSearchSequence]] = [[] for _ in prompts]
    for _ in range(params.max_tokens):
        flat = [(i, beam) for i, beams in enumerate(live) for beam in beams]
        if not flat:
            break
        outs = llm.generate([{"prompt_token_ids": beam.tokens, "cache_salt": salts[i]} for i, beam in flat],
                            step_params, use_tqdm=False)
        candidates: list[list[BeamSearchSequence]] = [[] for _ in prompts]
        for (i, beam), out in zip(flat, outs):
            for token, lp in out.outputs[0].logprobs[0].items():
                new = BeamSearchSequence(beam.tokens + [token], beam.logprobs + [{token: lp}],
                                         beam.cum_logprob + lp.logprob)
                if token in eos and not params.ignore_eos:
                    new.finish_reason = "stop"
                    completed[i].append(new)
                else:
                    candidates[i].append(new)
        live = [sorted(c, key=score, reverse=True)[:width] for c in candidates]
    tokenizer = engine.tokenizer
    results = []
    for i, ids in enumerate(prompt_ids):
        for beam in live[i]:
            beam.finish_reason = "length"
        best = sorted(completed[i] + live[i], key=score, reverse=True)[:width]
        for beam in best:
            beam.text = tokenizer.decode(beam.tokens[len(ids):], skip_special_tokens=True)
        results.append(BeamSearchOutput(best))
    return results
