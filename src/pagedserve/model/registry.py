"""HF architecture name -> model class. GGUF-derived configs often lack `architectures`, so the
model_type is a fallback."""
from __future__ import annotations

from torch import nn

from pagedserve.model.llama import LlamaForCausalLM

# One class for every family: model/family.py reads the differences from the config.
_MODEL_TYPE_TO_ARCH = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
                       "qwen3": "Qwen3ForCausalLM", "phi3": "Phi3ForCausalLM", "gemma2": "Gemma2ForCausalLM",
                       "gemma3_text": "Gemma3ForCausalLM"}
_MODEL_CLASSES: dict[str, type[nn.Module]] = {arch: LlamaForCausalLM for arch in _MODEL_TYPE_TO_ARCH.values()}


def supported_architectures() -> list[str]:
    return sorted(_MODEL_CLASSES)


def resolve_architecture(hf_config) -> str:
    archs = list(getattr(hf_config, "architectures", None) or [])
    for arch in archs:
        if arch in _MODEL_CLASSES:
            return arch
    model_type = getattr(hf_config, "model_type", None)
    if not archs and model_type in _MODEL_TYPE_TO_ARCH:
        return _MODEL_TYPE_TO_ARCH[model_type]
    named = archs or [f"model_type={model_type!r}"]
    raise ValueError(f"unsupported model architecture {', '.join(map(str, named))}; "
                     f"supported: {', '.join(supported_architectures())}")


def get_model_class(architecture: str) -> type[nn.Module]:
    if architecture not in _MODEL_CLASSES:
        raise ValueError(f"unsupported model architecture {architecture!r}; "
                         f"supported: {', '.join(supported_architectures())}")
    return _MODEL_CLASSES[architecture]
