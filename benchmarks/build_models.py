"""Random-weight models of real shapes, as Hugging Face bf16 directories and llama.cpp GGUF files, offline.

    python benchmarks/build_models.py --shapes llama-3.2-1b qwen2.5-1.5b gemma-3-1b --out /work/models

For each shape: a transformers model with transformers' own initialisation (normal, std 0.02; norms 1; biases
normal too, so that they matter), the embedded SmolLM2's tokenizer (49,152 tokens, so the vocabulary is
SmolLM2's, not Llama's 128,256 or Qwen's 151,936), saved as bf16 safetensors; then llama.cpp's
convert_hf_to_gguf.py writes a BF16 GGUF and llama-quantize the quantized files. Everything lands in --out:

    <shape>-hf/                  config.json, model.safetensors (bf16), tokenizer files   (vLLM, --load-format dummy)
    <shape>-BF16.gguf            the same weights, unquantized
    <shape>-Q4_K_M.gguf ...      llama-quantize's types (the 1B shape also Q5_K_M, Q6_K, Q8_0, IQ4_XS)

Files that exist are kept; each is written under a temporary name and renamed when complete. llama.cpp comes
from --llama-cpp (a source tree with convert_hf_to_gguf.py and build/bin/llama-quantize); the converter runs
with --python (it needs torch, numpy, transformers; its own gguf-py is on its path).
The context length is 8,192 for every shape (the real models train to 32k-128k): llama.cpp sizes its KV cache
to it unless given -c, and no benchmark here reads further.
"""
from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

DEFAULT_LLAMA_CPP = "/work/tools/llama_cpp_python-0.3.36/vendor/llama.cpp"
CONTEXT_LEN = 8192
INIT_STD = 0.02  # transformers' initializer_range default, which these models' configs also use


@dataclass(frozen=True, slots=True)
class Shape:
    model_type: str  # transformers config class: "llama", "qwen2" or "gemma3_text"
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int
    rope_theta: float
    rms_norm_eps: float
    quant_types: tuple[str, ...]  # llama-quantize type names
    head_dim: int | None = None  # None: hidden_size / num_heads
    sliding_window: int | None = None  # Gemma 3: its local layers' window, every 6th layer global


SHAPES = {
    "llama-3.2-1b": Shape("llama", 16, 2048, 32, 8, 8192, 500000.0, 1e-5,
                          ("Q4_K_M", "Q5_K_M", "Q6_K", "Q8_0", "IQ4_XS")),
    "llama-3.2-3b": Shape("llama", 28, 3072, 24, 8, 8192, 500000.0, 1e-5, ("Q4_K_M",)),
    "qwen2.5-1.5b": Shape("qwen2", 28, 1536, 12, 2, 8960, 1000000.0, 1e-6, ("Q4_K_M",)),
    # google/gemma-3-1b-it's text config: global layers at rope base 1e6, local ones (window 512) at 10,000.
    "gemma-3-1b": Shape("gemma3_text", 26, 1152, 4, 1, 6912, 1000000.0, 1e-6, ("Q4_K_M",), head_dim=256,
                        sliding_window=512),
}


def smollm2_tokenizer():
    # The embedded GGUF's tokenizer, as pagedserve extracts it into its cache (model/loader.py).
    import transformers

    from pagedserve.model.loader import resolve_model_dir

    return transformers.AutoTokenizer.from_pretrained(resolve_model_dir(None, weights=False)[0])


def build_hf_dir(shape: Shape, path: str, seed: int) -> None:
    import torch
    import transformers

    tokenizer = smollm2_tokenizer()
    config_cls = {"llama": transformers.LlamaConfig, "qwen2": transformers.Qwen2Config,
                  "gemma3_text": transformers.Gemma3TextConfig}[shape.model_type]
    if shape.model_type == "gemma3_text":
        extra = dict(head_dim=shape.head_dim, query_pre_attn_scalar=shape.head_dim, sliding_window=shape.sliding_window,
                     layer_types=["full_attention" if (i + 1) % 6 == 0 else "sliding_attention"
                                  for i in range(shape.num_layers)],
                     rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                      "full_attention": {"rope_type": "default", "rope_theta": shape.rope_theta}},
                     pad_token_id=tokenizer.pad_token_id)
    else:
        extra = dict(rope_theta=shape.rope_theta)
    config = config_cls(vocab_size=len(tokenizer), hidden_size=shape.hidden_size,
                        intermediate_size=shape.intermediate_size, num_hidden_layers=shape.num_layers,
                        num_attention_heads=shape.num_heads, num_key_value_heads=shape.num_kv_heads,
                        rms_norm_eps=shape.rms_norm_eps,
                        max_position_embeddings=CONTEXT_LEN, tie_word_embeddings=True,
                        initializer_range=INIT_STD, bos_token_id=tokenizer.bos_token_id,
                        eos_token_id=tokenizer.eos_token_id, torch_dtype="bfloat16", **extra)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(".bias"):  # Qwen2's q/k/v biases: transformers zeroes them
                param.normal_(0.0, INIT_STD)
    _write_atomically(path, lambda tmp: (model.save_pretrained(tmp), tokenizer.save_pretrained(tmp)))


