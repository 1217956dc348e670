"""Tiny random transformers models for parity tests (built offline from a config, never downloaded)."""
from __future__ import annotations

import torch
import transformers


def random_hf_model(config, scale: float = 0.1, seed: int = 0, device: str = "cpu"):
    # HF zero-inits biases and one-inits norms; randomize every weight so each one matters in a comparison.
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).to(device).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1 + 0.1 * torch.randn_like(p) if "norm" in name else scale * torch.randn_like(p))
    return model


def save_hf_dir(model, tokenizer, path) -> str:
    # A Hugging Face model directory (config.json, safetensors, tokenizer files) as LLM(model=...) takes it.
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)
