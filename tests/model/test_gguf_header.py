"""Malformed GGUF files: header fields that would make the reader allocate without bound, and non-finite
scales, are refused with a ValueError naming the field or tensor and the file."""
from __future__ import annotations

import struct

import numpy as np
import pytest
import torch
import transformers
from gguf import GGMLQuantizationType, GGUFReader, GGUFWriter
from gguf.quants import quantize

from pagedserve.attention.backend import get_attention_backend
from pagedserve.model.gguf_file import open_gguf_file
from pagedserve.model.gguf_weights import load_gguf_blocks
from pagedserve.model.llama import LlamaForCausalLM

T = GGMLQuantizationType
HIDDEN, VOCAB = 64, 32
EMBED = "token_embd.weight"


def write(path: str) -> None:
    rng = np.random.default_rng(0)
    w = GGUFWriter(path, "llama")
    w.add_array("tokenizer.ggml.tokens", ["a", "b", "c"])
    w.add_tensor(EMBED, quantize(rng.standard_normal((VOCAB, HIDDEN)).astype(np.float32), T.Q8_0),
                 raw_dtype=T.Q8_0)
    w.add_tensor("output_norm.weight", np.ones(HIDDEN, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def patched(tmp_path, at: int | bytes, value: bytes, skip: int = 0) -> str:
    # The file with `value` written at byte `at`, or `skip` bytes after the first occurrence of `at`.
    path = str(tmp_path / "tiny.gguf")
    write(path)
    data = bytearray(open(path, "rb").read())
    pos = at if isinstance(at, int) else data.index(at) + len(at) + skip
    data[pos:pos + len(value)] = value
    bad = str(tmp_path / "bad.gguf")
    open(bad, "wb").write(bytes(data))
    return bad


def u32(v: int) -> bytes:
    return struct.pack("<I", v)


def u64(v: int) -> bytes:
    return struct.pack("<Q", v)


@pytest.mark.parametrize("at, skip, value, field", [
    (8, 0, u64(1 << 60), "the tensor count"),
    (16, 0, u64(1 << 60), "the metadata count"),
    (EMBED.encode(), 0, u32(1 << 20), "n_dims 1048576"),
    (EMBED.encode(), 4, u64(1 << 62), f"a dimension of tensor '{EMBED}'"),
    (b"tokenizer.ggml.tokens", 8, u64(1 << 61), "the element count of metadata array 'tokenizer.ggml.tokens'"),
    (b"tokenizer.ggml.tokens", 12, u64(1 << 50), "metadata 'tokenizer.ggml.tokens'"),  # first element's length
])
def test_header_fields_are_bounded_before_allocating(tmp_path, at, skip, value, field):
    path = patched(tmp_path, at, value, skip)
    with pytest.raises(ValueError) as e:
        open_gguf_file(path)
    assert field in str(e.value) and path in str(e.value)


# The scale (float16) of the embedding's sixth Q8_0 block set to NaN; the norm's fourth float32 set to NaN
# through its high half; a float16 inf.
@pytest.mark.parametrize("name, byte, value", [(EMBED, 34 * 5, b"\x00\x7e"), (EMBED, 0, b"\x00\x7c"),
                                               ("output_norm.weight", 4 * 3 + 2, b"\xc0\x7f")])
def test_non_finite_scales_are_refused_at_load(tmp_path, name, byte, value):
    path = str(tmp_path / "tiny.gguf")
    write(path)
    offset = next(t.data_offset for t in GGUFReader(path).tensors if t.name == name)
    path = patched(tmp_path, offset + byte, value)
    config = transformers.LlamaConfig(hidden_size=HIDDEN, intermediate_size=128, num_hidden_layers=1,
                                      num_attention_heads=1, num_key_value_heads=1, vocab_size=VOCAB,
                                      tie_word_embeddings=True)
    model = LlamaForCausalLM(config, get_attention_backend("reference", torch.device("cpu")), dtype=torch.float32)
    with pytest.raises(ValueError, match=f"{name} in {path} has non-finite"):
        load_gguf_blocks(model, open_gguf_file(path), config)
