"""Swap space in host memory: whole pool blocks copied out of the device pool and back.

The tier is a stack of ``num_blocks`` slots, each shaped like one pool block
(``pool[0]``: ``[num_layers, 2, block_size, num_kv_heads, head_dim]``). On CUDA the slots are
pinned host memory so copies run at full PCIe speed, and every copy runs on a side stream of
its own (``torch.cuda.Stream``): it first waits for the default stream's work (an event), runs
the gather and the asynchronous copies to or from the pinned slots, one per run of consecutive
slots, and the call returns once the side stream's event has completed (a replica in another
process reads or reuses those device blocks next). On CPU the slots are plain memory and the
copies are plain ``index_select`` / ``index_copy_``.

It is a ``cachesvc.tiers.LowerTier``: ``allocate`` / ``release`` slots, ``store`` / ``load``
copies to and from the pool, the slot counters and ``stats``. A disk tier would offer the same
over a file of block-sized records; nothing outside this class knows where slot bytes are kept.
``swap_out`` / ``swap_in`` are allocate + store and load + release in one call.
"""

from __future__ import annotations

import torch

from kvtier.cachesvc.errors import InvalidArgument, ResourceExhausted
from kvtier.cachesvc.tiers import LowerTier, TierStats


class HostTier(LowerTier):
    """``num_blocks`` host slots for device blocks of ``pool`` (block-major ``[num_device_blocks, ...]``)."""

    name = "host"

    def __init__(self, pool: torch.Tensor, num_blocks: int) -> None:
        if num_blocks < 0:
            raise InvalidArgument(f"host tier num_blocks = {num_blocks} must be >= 0")
        self.pool = pool
        self._num_blocks = num_blocks
        self.stats = TierStats()
        self.block_bytes = pool[0].numel() * pool.element_size()
        pin = pool.is_cuda
        self.slots = torch.empty((num_blocks, *pool.shape[1:]), dtype=pool.dtype, pin_memory=pin)
        self.stream = torch.cuda.Stream(device=pool.device) if pool.is_cuda else None
        # Free slots as a stack: the lowest slot ids are handed out first.
        self._free_slots = list(range(num_blocks - 1, -1, -1))
        self._in_use = bytearray(num_blocks)

    @classmethod
    def from_bytes(cls, pool: torch.Tensor, swap_space_bytes: int) -> HostTier:
        """A tier of ``swap_space_bytes // block_bytes`` slots (``--swap-space`` in bytes)."""
        block_bytes = pool[0].numel() * pool.element_size()
        return cls(pool, max(0, swap_space_bytes) // block_bytes)

    @property
    def num_blocks(self) -> int:
        return self._num_blocks

    @property
    def num_free_blocks(self) -> int:
        return len(self._free_slots)

    def used_slots(self) -> list[int]:
        """Slot ids in use, ascending. O(num_blocks): for invariant checks."""
        return [i for i, used in enumerate(self._in_use) if used]

    def allocate(self, num_blocks: int) -> list[int]:
        """The lowest free slot ids first; ResourceExhausted, taking none, if fewer are free."""
        if num_blocks > len(self._free_slots):
            raise ResourceExhausted(
                f"host tier: need {num_blocks} blocks but only {len(self._free_slots)} of {self.num_blocks} "
                f"are free (raise --swap-space)"
            )
        slots = [self._free_slots.pop() for _ in range(num_blocks)]
        for s in slots:
            self._in_use[s] = 1
        return slots

    def swap_out(self, device_block_ids: list[int]) -> list[int]:
        """Copy ``pool[device_block_ids]`` into free host slots; return the slot ids, same order.

        Raises ResourceExhausted, copying nothing, if fewer slots are free than blocks asked.
        """
        slots = self.allocate(len(device_block_ids))
        self.store(device_block_ids, slots)
        return slots

    def store(self, device_ids: list[int], ids: list[int]) -> None:
        """Copy ``pool[device_ids]`` into the allocated slots ``ids``."""
        if not ids:
            return
        if self.stream is not None:
            self._cuda_swap_out(device_ids, ids)
            return
        src = torch.tensor(device_ids, dtype=torch.long, device=self.pool.device)
        # index_select gathers into one contiguous buffer: one device -> host copy for the batch.
        data = self.pool.index_select(0, src).to("cpu")
        self.slots.index_copy_(0, torch.tensor(ids, dtype=torch.long), data)

    def _cuda_swap_out(self, device_block_ids: list[int], slots: list[int]) -> None:
        """Gather on the side stream, then one async device -> pinned copy per run of consecutive slots."""
        stream = self.stream
        stream.wait_stream(torch.cuda.current_stream(self.pool.device))
        with torch.cuda.stream(stream):
            src = torch.tensor(device_block_ids, dtype=torch.long).to(self.pool.device, non_blocking=True)
            data = self.pool.index_select(0, src)
            for start, end, first in slot_runs(slots):
                self.slots[first : first + end - start].copy_(data[start:end], non_blocking=True)
            done = torch.cuda.Event()
            done.record(stream)
        # The pinned slots are written only when the event completes: wait before returning.
        done.synchronize()

    def swap_in(self, host_slots: list[int], device_block_ids: list[int]) -> None:
        """Copy host slots back into ``pool[device_block_ids]`` and release the slots."""
        self.load(host_slots, device_block_ids)
        self._release(host_slots)

    def load(self, ids: list[int], device_ids: list[int]) -> None:
        """Copy the in-use slots ``ids`` into ``pool[device_ids]``; complete when this returns
        (a compute process reads the pool next)."""
        if len(ids) != len(device_ids):
            raise InvalidArgument(
                f"len(host_slots) = {len(ids)} != len(device_block_ids) = {len(device_ids)}"
            )
        self._check_in_use(ids)
        if ids and self.stream is not None:
            self._cuda_swap_in(ids, device_ids)
        elif ids:
            data = self.slots.index_select(0, torch.tensor(ids, dtype=torch.long))
            dst = torch.tensor(device_ids, dtype=torch.long, device=self.pool.device)
            self.pool.index_copy_(0, dst, data)

    def _cuda_swap_in(self, host_slots: list[int], device_block_ids: list[int]) -> None:
        """Async pinned -> device copies per run of consecutive slots into a staging buffer, then
        one scatter into the pool, all on the side stream; the default stream waits for it."""
        stream = self.stream
        device = self.pool.device
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream):
            data = torch.empty((len(host_slots), *self.pool.shape[1:]), dtype=self.pool.dtype, device=device)
            for start, end, first in slot_runs(host_slots):
                data[start:end].copy_(self.slots[first : first + end - start], non_blocking=True)
            dst = torch.tensor(device_block_ids, dtype=torch.long).to(device, non_blocking=True)
            self.pool.index_copy_(0, dst, data)
            done = torch.cuda.Event()
            done.record(stream)
        torch.cuda.current_stream(device).wait_event(done)
        # The copy is complete when swap_in returns: a compute process reads the pool next.
        done.synchronize()

    def release(self, host_slots: list[int]) -> None:
        """Drop slots without copying (their blocks went back to the device, or their sequence
        was freed while swapped out)."""
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


def slot_runs(slots: list[int]) -> list[tuple[int, int, int]]:
    """``(start, end, first_slot)`` for each run of consecutive slot ids: ``slots[start:end]`` is
    ``first_slot, first_slot + 1, ...``. One copy per run instead of per block (the tier hands out
    the lowest free slots first, so a batch is mostly one run)."""
    runs = []
    start = 0
    for i in range(1, len(slots) + 1):
        if i == len(slots) or slots[i] != slots[i - 1] + 1:
            runs.append((start, i, slots[start]))
            start = i
    return runs
