"""The host swap tier: slot runs and round trips on CPU; pinned slots and side-stream copies on CUDA
(skipped with the reason on CPU)."""

from __future__ import annotations

import pytest
import torch

from kvtier.cachesvc.host_tier import HostTier, slot_runs


def test_slot_runs_split_ids_into_consecutive_runs():
    assert slot_runs([]) == []
    assert slot_runs([4]) == [(0, 1, 4)]
    assert slot_runs([0, 1, 2, 3]) == [(0, 4, 0)]
    assert slot_runs([5, 6, 2, 3, 4, 9]) == [(0, 2, 5), (2, 5, 2), (5, 6, 9)]
    assert slot_runs([3, 2, 1]) == [(0, 1, 3), (1, 2, 2), (2, 3, 1)]


def _round_trip(device: str, dtype: torch.dtype) -> None:
    pool = torch.zeros((12, 2, 2, 16, 2, 8), dtype=dtype, device=device)
    for b in range(12):
        pool[b].fill_(b + 1)
    tier = HostTier(pool, 8)
    first = tier.swap_out([3, 4])  # slots 0, 1
    tier.swap_out([7])  # slot 2
    tier.swap_in(first, [10, 11])  # frees 0, 1
    # Fill on the current stream just before the swap: the side stream must wait for it.
    pool[5].fill_(-7)
    pool[9].fill_(-9)
    pool[0].fill_(-3)
    slots = tier.swap_out([5, 9, 0, 1])  # slots 0, 1, 3, 4: two runs
    assert sorted(slots) == [0, 1, 3, 4]
    pool[[5, 9, 0, 1]] = 0
    tier.swap_in(slots, [2, 6, 8, 5])
    got = [float(pool[b].flatten()[0]) for b in (10, 11, 2, 6, 8, 5)]
    assert got == [4.0, 5.0, -7.0, -9.0, -3.0, 2.0]
    assert tier.num_used_blocks == 1 and tier.used_slots() == [2]


def test_round_trip_on_cpu_with_scattered_slots():
    _round_trip("cpu", torch.float32)


needs_cuda = pytest.mark.skipif(
    not torch.cuda.is_available(),
    reason="no CUDA device: pinned slots and side-stream copies are tested on the GPU machine",
)


@pytest.mark.cuda
@needs_cuda
def test_cuda_tier_is_pinned_and_copies_on_a_side_stream():
    pool = torch.zeros((4, 1, 2, 16, 1, 8), dtype=torch.bfloat16, device="cuda")
    tier = HostTier(pool, 2)
    assert tier.slots.is_pinned()
    assert tier.stream is not None and tier.stream != torch.cuda.current_stream()
    _round_trip("cuda", torch.bfloat16)
    _round_trip("cuda", torch.float16)


@pytest.mark.cuda
@needs_cuda
def test_cuda_swap_sees_a_large_write_queued_just_before_it():
    pool = torch.zeros((64, 4, 2, 16, 8, 128), dtype=torch.bfloat16, device="cuda")
    tier = HostTier(pool, 64)
    for _ in range(3):  # a long queue of default-stream work ahead of the swap
        pool.mul_(1.0).add_(1.0)
    slots = tier.swap_out(list(range(64)))
    assert torch.all(tier.slots[slots] == 3.0)
    pool.zero_()
    tier.swap_in(slots, list(range(64)))
    assert torch.all(pool == 3.0)  # read on the default stream, which waited for the side stream
