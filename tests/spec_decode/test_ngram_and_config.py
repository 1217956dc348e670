"""The n-gram proposer and --speculative-config parsing (bad input is a ValueError naming the problem)."""
from __future__ import annotations

import argparse

import pytest

from pagedserve.config import SpeculativeConfig
from pagedserve.engine.arg_utils import EngineArgs
from pagedserve.spec_decode.ngram_proposer import NgramProposer


def test_longest_suffix_match_drafts_what_followed_it():
    p = NgramProposer(num_speculative_tokens=3, prompt_lookup_min=1, prompt_lookup_max=3)
    #          0  1  2  3  4  5  6  7  8  9
    tokens = [5, 6, 7, 8, 9, 1, 6, 7, 2, 6, 7]
    # Suffix [6, 7] (3-gram [2, 6, 7] never occurred before): latest earlier hit at 6 -> drafts 2, 6, 7.
    assert p.lookup(tokens) == [2, 6, 7]
    assert p.lookup(tokens, max_num_tokens=1) == [2]
    assert p.lookup([1, 2, 3]) == []                  # no earlier occurrence of any suffix
    assert p.lookup([4]) == [] and p.lookup([]) == []
    assert NgramProposer(2, 2, 2).lookup([1, 2, 3, 9, 3]) == []  # 1-grams are below prompt_lookup_min


def test_speculative_config_from_json_and_the_cli():
    parser = EngineArgs.add_cli_args(argparse.ArgumentParser())
    args = parser.parse_args(["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 5}'])
    config = EngineArgs.from_cli_args(args).create_engine_config()
    assert config.speculative == SpeculativeConfig(num_speculative_tokens=5)
    assert EngineArgs().create_engine_config().speculative is None


def test_disable_by_batch_size_default_is_the_methods():
    # "auto" (the default) becomes the method's measured cut-off; an explicit value or null is kept.
    assert SpeculativeConfig().disable_by_batch_size == 16
    draft = {"method": "draft_model", "model": "d.gguf"}
    assert SpeculativeConfig(**draft).disable_by_batch_size == 2
    assert SpeculativeConfig.parse(draft).disable_by_batch_size == 2
    assert SpeculativeConfig.parse({**draft, "disable_by_batch_size": "auto"}).disable_by_batch_size == 2
    assert SpeculativeConfig.parse({**draft, "disable_by_batch_size": 32}).disable_by_batch_size == 32
    assert SpeculativeConfig.parse('{"disable_by_batch_size": null}').disable_by_batch_size is None


@pytest.mark.parametrize("value, message", [
    ("{not json", "not valid JSON"),
    ('["ngram"]', "must be a JSON object"),
    ({"method": "medusa"}, "method must be one of"),
    ({"num_speculative_tokens": 0}, "num_speculative_tokens"),
    ({"prompt_lookup_min": 4, "prompt_lookup_max": 2}, "prompt_lookup_min"),
    ({"method": "draft_model"}, "needs 'model'"),
    ({"k": 3}, "unknown speculative_config keys"),
    ({"disable_by_batch_size": 0}, "disable_by_batch_size"),
    ({"disable_by_batch_size": "16"}, "disable_by_batch_size"),
    ({"disable_by_batch_size": 2.5}, "disable_by_batch_size"),
    ({"method": "draft_model", "model": "d.gguf", "quantization": "q2_k"}, "speculative quantization must be"),
])
def test_bad_speculative_config_is_a_value_error(value, message):
    with pytest.raises(ValueError, match=message):
        EngineArgs(speculative_config=value).create_engine_config()
