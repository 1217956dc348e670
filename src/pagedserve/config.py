"""Frozen engine configuration. Devices and dtypes come from here, never from globals."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class ModelConfig:
    model: str | None = None          # GGUF file or HF directory; None = embedded SmolLM2
    tokenizer: str | None = None      # defaults to the model's own
    max_model_len: int | None = None  # defaults to the model's context length
    dtype: str = "float32"
    seed: int = 0
    chat_template: str | None = None  # path or template text overriding the model's
    # "auto": the compiled CPU paged-attention kernel on CPU when it builds, else "reference" (pure torch).
    attention_backend: str = "auto"


@dataclass(frozen=True, slots=True)
class CacheConfig:
    block_size: int = 16
    kv_cache_memory_bytes: int | None = None  # explicit KV pool budget
    kv_cache_fraction: float = 0.25            # of available memory when no explicit budget
    num_gpu_blocks_override: int | None = None  # exact pool size (tests)
    enable_prefix_caching: bool = True
    swap_space_gib: float = 0.0
    preemption_mode: str = "recompute"  # "recompute" or "swap"

    def __post_init__(self) -> None:
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")
        if not 0.0 < self.kv_cache_fraction <= 1.0:
            raise ValueError(f"kv_cache_fraction must be in (0, 1], got {self.kv_cache_fraction}")
        if self.preemption_mode not in ("recompute", "swap"):
            raise ValueError(f"preemption_mode must be 'recompute' or 'swap', got {self.preemption_mode!r}")


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512
    enable_chunked_prefill: bool = True

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")


@dataclass(frozen=True, slots=True)
class DeviceConfig:
    device: str = "auto"  # "auto" picks cuda when available, else cpu
    num_threads: int | None = None

    def resolve(self) -> str:
        if self.device != "auto":
            return self.device
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"


@dataclass(frozen=True, slots=True)
class EngineConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    device: DeviceConfig = field(default_factory=DeviceConfig)
