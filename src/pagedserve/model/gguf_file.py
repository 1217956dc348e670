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

import os
import struct
from dataclasses import dataclass

import numpy as np

# GGUF metadata value types: fixed sizes of the scalars; 8 = string, 9 = array.
_SCALAR_FMT = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_STRING, _ARRAY = 8, 9


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
    fields: dict[str, object]  # scalar and string metadata (arrays are skipped)
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

        def string() -> str:
            (n,) = unpack("Q")
            if n > size:
                raise ValueError(f"a string of {n} bytes in a file of {size}")
            return f.read(n).decode("utf-8")

        def skip_value(vtype: int) -> object | None:
            if vtype in _SCALAR_FMT:
                return unpack(_SCALAR_FMT[vtype])[0]
            if vtype == _STRING:
                return string()
            if vtype != _ARRAY:
                raise ValueError(f"unknown metadata value type {vtype}")
            elem, count = unpack("IQ")
            if elem in _SCALAR_FMT:  # fixed-size elements: one seek
                f.seek(struct.calcsize(_SCALAR_FMT[elem]) * count, os.SEEK_CUR)
            else:
                for _ in range(count):
                    skip_value(elem)
            return None

        magic, version = f.read(4), unpack("I")[0]
        if magic != b"GGUF" or version not in (2, 3):
            raise ValueError(f"not a GGUF v2/v3 file (magic {magic!r}, version {version})")
        num_tensors, num_kv = unpack("QQ")
        fields: dict[str, object] = {}
        for _ in range(num_kv):
            key = string()
            value = skip_value(unpack("I")[0])
            if value is not None:
                fields[key] = value
        infos = []
        for _ in range(num_tensors):
            name = string()
            (n_dims,) = unpack("I")
            shape = unpack("Q" * n_dims)
            qtype, offset = unpack("IQ")
            infos.append((name, tuple(int(d) for d in shape), int(qtype), int(offset)))
        align = int(fields.get("general.alignment", 32))
        data_start = -(-f.tell() // align) * align
    tensors = []
    for name, shape, qtype, offset in infos:
        block_elems, block_bytes = GGML_QUANT_SIZES[GGMLQuantizationType(qtype)]
        numel = int(np.prod(shape))
        nbytes = numel // block_elems * block_bytes
        if data_start + offset + nbytes > size:
            raise ValueError(f"tensor {name} ends past the end of the file")
        tensors.append(TensorInfo(name, shape, qtype, data_start + offset, nbytes))
    return GGUFFile(path, fields, tensors)
