"""transformers' one-time readers of a model's metadata, run in a child process so a server never holds them.

Resolving a config.json with `AutoConfig` imports the architecture's configuration module and with it
transformers' modeling stack (~55 MB resident in `pagedserve serve`), and converting a GGUF file's config and
tokenizer with transformers' GGUF support adds ~26 MB more (gguf-py's parse of the vocabulary). Both run once
per model, on the first start with an empty cache (model/hf_config.py, model/loader.py); in the serving
process they would stay for its whole life: Python never unloads a module, and the freed heap stays
fragmented. Here they run in `python -m pagedserve.model_metadata` and end with it (issue 11,
benchmarks/HISTORY.md "memory.py": first start 512 -> 431 MB after two requests).

    config PATH                   print AutoConfig.from_pretrained(PATH).to_dict() as JSON
    gguf FILE OUT_DIR VOCAB       save FILE's config and tokenizer as transformers reads them into OUT_DIR;
                                  VOCAB: the file's tokenizer.ggml.model (gguf_tokenizer_class says why)

This module imports neither torch nor the rest of pagedserve, so the child starts in about a second.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys


def run(*args: str) -> str:
    # The child's stdout; ValueError with the child's last error line when it fails.
    out = subprocess.run([sys.executable, "-m", __name__, *args], capture_output=True, text=True)
    if out.returncode != 0:
        lines = out.stderr.strip().splitlines()
        raise ValueError(lines[-1] if lines else f"exit status {out.returncode}")
    return out.stdout


def gguf_tokenizer_class(vocab: str | None):
    """The transformers class that reads a GGUF file's tokenizer, by the vocabulary the file states.

    transformers converts the file's tokenizer by its `tokenizer.ggml.model` (and a byte-level one's split
    pattern by `tokenizer.ggml.pre`), but AutoTokenizer wraps it in its architecture's class, which the saved
    directory then reloads as that class: a Gemma 3 file with a byte-level BPE vocabulary ("gpt2", as
    build_models.py's gemma-3-1b with SmolLM2's) came back as GemmaTokenizer, which rebuilt a sentencepiece
    pipeline from the vocabulary (every id wrong, one token more than the model), and a Qwen2 file's split
    pattern became Qwen's whatever its `pre` said. A byte-level vocabulary takes the generic class, which keeps
    the converted tokenizer as it is, what llama.cpp runs; a sentencepiece one keeps its architecture's class
    (Gemma's and Phi-3's conversions are chosen by architecture, and their classes rebuild the same pipeline).
    """
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    return PreTrainedTokenizerFast if vocab == "gpt2" else AutoTokenizer


def _main(job: str, *args: str) -> None:
    from transformers import AutoConfig

    if job == "config":
        print(json.dumps(AutoConfig.from_pretrained(args[0]).to_dict()))
    elif job == "gguf":
        folder, file = os.path.split(args[0])
        AutoConfig.from_pretrained(folder, gguf_file=file).save_pretrained(args[1])
        vocab = args[2] if len(args) > 2 else None
        gguf_tokenizer_class(vocab).from_pretrained(folder, gguf_file=file).save_pretrained(args[1])
    else:
        raise ValueError(f"unknown job {job!r}")


if __name__ == "__main__":
    _main(*sys.argv[1:])
