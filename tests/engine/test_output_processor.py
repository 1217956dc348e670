"""The front-end's output side (engine/output_processor.py) fed EngineCoreOutputs by hand: text against the
tokenizer's own decode, output kinds, stop strings, failures and aborts, best_of ranking."""
from __future__ import annotations

import pytest

from pagedserve.engine.output_processor import OutputProcessor
from pagedserve.messages import EngineCoreOutput, SampledLogprobs
from pagedserve.sampling_params import RequestOutputKind, SamplingParams
from tests.engine.test_processor import make_processor, tokenizer  # noqa: F401  (fixture)

TEXT = " Paris is the capital and largest city of France."


def start(tokenizer, params: SamplingParams, request_id: str = "r"):  # noqa: F811
    proc = make_processor(tokenizer)
    processed = proc.process(request_id, "Question: where?", params)
    out = OutputProcessor(tokenizer)
    out.add_request(processed)
    return out, processed


def feed(out: OutputProcessor, req_id: str, ids: list[int], chunk: int, last: EngineCoreOutput | None = None):
    results = []
    for i in range(0, len(ids), chunk):
        core_out = EngineCoreOutput(req_id, ids[i:i + chunk])
        if last is not None and i + chunk >= len(ids):
            last.new_token_ids = ids[i:i + chunk]
            core_out = last
        results.append(out.process_outputs([core_out]))
    return results


@pytest.mark.parametrize("chunk", [1, 3])  # 3: speculative steps bring several tokens at once
def test_delta_outputs_add_up_to_the_tokenizers_decode(tokenizer, chunk) -> None:  # noqa: F811
    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    out, _ = start(tokenizer, SamplingParams(output_kind=RequestOutputKind.DELTA))
    results = feed(out, "r", ids, chunk, EngineCoreOutput("r", [], finish_reason="length"))
    deltas = [r.request_outputs[0].outputs[0] for r in results]
    assert "".join(d.text for d in deltas) == tokenizer.decode(ids)
    assert [t for d in deltas for t in d.token_ids] == ids
    assert [d.finish_reason for d in deltas] == [None] * (len(deltas) - 1) + ["length"]
    assert not out.has_unfinished_requests()


def test_cumulative_and_final_only(tokenizer) -> None:  # noqa: F811
    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    out, _ = start(tokenizer, SamplingParams())
    results = feed(out, "r", ids, 2, EngineCoreOutput("r", [], finish_reason="length"))
    texts = [r.request_outputs[0].outputs[0].text for r in results]
    assert texts == [tokenizer.decode(ids[:min(i + 2, len(ids))]) for i in range(0, len(ids), 2)]
    out, _ = start(tokenizer, SamplingParams(output_kind=RequestOutputKind.FINAL_ONLY))
    results = feed(out, "r", ids, 2, EngineCoreOutput("r", [], finish_reason="length"))
    assert [len(r.request_outputs) for r in results] == [0] * (len(results) - 1) + [1]
    assert results[-1].request_outputs[0].outputs[0].text == tokenizer.decode(ids)


def test_stop_string_ends_the_sample_and_tells_the_core(tokenizer) -> None:  # noqa: F811
    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    out, _ = start(tokenizer, SamplingParams(stop=["capital"]))
    results = feed(out, "r", ids, 1)
    stopped = [r for r in results if r.stopped_core_ids]
    assert len(stopped) == 1 and stopped[0].stopped_core_ids == ["r"]
    final = stopped[0].request_outputs[0].outputs[0]
    assert final.text == " Paris is the " and final.finish_reason == "stop" and final.stop_reason == "capital"
    # Tokens the core computed before it heard of the stop are dropped.
    assert all(not r.request_outputs for r in results[results.index(stopped[0]) + 1:])


def test_an_error_fails_its_request_only(tokenizer) -> None:  # noqa: F811
    out, _ = start(tokenizer, SamplingParams(n=2, seed=1), "bad")
    processed_ok = make_processor(tokenizer).process("ok", [5, 6], SamplingParams())
    out.add_request(processed_ok)
    res = out.process_outputs([EngineCoreOutput("bad#0", [], "error", error="RuntimeError: boom"),
                               EngineCoreOutput("ok", [11])])
    assert res.failures == {"bad": "RuntimeError: boom"}
    assert res.aborted_core_ids == ["bad#0", "bad#1"]  # every sample of it (the core ignores ids it dropped)
    assert [o.request_id for o in res.request_outputs] == ["ok"]
    assert out.abort_requests(["ok"]) == ["ok"] and not out.has_unfinished_requests()


def test_best_of_returns_the_most_likely_samples(tokenizer) -> None:  # noqa: F811
    out, processed = start(tokenizer, SamplingParams(n=1, best_of=3, max_tokens=1))
    outs = []
    for i, (token, lp) in enumerate([(11, -3.0), (12, -0.5), (13, -2.0)]):
        outs.append(EngineCoreOutput(f"r#{i}", [token], "length", cumulative_logprob=lp,
                                     new_logprobs=SampledLogprobs([lp], [1], [[]])))
    res = out.process_outputs(outs)
    (final,) = res.request_outputs
    assert [c.token_ids for c in final.outputs] == [[12]] and final.outputs[0].logprobs is None
