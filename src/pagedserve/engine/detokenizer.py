"""Incremental detokenization and stop strings, one instance per output sequence.

Text only ever grows by whole characters: a token that ends inside a multi-byte UTF-8 character (byte-level
BPE, byte fallback) yields nothing until a later token completes it. A stop string may span tokens, so each
update searches the new text plus the (longest stop - 1) characters before it.

Streaming holds back the last (longest stop - 1) characters while unfinished, so a client never sees the
start of a stop string that is later cut off:

    output_text   "The answer is 42.\n\nQ"      stop = ["\n\nQ:"]  (hold back 3)
    streamed      "The answer is 42."           "\n\nQ" stays until the next token decides
"""
from __future__ import annotations

from typing import Any

from pagedserve.sampling_params import SamplingParams

# Enough prompt context for the first output token to decode as it would inside the full text
# (SentencePiece decoders drop a leading space at the very start of a decode).
_PROMPT_CONTEXT_TOKENS = 6
_REPLACEMENT_CHAR = "\ufffd"


def _backend_tokenizer(tokenizer: Any) -> Any | None:
    try:
        from tokenizers import Tokenizer
        from tokenizers.decoders import DecodeStream  # noqa: F401  (absent in old tokenizers releases)
    except ImportError:
        return None
    if isinstance(tokenizer, Tokenizer):
        return tokenizer
    backend = getattr(tokenizer, "backend_tokenizer", None) or getattr(tokenizer, "_tokenizer", None)
    return backend if isinstance(backend, Tokenizer) else None


class _WindowDecoder:
    # Same contract as tokenizers' DecodeStream for tokenizers without a Rust backend: decode a small window
    # (prefix + new tokens) and emit what the new tokens add, once it no longer ends mid-character.
    def __init__(self, tokenizer: Any, skip_special_tokens: bool, spaces_between_special_tokens: bool) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.spaces_between_special_tokens = spaces_between_special_tokens
        self.ids: list[int] = []
        self.prefix_offset = 0
        self.read_offset = 0

    def step(self, _backend: Any, token_id: int) -> str | None:
        self.ids.append(token_id)
        decode = lambda ids: self.tokenizer.decode(  # noqa: E731
            ids, skip_special_tokens=self.skip_special_tokens,
            spaces_between_special_tokens=self.spaces_between_special_tokens)
        prefix_text = decode(self.ids[self.prefix_offset:self.read_offset])
        text = decode(self.ids[self.prefix_offset:])
        if len(text) > len(prefix_text) and not text.endswith(_REPLACEMENT_CHAR):
            self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
            return text[len(prefix_text):]
        return None


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Any, prompt_token_ids: list[int], params: SamplingParams) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens: bool = params.skip_special_tokens
        # As in transformers: slow (Python) tokenizers put spaces between special tokens when this is on;
        # fast (Rust) tokenizers never do, so for them it changes nothing, exactly as their decode().
        self.spaces_between_special_tokens: bool = params.spaces_between_special_tokens
        self.stop: list[str] = list(params.stop)
        self.min_tokens: int = params.min_tokens
        self.include_stop_str_in_output: bool = params.include_stop_str_in_output
        # With the stop string included in the output, a partial one is never cut off, so no holdback.
        self.stop_buffer_length = (max(map(len, self.stop)) - 1
                                   if self.stop and not self.include_stop_str_in_output else 0)
        self.output_token_ids: list[int] = []
        self._decoded_ids: list[int] = []  # tokens fed to the decoder (a stop token may be left out)
        self._num_pending = 0  # trailing decoded ids whose text has not come out yet
        self._text = ""
        self._stopped = False
        self._flushed = False
        self._last_output_offset = 0
        self._backend = _backend_tokenizer(tokenizer)
        self._stream = self._new_stream()
        self._prime(prompt_token_ids[-_PROMPT_CONTEXT_TOKENS:])

    def _new_stream(self) -> Any:
        if self._backend is None:
            return _WindowDecoder(self.tokenizer, self.skip_special_tokens, self.spaces_between_special_tokens)
        from tokenizers.decoders import DecodeStream

        return DecodeStream(skip_special_tokens=self.skip_special_tokens)

    def _prime(self, context_ids: list[int]) -> None:
        chunk = None
        for token_id in context_ids:
            chunk = self._stream.step(self._backend, token_id)
        if context_ids and chunk is None:
            # The prompt ends inside a character; its stray bytes must not leak into the output.
            self._stream = self._new_stream()

    @property
    def output_text(self) -> str:
        return self._text

    @property
    def stopped(self) -> bool:
        return self._stopped

    def update(self, new_token_ids: list[int], stop_terminated: bool = False) -> str | None:
        # stop_terminated: the last new token is eos or a stop token id. Like vLLM, its text is left out
        # unless include_stop_str_in_output. Returns the stop string that ended the text, if any.
        if self._stopped:
            return None
        self.output_token_ids.extend(new_token_ids)
        to_decode = new_token_ids
        if stop_terminated and new_token_ids and not self.include_stop_str_in_output:
            to_decode = new_token_ids[:-1]
        new_text = []
        for token_id in to_decode:
            self._decoded_ids.append(token_id)
            chunk = self._stream.step(self._backend, token_id)
            if chunk is None:
                self._num_pending += 1
            else:
                self._num_pending = 0
                new_text.append(chunk)
        added = "".join(new_text)
        self._text += added
        if not self.stop or not added or len(self.output_token_ids) <= self.min_tokens:
            return None
        return self._check_stop(len(added))

    def _check_stop(self, num_new_chars: int) -> str | None:
        text = self._text
        best: tuple[int, str] | None = None
        for stop in self.stop:
            # A hit must end inside the new text; anything earlier was checked by a previous update.
            start = max(0, len(text) - num_new_chars - len(stop) + 1)
            idx = text.find(stop, start)
            if idx != -1 and (best is None or idx < best[0]):
                best = (idx, stop)
        if best is None:
            return None
        idx, stop = best
        self._text = text[:idx + len(stop)] if self.include_stop_str_in_output else text[:idx]
        self._stopped = True
        return stop

    def _flush(self) -> None:
        # At the end, tokens still waiting for the rest of a character decode as U+FFFD, exactly as a
        # one-shot tokenizer.decode of the whole output would show them.
        if self._flushed or self._stopped or self._num_pending == 0:
            self._flushed = True
            return
        self._flushed = True
        full = self._decode(self._decoded_ids)
        if full.startswith(self._text):
            self._text = full
        else:
            pending = self._decoded_ids[-self._num_pending:]
            self._text += self._decode(pending)

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens,
                                     spaces_between_special_tokens=self.spaces_between_special_tokens)

    def get_next_output_text(self, finished: bool, delta: bool) -> str:
        if finished:
            self._flush()
        hold = 0 if finished else self.stop_buffer_length
        end = max(len(self._text) - hold, 0)
        if not delta:
            return self._text[:end]
        start = self._last_output_offset
        if start >= end:
            return ""
        self._last_output_offset = end
        return self._text[start:end]


def decode_token(tokenizer: Any, token_id: int) -> str:
    # One token's text for logprobs; a piece of a multi-byte character shows as U+FFFD.
    return tokenizer.decode([token_id], skip_special_tokens=False)
