from __future__ import annotations

import re

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pagedserve.engine.detokenizer import IncrementalDetokenizer, decode_token
from pagedserve.sampling_params import SamplingParams

EOS = 2  # <|im_end|>
PROMPT = "<|im_start|>user\nSay something<|im_end|>\n<|im_start|>assistant\n"
SAMPLES = ["héllo 🙂 世界, 你好! ñandú", "emoji 👩‍👩‍👧 and 🇯🇵 flags", "tabs\tand\nnewlines  x", "ÄÖÜ ß € ₿ ∑ 𝔘"]


class WithoutBackend:
    # Hides the Rust backend, forcing the pure-Python window decoder.
    def __init__(self, tokenizer, slow_spaces: bool = False):
        self._tok = tokenizer
        self.slow_spaces = slow_spaces  # emulate a slow tokenizer's spaces_between_special_tokens

    def decode(self, ids, skip_special_tokens=False, spaces_between_special_tokens=True):
        text = self._tok.decode(ids, skip_special_tokens=skip_special_tokens)
        if self.slow_spaces and spaces_between_special_tokens:
            text = re.sub(r"(<\|[a-z_]+\|>)(?=<\|)", r"\1 ", text)
        return text


def stream(tok, prompt_ids, output_ids, chunks=None, **params):
    # Feeds output_ids (in the given chunk sizes) and collects streamed deltas; returns (deltas, detok, stop).
    detok = IncrementalDetokenizer(tok, prompt_ids, SamplingParams(**params))
    deltas, stop, pos = [], None, 0
    sizes = chunks or [1] * len(output_ids)
    for size in sizes:
        stop = detok.update(output_ids[pos:pos + size])
        pos += size
        deltas.append(detok.get_next_output_text(finished=stop is not None, delta=True))
        if stop is not None:
            break
    if stop is None:
        deltas.append(detok.get_next_output_text(finished=True, delta=True))
    return deltas, detok, stop


@pytest.fixture(scope="module", params=["fast", "window"])
def tok(request, smol_tokenizer):
    return smol_tokenizer if request.param == "fast" else WithoutBackend(smol_tokenizer)


@pytest.fixture(scope="module")
def prompt_ids(smol_tokenizer):
    return smol_tokenizer.encode(PROMPT, add_special_tokens=False)


@pytest.mark.parametrize("text", SAMPLES)
def test_multibyte_text_streams_exactly(tok, smol_tokenizer, prompt_ids, text):
    ids = smol_tokenizer.encode(text, add_special_tokens=False)
    deltas, detok, _ = stream(tok, prompt_ids, ids)
    assert "".join(deltas) == detok.output_text == smol_tokenizer.decode(ids) == text
    assert all("\ufffd" not in d for d in deltas)  # split characters wait for their last byte


def test_stop_string_across_tokens(tok, smol_tokenizer, prompt_ids):
    ids = smol_tokenizer.encode("Hello world. The END is near", add_special_tokens=False)
    _, detok, stop = stream(tok, prompt_ids, ids, stop=["o wor"])
    assert stop == "o wor" and detok.output_text == "Hell"
    _, detok, stop = stream(tok, prompt_ids, ids, stop=["o wor"], include_stop_str_in_output=True)
    assert stop == "o wor" and detok.output_text == "Hello wor"
    # The earliest hit wins, whatever the list order; a multi-token update finds it too.
    _, detok, stop = stream(tok, prompt_ids, ids, chunks=[len(ids)], stop=["near", "END", ". T"])
    assert stop == ". T" and detok.output_text == "Hello world"


def test_stop_strings_ignored_before_min_tokens(smol_tokenizer, prompt_ids):
    ids = smol_tokenizer.encode("a b a b a", add_special_tokens=False)
    _, detok, stop = stream(smol_tokenizer, prompt_ids, ids, stop=[" b"], min_tokens=2)
    assert stop == " b" and detok.output_text == "a b a"


def test_streaming_holds_back_partial_stop_strings(tok, smol_tokenizer, prompt_ids):
    text = "The answer is 42.\n\nQ! not a stop\n\nQ: next question"
    ids = smol_tokenizer.encode(text, add_special_tokens=False)
    deltas, detok, stop = stream(tok, prompt_ids, ids, stop=["\n\nQ:"])
    final = "The answer is 42.\n\nQ! not a stop"
    assert stop == "\n\nQ:" and detok.output_text == final
    assert "".join(deltas) == final
    streamed = ""
    for d in deltas:
        streamed += d
        # A client never sees text that is later cut off (the second "\n\nQ" below all).
        assert final.startswith(streamed)
    detok = IncrementalDetokenizer(tok, prompt_ids, SamplingParams(stop=["\n\nQ:"]))
    detok.update(ids[:3])
    assert detok.get_next_output_text(finished=False, delta=False) == detok.output_text[:-3]
    assert detok.get_next_output_text(finished=True, delta=False) == detok.output_text


