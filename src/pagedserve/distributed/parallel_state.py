"""The tensor-parallel process group: who this rank is, and the two collectives the model needs.

One group of `world_size` ranks, one process each (rank 0 is the engine process). gloo carries the
collectives on CPU (loopback), NCCL on CUDA (rank r uses cuda:r). Every collective has the group's timeout,
so a rank that dies or stalls turns into an error on the others, never a hang; the rendezvous that forms the
group has a longer one of its own (RENDEZVOUS_TIMEOUT_S), so ranks that start slowly on a loaded machine join.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from pagedserve.kv_spec import num_kv_heads_of

# How long a collective waits for the slowest rank. The ranks run the same step in lockstep, so the wait is
# their skew (milliseconds); a minute means a rank is gone or stuck.
DEFAULT_TIMEOUT_S = 60.0
# How long the rendezvous (init_process_group) waits for every rank: each is a fresh interpreter that imports
# torch first, seconds apart on an idle machine and much more on a loaded one. Rank 0 calls it only once every
# other rank's process has said it is joining (distributed/executor.py), so a rank that died before is reported
# at once; this bounds only a rank that hangs in between.
RENDEZVOUS_TIMEOUT_S = 600.0


@dataclass(frozen=True, slots=True)
class TensorParallelGroup:
    rank: int
    world_size: int

    @property
    def is_driver(self) -> bool:
        # Rank 0 samples and talks to the scheduler; the other ranks only run the model.
        return self.rank == 0

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        # Sum of the ranks' partial results (row-parallel outputs), in place.
        dist.all_reduce(x)
        return x

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        # The ranks' shards side by side along the last dim (rank order), e.g. vocab-parallel logits.
        parts = [torch.empty_like(x) for _ in range(self.world_size)]
        dist.all_gather(parts, x.contiguous())
        return torch.cat(parts, dim=-1)


def backend_for(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


def rank_device(device: torch.device, rank: int) -> torch.device:
    # One GPU per rank; CPU ranks share the host.
    return torch.device("cuda", rank) if device.type == "cuda" else device


def init_tensor_parallel(rank: int, world_size: int, init_method: str, device: torch.device,
                         timeout_s: float = DEFAULT_TIMEOUT_S) -> TensorParallelGroup:
    if device.type == "cpu":
        # Every rank lives on this host: keep gloo on loopback whatever the hostname resolves to.
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    elif device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(backend_for(device), init_method=init_method, rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=max(timeout_s, RENDEZVOUS_TIMEOUT_S)))
    # The collectives' own timeout, once every rank has joined.
    dist.distributed_c10d._set_pg_timeout(timedelta(seconds=timeout_s))
    return TensorParallelGroup(rank, world_size)


def destroy_tensor_parallel() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def bind_rank(config, rank: int) -> torch.device:
    # This process's share of the host's threads and its device (cuda:rank on GPUs with tensor parallelism):
    # rank 0 in the engine process (engine/core.py), ranks 1..N-1 in their own (distributed/rank_process.py).
    tp_size = config.parallel.tensor_parallel_size
    if config.device.num_threads or tp_size > 1:
        torch.set_num_threads(threads_per_rank(config.device.num_threads, tp_size))
    device = torch.device(config.device.resolve())
    return device if tp_size == 1 else rank_device(device, rank)


def threads_per_rank(num_threads: int | None, world_size: int) -> int:
    # The ranks share the host's cores: split them, at least one each (2 cores, TP=2: one thread per rank).
    if num_threads is not None:
        return num_threads
    return max(1, (os.cpu_count() or 1) // world_size)


def check_divisible(hf_config, world_size: int) -> None:
    """Start-up check: every rank must hold a whole number of heads, KV heads and MLP columns."""
    num_heads = hf_config.num_attention_heads
    num_kv_heads = num_kv_heads_of(hf_config)
    problems = []
    if num_heads % world_size:
        problems.append(f"num_attention_heads ({num_heads})")
    if num_kv_heads % world_size:
        problems.append(f"num_key_value_heads ({num_kv_heads})")
    if hf_config.intermediate_size % world_size:
        problems.append(f"intermediate_size ({hf_config.intermediate_size})")
    if problems:
        divisors = [n for n in range(1, num_kv_heads + 1)
                    if num_heads % n == 0 and num_kv_heads % n == 0 and hf_config.intermediate_size % n == 0]
        raise ValueError(f"tensor_parallel_size {world_size} must divide {' and '.join(problems)}: each rank "
                         f"holds an equal slice of the attention heads, KV heads and MLP; sizes that work for "
                         f"this model: {divisors}")
