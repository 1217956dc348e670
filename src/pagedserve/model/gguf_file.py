"""A GGUF file's tensor table, read without gguf-py's GGUFReader, and tensor bytes read straight into tensors.

GGUFReader parses every metadata field into numpy objects (the tokenizer's 49k-token vocabulary and merges
of the embedded model: ~160 MB of small objects while it lives, and a fragmented heap after) and maps the
whole file, so every weight byte read also stays resident as a file page until the mapping goes. Serving
needs only the tensor table and a few scalars; the tokenizer and config come from the cache directory
(model/loader.py). So this walks the header, skips the metadata values it does not keep (arrays in one
seek), and reads each tensor with readinto into memory that becomes the weight: one copy, no mapping.

    header  magic "GGUF", version u32 (2, 3), tensor count u64, metadata count u64
    kv      key string, value type u32, value          (string = u64 length + bytes)
    info    name string, n_dims u32, dims u64 x n_dims (innermost first), GGML type u32, offset u64
    data    at the first multiple of general.alignment (default 32) after the infos; offsets are relative
"""
from __future__ import annotations

import math
import os
import struct
from dataclasses import dataclass

import numpy as np

# GGUF metadata value types: fixed sizes of the scalars; 8 = string, 9 = array.
_SCALAR_FMT = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_STRING, _ARRAY = 8, 9
# ggml's GGML_MAX_DIMS. Header fields are checked against this and the file's size before anything is
# allocated from them: a tensor info claiming 2^28 dims would otherwise build a 2 GB unpack format first.
MAX_DIMS = 4
MAX_DIM = 1 << 40
# Numeric arrays up to this length are kept (per-layer values); longer ones (token scores, types) are skipped.
_KEPT_ARRAY_LEN = 1024


@dataclass(frozen=True, slots=True)
class TensorInfo:
    name: str
    shape: tuple[int, ...]  # GGUF order: innermost (input features) first
    qtype: int              # GGML type id
    offset: int             # absolute file offset of the data
    nbytes: int


@dataclass(slots=True)
class GGUFFile:
    path: str
    fields: dict[str, object]  # scalar and string metadata, short numeric arrays as lists (others skipped)
    tensors: list[TensorInfo]

    def read(self, t: TensorInfo) -> np.ndarray:
        # The tensor's bytes, uint8 [nbytes], in memory of their own.
        out = np.empty(t.nbytes, dtype=np.uint8)
        with open(self.path, "rb") as f:
            f.seek(t.offset)
            if f.readinto(memoryview(out)) != t.nbytes:
                raise ValueError(f"corrupt or truncated GGUF file {self.path}: tensor {t.name} ends past the file")
        return out


def open_gguf_file(path: str) -> GGUFFile:
    try:
        return _parse(path)
    except (struct.error, UnicodeDecodeError, ValueError, OverflowError, MemoryError) as e:
        raise ValueError(f"corrupt or truncated GGUF file {path}: {type(e).__name__}: {e}") from e


def _parse(path: str) -> GGUFFile:
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    size = os.path.getsize(path)
    with open(path, "rb") as f:
        def unpack(fmt: str):
            raw = f.read(struct.calcsize("<" + fmt))
            return struct.unpack("<" + fmt, raw)  # struct.error when the file ends early

        def bounded(value: int, limit: int, what: str) -> int:
            if value > limit:
                raise ValueError(f"{what} is {value}, more than {limit} (the file has {size} bytes)")
            return value

        def string(what: str) -> str:
            (n,) = unpack("Q")
            return f.read(bounded(n, size - f.tell(), f"the length of {what}")).decode("utf-8")

        def skip_value(vtype: int, key: str) -> object | None:
            if vtype in _SCALAR_FMT:
                return unpack(_SCALAR_FMT[vtype])[0]
            if vtype == _STRING:
                return string(f"metadata {key!r}")
            if vtype != _ARRAY:
                raise ValueError(f"unknown value type {vtype} of metadata {key!r}")
            elem, count = unpack("IQ")
            # Every element takes at least one byte.
            bounded(count, size - f.tell(), f"the element count of metadata array {key!r}")
            if elem in _SCALAR_FMT and count <= _KEPT_ARRAY_LEN:  # per-layer settings (a window pattern)
                return list(unpack(_SCALAR_FMT[elem] * count))
            if elem in _SCALAR_FMT:  # fixed-size elements: one seek
                f.seek(struct.calcsize(_SCALAR_FMT[elem]) * count, os.SEEK_CUR)
            else:
                for _ in range(count):
                    skip_value(elem, key)
            return None

        magic, version = f.read(4), unpack("I")[0]
        if magic != b"GGUF" or version not in (2, 3):
            raise ValueError(f"not a GGUF v2/v3 file (magic {magic!r}, version {version})")
        num_tensors, num_kv = unpack("QQ")
        # A metadata entry takes at least 13 bytes (key length, value type, one byte), a tensor info 24.
        bounded(num_kv, size // 13, "the metadata count")
        bounded(num_tensors, size // 24, "the tensor count")
        fields: dict[str, object] = {}
        for _ in range(num_kv):
            key = string("a metadata key")
            value = skip_value(unpack("I")[0], key)
            if value is not None:
                fields[key] = value
        infos = []
        for _ in range(num_tensors):
            name = string("a tensor name")
            (n_dims,) = unpack("I")
            if n_dims > MAX_DIMS:
                raise ValueError(f"tensor {name!r} has n_dims {n_dims}, more than {MAX_DIMS}")
            shape = unpack("Q" * n_dims)
            for d in shape:
                bounded(d, MAX_DIM, f"a dimension of tensor {name!r}")
            qtype, offset = unpack("IQ")
            infos.append((name, tuple(int(d) for d in shape), int(qtype), int(offset)))
        align = fields.get("general.alignment", 32)
        if not isinstance(align, int) or align < 1 or align & (align - 1):
            raise ValueError(f"general.alignment must be a positive power of two, got {align!r}")
        data_start = -(-f.tell() // align) * align
    tensors = []
    for name, shape, qtype, offset in infos:
        block_elems, block_bytes = GGML_QUANT_SIZES[GGMLQuantizationType(qtype)]
        numel = math.prod(shape)  # Python ints: numpy's product could wrap around
        nbytes = numel // block_elems * block_bytes
        if data_start + offset + nbytes > size:
            raise ValueError(f"tensor {name} ends past the end of the file")
        tensors.append(TensorInfo(name, shape, qtype, data_start + offset, nbytes))
    return GGUFFile(path, fields, tensors)