def test_stop_terminated_token_text(smol_tokenizer, prompt_ids):
    ids = smol_tokenizer.encode("Done.", add_special_tokens=False) + [EOS]
    for include, expected in [(False, "Done."), (True, "Done.<|im_end|>")]:
        detok = IncrementalDetokenizer(smol_tokenizer, prompt_ids, SamplingParams(
            skip_special_tokens=False, include_stop_str_in_output=include))
        detok.update(ids, stop_terminated=True)
        assert detok.get_next_output_text(finished=True, delta=False) == expected
    detok = IncrementalDetokenizer(smol_tokenizer, prompt_ids, SamplingParams())
    detok.update(ids)
    assert detok.output_text == "Done."  # skip_special_tokens drops eos anyway


def test_prompt_ending_mid_character_does_not_leak(smol_tokenizer):
    ids = smol_tokenizer.encode("x 世界", add_special_tokens=False)
    cut = next(i for i in range(1, len(ids)) if "\ufffd" in smol_tokenizer.decode(ids[:i]))
    _, detok, _ = stream(smol_tokenizer, ids[:cut], ids[cut:])
    assert detok.output_text == smol_tokenizer.decode(ids[cut:])


def test_decode_token(smol_tokenizer):
    ids = smol_tokenizer.encode(" world 世", add_special_tokens=False)
    # 世 is split over two byte tokens; each piece alone shows as U+FFFD.
    assert [decode_token(smol_tokenizer, t) for t in ids] == [" world", " ", "\ufffd", "\ufffd"]
    assert decode_token(smol_tokenizer, EOS) == "<|im_end|>"


def _check_concatenation(tok, smol_tokenizer, prompt_ids, output_ids, chunks, skip):
    deltas, detok, stop = stream(tok, prompt_ids, output_ids, chunks=chunks, skip_special_tokens=skip)
    expected = smol_tokenizer.decode(output_ids, skip_special_tokens=skip)
    assert stop is None
    assert "".join(deltas) == expected
    assert detok.get_next_output_text(finished=True, delta=False) == expected


def _chunks(draw, n):
    sizes = []
    while sum(sizes) < n:
        sizes.append(draw(st.integers(1, 3)))
    return sizes


SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


@SETTINGS
@given(data=st.data())
def test_random_token_ids_concatenate_to_decode(tok, smol_tokenizer, prompt_ids, data):
    vocab = len(smol_tokenizer)
    # Mix arbitrary ids with special tokens and with the 256 byte tokens, which split characters.
    token = st.one_of(st.integers(0, vocab - 1), st.integers(0, 16), st.integers(0, 300))
    output_ids = data.draw(st.lists(token, min_size=1, max_size=24))
    prompt = data.draw(st.sampled_from([prompt_ids, [], output_ids[:2]]))
    chunks = _chunks(data.draw, len(output_ids))
    _check_concatenation(tok, smol_tokenizer, prompt, output_ids, chunks, data.draw(st.booleans()))


@SETTINGS
@given(data=st.data())
def test_encoded_unicode_concatenates_to_decode(tok, smol_tokenizer, prompt_ids, data):
    piece = st.one_of(st.text(max_size=12), st.sampled_from(SAMPLES + ["🙂", "世界", "<|im_end|>", " "]))
    text = "".join(data.draw(st.lists(piece, min_size=1, max_size=4)))
    output_ids = smol_tokenizer.encode(text, add_special_tokens=False) or [EOS]
    chunks = _chunks(data.draw, len(output_ids))
    _check_concatenation(tok, smol_tokenizer, prompt_ids, output_ids, chunks, data.draw(st.booleans()))


@pytest.mark.parametrize("spaces", [True, False])
def test_spaces_between_special_tokens_reaches_the_decoder(smol_tokenizer, prompt_ids, spaces):
    ids = smol_tokenizer.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>", "<|im_start|>"])
    deltas, detok, _ = stream(WithoutBackend(smol_tokenizer, slow_spaces=True), prompt_ids, ids, skip_special_tokens=False,
                              spaces_between_special_tokens=spaces)
    sep = " " if spaces else ""
    assert "".join(deltas) == sep.join(["<|im_start|>", "<|im_end|>", "<|im_start|>"])