# The converter names the tokenizer's pre-tokenizer by hashing what AutoTokenizer makes of a test text. For a
# qwen2 config transformers 5 ignores tokenizer_config.json's class and builds Qwen2Tokenizer, whose own
# pre-tokenizer over SmolLM2's vocabulary hashes to nothing the converter knows; so the converter runs with
# qwen2 taken off transformers' list of configs whose declared tokenizer class it overrides.
CONVERT = """import runpy, sys
from transformers.models.auto import tokenization_auto
tokenization_auto.MODELS_WITH_INCORRECT_HUB_TOKENIZER_CLASS.discard("qwen2")
sys.path.insert(0, sys.argv[1])
sys.argv = sys.argv[2:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def convert_to_gguf(hf_dir: str, path: str, llama_cpp: str, python: str) -> None:
    converter = os.path.join(llama_cpp, "convert_hf_to_gguf.py")
    _write_atomically(path, lambda tmp: _run([python, "-c", CONVERT, llama_cpp, converter, hf_dir,
                                              "--outtype", "bf16", "--outfile", tmp]))


def quantize(source: str, path: str, quant_type: str, llama_cpp: str, num_threads: int) -> None:
    binary = os.path.join(llama_cpp, "build", "bin", "llama-quantize")
    _write_atomically(path, lambda tmp: _run([binary, source, tmp, quant_type, str(num_threads)]))


def _run(cmd: list[str]) -> None:
    print("+", " ".join(c if "\n" not in c else "<script>" for c in cmd), flush=True)
    subprocess.run(cmd, check=True)


def _write_atomically(path: str, write) -> None:
    # write(tmp) fills a temporary file or directory next to path, renamed into place once it returns.
    directory, name = os.path.split(path)
    is_dir = not name.endswith(".gguf")
    tmp = tempfile.mkdtemp(prefix=f".tmp-{name}-", dir=directory)
    os.chmod(tmp, 0o755)  # mkdtemp's 0700 would stay on a renamed directory
    target = tmp if is_dir else os.path.join(tmp, name)
    try:
        t0 = time.perf_counter()
        write(target)
        os.replace(target, path)
        print(f"wrote {path} ({time.perf_counter() - t0:.0f} s)", flush=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def build(name: str, shape: Shape, args: argparse.Namespace) -> None:
    hf_dir = os.path.join(args.out, f"{name}-hf")
    bf16 = os.path.join(args.out, f"{name}-BF16.gguf")
    if not os.path.isfile(os.path.join(hf_dir, "config.json")):
        build_hf_dir(shape, hf_dir, args.seed)
    if not os.path.isfile(bf16):
        convert_to_gguf(hf_dir, bf16, args.llama_cpp, args.python)
    for quant_type in shape.quant_types if args.quant_types is None else args.quant_types:
        path = os.path.join(args.out, f"{name}-{quant_type}.gguf")
        if not os.path.isfile(path):
            quantize(bf16, path, quant_type, args.llama_cpp, args.num_threads)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", nargs="+", choices=sorted(SHAPES), default=sorted(SHAPES))
    p.add_argument("--quant-types", nargs="+", default=None,
                   help="llama-quantize types instead of each shape's list (e.g. Q4_K_M)")
    p.add_argument("--out", default="/work/models", help="output directory")
    p.add_argument("--llama-cpp", default=os.environ.get("LLAMA_CPP_DIR", DEFAULT_LLAMA_CPP),
                   help="llama.cpp source tree with build/bin/llama-quantize ($LLAMA_CPP_DIR)")
    p.add_argument("--python", default=sys.executable,
                   help="interpreter for convert_hf_to_gguf.py (with sentencepiece, which it imports for Llama)")
    p.add_argument("--num-threads", type=int, default=2, help="llama-quantize threads")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    for tool in ("convert_hf_to_gguf.py", os.path.join("build", "bin", "llama-quantize")):
        if not os.path.isfile(os.path.join(args.llama_cpp, tool)):
            p.error(f"{tool} not found under --llama-cpp {args.llama_cpp}")
    os.makedirs(args.out, exist_ok=True)
    for name in args.shapes:
        build(name, SHAPES[name], args)


if __name__ == "__main__":
    main()
