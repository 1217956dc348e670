"""Write the embedded model (or any GGUF pagedserve loads) as a plain Hugging Face directory, offline.

Peers that do not read GGUF Q4_1 (vLLM's CPU build) need a Hugging Face checkpoint. pagedserve's loader
already converts a GGUF once into its cache (dequantized weights with Hugging Face names, config.json,
tokenizer files); this copies that directory to --out, casting the weights to --dtype. Weights never go
into the repository: write under /tmp or another ignored path.

    python benchmarks/export_hf.py --out /tmp/smollm2-hf --dtype bfloat16
"""
from __future__ import annotations

import argparse
import os
import shutil

import torch
from safetensors.torch import load_file, save_file

from pagedserve.model import loader

WEIGHTS = "model.safetensors"


def export(out: str, model: str | None = None, dtype: str = "bfloat16") -> str:
    src, _ = loader.resolve_model_dir(model)
    target = getattr(torch, dtype, None)
    if not isinstance(target, torch.dtype) or not target.is_floating_point:
        raise ValueError(f"--dtype must be a torch floating dtype such as bfloat16 or float32, got {dtype!r}")
    os.makedirs(out, exist_ok=True)
    for name in os.listdir(src):
        if name != WEIGHTS and os.path.isfile(os.path.join(src, name)):
            shutil.copy2(os.path.join(src, name), os.path.join(out, name))
    state = {k: v.to(target).contiguous() for k, v in load_file(os.path.join(src, WEIGHTS)).items()}
    # Written under a temporary name first, so a peer never finds half a weights file.
    tmp = os.path.join(out, f".{WEIGHTS}.tmp")
    save_file(state, tmp, metadata={"format": "pt"})
    os.replace(tmp, os.path.join(out, WEIGHTS))
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="GGUF file or model directory (default: the embedded model)")
    p.add_argument("--out", required=True, help="directory to write (created if missing)")
    p.add_argument("--dtype", default="bfloat16", help="weight dtype in the written checkpoint (default bfloat16)")
    args = p.parse_args()
    print(export(args.out, args.model, args.dtype))


if __name__ == "__main__":
    main()
