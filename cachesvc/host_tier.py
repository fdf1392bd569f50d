"""Swap space in host memory: whole pool blocks copied out of the device pool and back.

The tier is a stack of ``num_blocks`` slots, each shaped like one pool block
(``pool[0]``: ``[num_layers, 2, block_size, num_kv_heads, head_dim]``). On CUDA the slots are
pinned host memory so copies run at full PCIe speed; on CPU they are plain memory.

A disk tier would offer the same calls (``swap_out`` / ``swap_in`` / ``release`` and the slot
counters) over a file of block-sized records, and ``SequenceTable`` would pick the tier a
sequence lives on; nothing outside this class knows where slot bytes are kept.
"""

from __future__ import annotations

import torch

from cachesvc.errors import InvalidArgument, ResourceExhausted


class HostTier:
    """``num_blocks`` host slots for device blocks of ``pool`` (block-major ``[num_device_blocks, ...]``)."""

    def __init__(self, pool: torch.Tensor, num_blocks: int) -> None:
        if num_blocks < 0:
            raise InvalidArgument(f"host tier num_blocks = {num_blocks} must be >= 0")
        self.pool = pool
        self.num_blocks = num_blocks
        self.block_bytes = pool[0].numel() * pool.element_size()
        pin = pool.is_cuda
        self.slots = torch.empty((num_blocks, *pool.shape[1:]), dtype=pool.dtype, pin_memory=pin)
        # Free slots as a stack: the lowest slot ids are handed out first.
        self._free_slots = list(range(num_blocks - 1, -1, -1))
        self._in_use = bytearray(num_blocks)

    @classmethod
    def from_bytes(cls, pool: torch.Tensor, swap_space_bytes: int) -> HostTier:
        """A tier of ``swap_space_bytes // block_bytes`` slots (``--swap-space`` in bytes)."""
        block_bytes = pool[0].numel() * pool.element_size()
        return cls(pool, max(0, swap_space_bytes) // block_bytes)

    @property
    def num_free_blocks(self) -> int:
        return len(self._free_slots)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free_slots)

    def used_slots(self) -> list[int]:
        """Slot ids in use, ascending. O(num_blocks): for invariant checks."""
        return [i for i, used in enumerate(self._in_use) if used]

    def swap_out(self, device_block_ids: list[int]) -> list[int]:
        """Copy ``pool[device_block_ids]`` into free host slots; return the slot ids, same order.

        Raises ResourceExhausted, copying nothing, if fewer slots are free than blocks asked.
        """
        n = len(device_block_ids)
        if n > len(self._free_slots):
            raise ResourceExhausted(
                f"host tier: need {n} blocks but only {len(self._free_slots)} of {self.num_blocks} are free "
                f"(raise --swap-space)"
            )
        if n == 0:
            return []
        slots = [self._free_slots.pop() for _ in range(n)]
        for s in slots:
            self._in_use[s] = 1
        src = torch.tensor(device_block_ids, dtype=torch.long, device=self.pool.device)
        # index_select gathers into one contiguous buffer: one device -> host copy for the batch.
        data = self.pool.index_select(0, src).to("cpu")
        self.slots.index_copy_(0, torch.tensor(slots, dtype=torch.long), data)
        return slots

    def swap_in(self, host_slots: list[int], device_block_ids: list[int]) -> None:
        """Copy host slots back into ``pool[device_block_ids]`` and release the slots.

        The copy is complete when this returns (a compute process reads the pool next).
        """
        if len(host_slots) != len(device_block_ids):
            raise InvalidArgument(
                f"len(host_slots) = {len(host_slots)} != len(device_block_ids) = {len(device_block_ids)}"
            )
        self._check_in_use(host_slots)
        if host_slots:
            data = self.slots.index_select(0, torch.tensor(host_slots, dtype=torch.long))
            dst = torch.tensor(device_block_ids, dtype=torch.long, device=self.pool.device)
            self.pool.index_copy_(0, dst, data.to(self.pool.device))
            if self.pool.is_cuda:
                torch.cuda.synchronize(self.pool.device)
        self._release(host_slots)

    def release(self, host_slots: list[int]) -> None:
        """Drop slots without copying (their sequence was freed while swapped out)."""
        self._check_in_use(host_slots)
        self._release(host_slots)

    def _check_in_use(self, host_slots: list[int]) -> None:
        if len(set(host_slots)) != len(host_slots):
            raise InvalidArgument(f"host_slots {host_slots} name a slot twice")
        for k, s in enumerate(host_slots):
            if not 0 <= s < self.num_blocks or not self._in_use[s]:
                raise InvalidArgument(
                    f"host_slots[{k}] = {s} is not an in-use slot of [0, {self.num_blocks})"
                )

    def _release(self, host_slots: list[int]) -> None:
        for s in reversed(host_slots):
            self._in_use[s] = 0
            self._free_slots.append(s)
