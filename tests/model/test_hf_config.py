"""model/hf_config.py and the loader's tokenizer: the plain config and AutoTokenizer given it answer as
transformers' own objects do, and the serving load path does not import transformers' config classes."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
import transformers

from pagedserve.model import hf_config as hf_config_module
from pagedserve.model.hf_config import HFConfig, as_transformers_config, read_config
from pagedserve.model.layers.rotary import compute_inv_freq
from pagedserve.model.family import sliding_windows
from pagedserve.model.loader import load_tokenizer, resolve_model_dir
from tests.model.test_parity import CONFIGS


@pytest.fixture
def tmp_cache(tmp_path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("PAGEDSERVE_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_plain_config_equals_transformers(tmp_cache, name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    model_dir = tmp_cache / name
    CONFIGS[name]().save_pretrained(model_dir)
    expected = transformers.AutoConfig.from_pretrained(model_dir)
    first = read_config(str(model_dir))  # resolved by transformers, then cached
    monkeypatch.setattr(hf_config_module, "_resolve_with_transformers", lambda path: pytest.fail("cache missed"))
    got = read_config(str(model_dir))
    assert isinstance(got, HFConfig) and got == first
    for key, value in expected.to_dict().items():
        assert getattr(got, key) == json.loads(json.dumps(value)), key  # JSON turns int dict keys into str
    for field in ("num_key_value_heads", "head_dim", "rms_norm_eps", "tie_word_embeddings", "sliding_window",
                  "max_position_embeddings", "layer_types", "use_sliding_window", "attention_bias"):
        assert getattr(got, field, None) == getattr(expected, field, None), field
    assert sliding_windows(got) == sliding_windows(expected)
    head_dim = getattr(got, "head_dim", None) or got.hidden_size // got.num_attention_heads
    (inv_got, scale_got), (inv_exp, scale_exp) = compute_inv_freq(got, head_dim), compute_inv_freq(expected, head_dim)
    assert torch.equal(inv_got, inv_exp) and scale_got == scale_exp
    assert type(as_transformers_config(got)) is type(expected)


def test_edited_config_resolves_again(tmp_cache) -> None:
    model_dir = tmp_cache / "m"
    CONFIGS["llama"]().save_pretrained(model_dir)
    assert read_config(str(model_dir)).rms_norm_eps == 1e-6
    cfg = json.loads((model_dir / "config.json").read_text())
    (model_dir / "config.json").write_text(json.dumps({**cfg, "rms_norm_eps": 1e-5}))
    assert read_config(str(model_dir)).rms_norm_eps == 1e-5


def test_garbage_cache_entry_is_resolved_again(tmp_cache, monkeypatch: pytest.MonkeyPatch) -> None:
    model_dir = tmp_cache / "m"
    CONFIGS["llama"]().save_pretrained(model_dir)
    # What transformers resolves is not in question here (test_plain_config_equals_transformers): each resolve
    # answers its config.json as it is, and is counted.
    calls = []
    monkeypatch.setattr(hf_config_module, "_resolve_with_transformers",
                        lambda path: calls.append(path) or json.loads((model_dir / "config.json").read_text()))
    first = read_config(str(model_dir))
    [cached] = (tmp_cache / "cache" / "configs").glob("*.json")
    resolved = json.loads(cached.read_text())
    for garbage in (b"{not json", b"\xff\xfe", b"[1, 2]"):
        cached.write_bytes(garbage)
        assert read_config(str(model_dir)) == first
        assert json.loads(cached.read_text()) == resolved  # written again
    assert len(calls) == 4


def test_bad_config_raises_value_error(tmp_cache) -> None:
    (tmp_cache / "bad").mkdir()
    (tmp_cache / "bad" / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="cannot read config.json"):
        read_config(str(tmp_cache / "bad"))


@pytest.mark.parametrize("config", ["llama", "qwen2-tied-linear-rope"])
def test_tokenizer_is_autotokenizers_choice(embedded_model, tmp_cache, config: str) -> None:
    # The embedded tokenizer files beside a llama or a qwen2 config (transformers picks Qwen2Tokenizer there).
    model_dir = tmp_cache / config
    CONFIGS[config]().save_pretrained(model_dir)
    embedded_model.tokenizer.save_pretrained(model_dir)
    expected = transformers.AutoTokenizer.from_pretrained(model_dir)
    got = load_tokenizer(str(model_dir), read_config(str(model_dir)))
    assert type(got) is type(expected)
    text = "Hello, world! Ünïcode ✓ <|im_start|>user\nhi<|im_end|> 12345"
    assert got.encode(text) == expected.encode(text)
    assert got.decode(got.encode(text)) == expected.decode(expected.encode(text))


def test_embedded_tokenizer_and_chat_template_unchanged(embedded_model) -> None:
    # The serving path's tokenizer renders chat templates exactly as transformers' AutoTokenizer does.
    model_dir = resolve_model_dir(None, weights=False)[0]
    expected = transformers.AutoTokenizer.from_pretrained(model_dir)
    got = embedded_model.tokenizer
    assert type(got) is type(expected) and got.get_vocab() == expected.get_vocab()
    assert got.all_special_tokens == expected.all_special_tokens and got.eos_token_id == expected.eos_token_id
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather in Paris?"}]
    tools = [{"type": "function", "function": {"name": "get_weather", "description": "Current weather",
                                               "parameters": {"type": "object",
                                                              "properties": {"city": {"type": "string"}}}}}]
    for kwargs in ({}, {"add_generation_prompt": True}, {"tools": tools},
                   {"tools": tools, "add_generation_prompt": True}):
        assert got.apply_chat_template(messages, tokenize=False, **kwargs) == \
            expected.apply_chat_template(messages, tokenize=False, **kwargs), kwargs


@pytest.mark.parametrize("cache", ["warm", "empty"])
def test_serving_load_does_not_import_transformers_config_classes(embedded_model, tmp_path, cache: str) -> None:
    # Reading the config and loading the tokenizer imports neither the architecture's config module nor the
    # modeling stack behind it (sympy, accelerate): with the config cached (the embedded_model fixture
    # resolved it), and on a first start, where a child process converts the GGUF file and resolves them.
    code = ("import sys; from pagedserve.model.loader import load_tokenizer, read_config, resolve_model_dir; "
            "d = resolve_model_dir(None, weights=False)[0]; load_tokenizer(d, read_config(d)); "
            "print(sorted(m for m in sys.modules if m.startswith(('transformers.models.llama', 'sympy', "
            "'accelerate'))))")
    env = {**os.environ, **({"PAGEDSERVE_CACHE_DIR": str(tmp_path)} if cache == "empty" else {})}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_unwritable_cache_still_reads(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "cache").write_text("a file where the cache directory should be")
    monkeypatch.setenv("PAGEDSERVE_CACHE_DIR", str(tmp_path / "cache"))
    CONFIGS["llama"]().save_pretrained(tmp_path / "m")
    assert read_config(str(tmp_path / "m")).hidden_size == 64
