"""Block copies and swaps move exactly the named blocks; a swap-out is complete when apply_block_ops returns."""
from __future__ import annotations

import pytest
import torch

from pagedserve.core.kv_cache_manager import BlockOps
from pagedserve.worker.kv_cache import allocate_host_caches, allocate_kv_caches, apply_block_ops


def filled_caches(device: str, num_layers=2, num_blocks=6, block_size=4, heads=2, head_dim=8, num_host_blocks=4):
    caches = allocate_kv_caches(num_layers, num_blocks, block_size, heads, head_dim, torch.float32, device)
    gen = torch.Generator().manual_seed(0)
    for c in caches:
        c.copy_(torch.randn(c.shape, generator=gen))
    host = allocate_host_caches(num_layers, num_host_blocks, block_size, heads, head_dim, torch.float32, torch.device(device))
    return caches, host


def test_swap_out_then_in_round_trips_and_copies_on_write():
    caches, host = filled_caches("cpu")
    before = [c.clone() for c in caches]
    apply_block_ops(BlockOps(swap_out=[(4, 1), (2, 3)], swap_in=[], copy=[]), caches, host)
    for h, b in zip(host, before):
        assert torch.equal(h[:, 1], b[:, 4]) and torch.equal(h[:, 3], b[:, 2])
        assert not h[:, 0].any() and not h[:, 2].any()          # untouched host blocks stay zero
    for c in caches:
        c[:, [2, 4]] = 0                                          # the device blocks get reused
    # Back into other device blocks, and a copy-on-write from block 0 to 5 in the same step.
    apply_block_ops(BlockOps(swap_out=[], swap_in=[(1, 0), (3, 1)], copy=[(0, 5)]), caches, host)
    for c, b in zip(caches, before):
        assert torch.equal(c[:, 0], b[:, 4]) and torch.equal(c[:, 1], b[:, 2])
        # Copies run after swap-ins: block 5 receives what was swapped into block 0.
        assert torch.equal(c[:, 5], b[:, 4])
        assert torch.equal(c[:, 3], b[:, 3])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_swap_out_is_complete_when_it_returns():
    # Large blocks so the device-to-host copies take long enough for a missing synchronize to show: the host
    # pool would be read while the non-blocking copies are still in flight.
    caches, host = filled_caches("cuda", num_layers=8, num_blocks=64, block_size=16, heads=8, head_dim=128,
                                 num_host_blocks=64)
    for trial in range(5):
        for c in caches:
            c.normal_()
        pairs = [(i, (i + trial) % 64) for i in range(64)]
        apply_block_ops(BlockOps(swap_out=pairs, swap_in=[], copy=[]), caches, host)
        for c, h in zip(caches, host):
            assert torch.equal(h[:, [d for _, d in pairs]], c[:, [s for s, _ in pairs]].cpu())


@pytest.mark.parametrize("prefault", [True, False])
def test_the_pool_is_resident_from_the_start_when_prefaulted(prefault):
    # 2 layers x 32 MiB: with prefault the whole pool is resident when allocate returns; without, none of it
    # until blocks are written. Either way it reads as zeros.
    from pagedserve.worker.memory import resident_bytes

    before = resident_bytes()
    if before is None:
        pytest.skip("no /proc/self/statm")
    caches = allocate_kv_caches(2, 128, 16, 8, 256, torch.float32, "cpu", prefault=prefault)
    grown = resident_bytes() - before
    size = sum(c.numel() * c.element_size() for c in caches)
    assert size == 64 << 20
    if prefault:
        assert grown >= 0.95 * size, grown
    else:
        assert grown < 0.05 * size, grown
    assert not caches[0][:, ::37].any() and not caches[1][:, -1].any()
