"""The one host memory area: ``num_slots`` rows of ``block_bytes`` bytes, the copies between them
and the device pool's blocks, and swap's reserved share of them.

The rows are one uint8 tensor ``[num_slots, block_bytes]``: pinned on CUDA, so copies run at
full PCIe speed; plain on CPU. Every copy is complete when its call returns: a device block
copied out may be reused, and a block copied in read, at once (a replica in another process
reads or writes it next). On CUDA the copies of a call run on a side stream that first waits for
the default stream's queued work, then the call waits for the side stream's event. On CPU a
block is one memcpy (numpy or a memoryview slice), never torch's threaded ``copy_`` (``copy_block``).

A slot is free, swap's or (in the host cache, ``cachesvc.host_cache.HostCache``, which is this
area with keys) a cached block's. Swap is a share of the area, not a second one: SwapOut
``reserve``s slots (the host cache gives up its least recently used blocks for them, which go
on down the tiers), copies the sequence's blocks in (``store``), and SwapIn copies them back
(``load``) and ``release``s the slots. With the host cache off (``--host-cache-gib 0``) the area
is ``--swap-space`` of swap alone. The copy path is the same either way.
"""

from __future__ import annotations

import os
import sys
import threading
from collections.abc import Callable, Sequence

import numpy as np
import torch

from kvtier.cachesvc.errors import InvalidArgument, ResourceExhausted
from kvtier.cachesvc.tiers import Blocks
from kvtier.cpu_plan import name_os_thread
from kvtier.pool import populate

SMALL_ROW_BYTES = 4096  # rows up to this size are copied as numpy void items (copy_rows)
GATHER_FROM = 8  # small rows per copy_rows call from which one numpy gather beats a copy per row
# A CPU area's pages are mapped ahead of the first copy into them: the kernel maps a range in one
# call for ~0.45 ms per 2 MiB, against ~0.65 when the copies fault page by page (bench/cache_cpu.py:
# the host tier's first pass, 0.16-0.24 ms less CPU per 16 demoted blocks of 128 KiB). A thread of
# the lowest priority (``AHEAD_BYTES``, ``_map_behind``) keeps the pages past the highest slot
# copied into mapped, so the loop's copies find them mapped; the loop maps ``MAP_AHEAD_BYTES`` in
# one call (~2 ms at most) only where it overtakes the thread. Memory not reached yet stays
# unmapped: the default host cache is sized to a share of the machine's memory and is cheap until
# used, and a service commits at most ``AHEAD_BYTES`` more than its copies reached.
MAP_AHEAD_BYTES = 8 << 20
AHEAD_BYTES = 64 << 20  # about two throughput runs of bench/vllm_connector.py (2 MiB per request)
AHEAD_CALL_BYTES = 2 << 20  # the thread's kernel calls: short, so one preempted holds little


class HostArea:
    """``num_slots`` host rows of ``block_bytes`` bytes on the host side of ``device``'s pool, and
    swap's share of them (the slot ids ``reserve`` handed out). Units: slots (one block each)."""

    name = "host"  # what a swapped-out Sequence's location holds (cachesvc.records)

    def __init__(self, num_slots: int, block_bytes: int, device: str | torch.device = "cpu") -> None:
        if num_slots < 0 or block_bytes <= 0:
            raise InvalidArgument(
                f"host area of {num_slots} slots x {block_bytes} bytes: need >= 0 slots, > 0 bytes"
            )
        self.device = torch.device(device)
        self.block_bytes = block_bytes
        self.num_slots = num_slots
        cuda = self.device.type == "cuda"
        self.slots = torch.empty((num_slots, block_bytes), dtype=torch.uint8, pin_memory=cuda)
        self.stream = torch.cuda.Stream(device=self.device) if cuda else None
        # The CPU pool copy_rows reads (bind_rows), and it and the slots as flat bytes.
        self.rows: torch.Tensor | None = None
        self._rows_bytes = self._slots_bytes = self._rows_items = self._slots_items = None
        self._small = False
        # Slots [0, mapped) are mapped on a CPU area (map_ahead); pinned memory is mapped already.
        # A copy into a slot from ahead_at on tops the mapped pages up; one past mapped maps (_reach).
        self.mapped = self.ahead_at = 0 if not cuda and sys.platform == "linux" else num_slots
        self._mapping = threading.Lock()  # guards the updates of mapped (the loop's and the thread's)
        self._mapper: threading.Thread | None = None
        self.pool_rows: torch.Tensor | None = None  # the pool swap copies to and from (attach_pool)
        self._free = list(range(num_slots - 1, -1, -1))  # a stack: lowest slot ids first
        self._swap_slots: set[int] = set()

    @classmethod
    def for_pool(cls, pool_rows: torch.Tensor, budget_bytes: int) -> HostArea:
        """An area of ``budget_bytes // block_bytes`` slots beside ``pool_rows`` (``PoolViews.rows``)."""
        area = cls(max(0, budget_bytes) // pool_rows.shape[1], pool_rows.shape[1], device=pool_rows.device)
        area.attach_pool(pool_rows)
        return area

    def attach_pool(self, pool_rows: torch.Tensor) -> None:
        """Swap's pool: ``[num_blocks, block_bytes]`` uint8 (``PoolViews.rows``); a CPU pool is bound
        for ``copy_rows``."""
        self.pool_rows = pool_rows
        if not pool_rows.is_cuda:
            self.bind_rows(pool_rows)

    # ------------------------------------------------------------------ swap's share

    @property
    def num_blocks(self) -> int:
        return self.num_slots

    @property
    def num_free_blocks(self) -> int:
        """Slots swap can reserve now: every slot not swap's already (cached ones are given up)."""
        return self.num_slots - len(self._swap_slots)

    @property
    def num_used_blocks(self) -> int:
        """Slots swap holds."""
        return len(self._swap_slots)

    def used_slots(self) -> list[int]:
        """Swap's slots, ascending (for the invariants)."""
        return sorted(self._swap_slots)

    def reserve(self, num_slots: int, pass_down: bool = False) -> tuple[list[int], Blocks | None]:
        """``num_slots`` slots for swap, and the cached blocks given up for them (their bytes
        copied aside when ``pass_down``, for the tier below; None when none were). Raises
        ResourceExhausted, changing nothing, if fewer slots are free or cached than asked."""
        room = self.num_slots - len(self._swap_slots)
        if num_slots > room:
            raise ResourceExhausted(
                f"host area: swap needs {num_slots} slots but only {room} of {self.num_slots} are not "
                f"swap's ({len(self._swap_slots)} are); raise --host-cache-gib (or --swap-space without it)"
            )
        slots, evicted = self._claim(num_slots, pass_down)
        self._swap_slots.update(slots)
        return slots, evicted

    def release(self, slots: Sequence[int]) -> None:
        """Give swap's ``slots`` back (their blocks went back to the device, or their sequence ended)."""
        if len(set(slots)) != len(slots):
            raise InvalidArgument(f"host slots {list(slots)} name a slot twice")
        for k, s in enumerate(slots):
            if s not in self._swap_slots:
                raise InvalidArgument(f"slots[{k}] = {s} is not a swap slot of this host area")
        for s in reversed(slots):
            self._swap_slots.remove(s)
            self._free.append(s)

    def store(self, device_ids: Sequence[int], slots: Sequence[int]) -> None:
        """Copy pool blocks ``device_ids`` into swap's ``slots`` (same order); complete on return."""
        if self.rows is not None:
            self.copy_rows(slots, device_ids)
        else:
            self.copy_in(slots, [self.pool_rows[i] for i in device_ids])

    def load(self, slots: Sequence[int], device_ids: Sequence[int]) -> None:
        """Copy swap's ``slots`` into pool blocks ``device_ids`` (same order); complete on return
        (a compute process reads the pool next)."""
        if len(slots) != len(device_ids):
            raise InvalidArgument(f"len(slots) = {len(slots)} != len(device_ids) = {len(device_ids)}")
        for k, s in enumerate(slots):
            if s not in self._swap_slots:
                raise InvalidArgument(f"slots[{k}] = {s} is not a swap slot of this host area")
        self.copy_out(slots, [self.pool_rows[i] for i in device_ids])

    def _claim(self, n: int, pass_down: bool) -> tuple[list[int], Blocks | None]:
        """``n`` free slots, lowest ids first (the host cache also gives up cached blocks)."""
        free = self._free
        slots = free[len(free) - n :]
        slots.reverse()  # the stack's order: popped from its end
        del free[len(free) - n :]
        return slots, None

    def check_invariants(self) -> None:
        """AssertionError unless every slot is free or swap's exactly once (the host cache adds its own)."""
        every = sorted([*self._free, *self._swap_slots])
        assert every == list(range(self.num_slots)), f"slots free/swap overlap or leak: {every}"

    # ------------------------------------------------------------------ the copy path

    def copy_in(self, slots: Sequence[int], views: Sequence[torch.Tensor]) -> None:
        """Copy each of ``views`` (a pool block as flat uint8, on ``device``) into its slot."""
        self._copy(slots, views, into_slots=True)

    def copy_out(self, slots: Sequence[int], views: Sequence[torch.Tensor]) -> None:
        """Copy each slot of ``slots`` into its pool block of ``views`` (flat uint8, on ``device``)."""
        self._copy(slots, views, into_slots=False)

    def _copy(self, slots: Sequence[int], views: Sequence[torch.Tensor], into_slots: bool) -> None:
        rows = self.slots
        pairs = [(rows[s], v) if into_slots else (v, rows[s]) for s, v in zip(slots, views, strict=True)]
        if not pairs:
            return
        if self.stream is None:
            top = max(slots)
            if top >= self.ahead_at or top >= self.mapped:
                self._reach(top)
            for dst, src in pairs:
                copy_block(dst, src)
            return
        self._on_side_stream(lambda: [dst.copy_(src, non_blocking=True) for dst, src in pairs])

    def bind_rows(self, rows: torch.Tensor) -> None:
        """Take ``rows`` (a CPU pool as ``[num_blocks, block_bytes]`` uint8, contiguous) as the pool
        ``copy_rows`` copies from: its layout checked, it and the slots viewed as flat bytes."""
        if rows.dim() != 2 or rows.shape[1] != self.block_bytes or rows.dtype != torch.uint8 or rows.is_cuda:
            raise InvalidArgument(
                f"pool rows {tuple(rows.shape)} {rows.dtype} on {rows.device}: need [num_blocks, "
                f"{self.block_bytes}] uint8 on the CPU, contiguous"
            )
        if not rows.is_contiguous():
            raise InvalidArgument(f"pool rows {tuple(rows.shape)} are not contiguous")
        self.rows = rows
        self._rows_bytes = memoryview(rows.numpy()).cast("B")
        self._slots_bytes = memoryview(self.slots.numpy()).cast("B")
        # The same rows as one numpy void item each (copy_rows' small rows).
        self._small = self.block_bytes <= SMALL_ROW_BYTES
        row = np.dtype(f"V{self.block_bytes}")
        self._rows_items = rows.numpy().view(row).reshape(-1)
        self._slots_items = self.slots.numpy().view(row).reshape(-1)

    def copy_rows(self, slots: Sequence[int], ids: Sequence[int]) -> None:
        """Rows ``ids`` of the bound pool (``bind_rows``) into ``slots``.

        A row of up to ``SMALL_ROW_BYTES`` is one numpy void item: from ``GATHER_FROM`` rows on,
        one gather (half the per-row loop's time for 32 rows of 64 bytes), else an item copy
        each (cheaper than two memoryview slices). Both go through a temporary, so a larger row
        is a memoryview slice copy each: one memcpy. Measured by bench/block_manager_ab.py --tiers.
        """
        top = max(slots, default=-1)
        if top >= self.ahead_at or top >= self.mapped:
            self._reach(top)
        if self._small:
            dst_items, src_items = self._slots_items, self._rows_items
            n = len(ids)
            if n >= GATHER_FROM:  # lists to indices with the type given: cheaper than numpy's guess
                dst_items[np.fromiter(slots, np.intp, n)] = src_items.take(np.fromiter(ids, np.intp, n))
                return
            for slot, i in zip(slots, ids, strict=True):
                dst_items[slot] = src_items[i]
            return
        dst, src, size = self._slots_bytes, self._rows_bytes, self.block_bytes
        for slot, i in zip(slots, ids, strict=True):
            at, start = slot * size, i * size
            dst[at : at + size] = src[start : start + size]

    def copy_row(self, slot: int, i: int) -> None:
        """``copy_rows`` of one row: pool row ``i`` into ``slot``."""
        if slot >= self.ahead_at or slot >= self.mapped:
            self._reach(slot)
        if self._small:
            self._slots_items[slot] = self._rows_items[i]
            return
        size = self.block_bytes
        at, start = slot * size, i * size
        self._slots_bytes[at : at + size] = self._rows_bytes[start : start + size]

    def _reach(self, slot: int) -> None:
        """Before a copy into ``slot`` of a CPU area: its page mapped now if it is not yet
        (``map_ahead``), and the thread topping the mapped pages up to ``AHEAD_BYTES`` past it
        started if it is not running; the next call when the copies have used half of that."""
        if slot >= self.mapped:
            self.map_ahead(slot)
        ahead = max(1, AHEAD_BYTES // self.block_bytes)
        self.ahead_at = min(self.num_slots, slot + 1 + ahead // 2)
        end = min(self.num_slots, slot + 1 + ahead)
        if end > self.mapped and (self._mapper is None or not self._mapper.is_alive()):
            self._mapper = threading.Thread(
                target=self._map_behind, args=(end,), name="kvtier-map", daemon=True
            )
            self._mapper.start()

    def _map_behind(self, end: int) -> None:
        """The thread of ``_reach``: map slots up to ``end`` a kernel call of ``AHEAD_CALL_BYTES`` at a
        time, at the lowest priority (nice 19), so it runs where the loop and the engines beside it
        leave a core idle."""
        name_os_thread("kvtier-map")
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)  # this thread only (Linux)
        step = max(1, AHEAD_CALL_BYTES // self.block_bytes)
        while self.mapped < end:
            self._map(min(end, self.mapped + step))

    def map_ahead(self, slot: int) -> None:
        """Map the CPU area's pages up to ``slot`` and ``MAP_AHEAD_BYTES`` past it in one call, so the
        copies into them do not fault page by page. Bytes unchanged; where the kernel refuses
        (before Linux 5.14), pages are mapped on first touch as before and this is not tried again."""
        self._map(max(slot + 1, self.mapped + MAP_AHEAD_BYTES // self.block_bytes))

    def _map(self, end: int) -> None:
        """Map slots [mapped, end) (at most the area). The loop (``map_ahead``) and the thread
        (``_map_behind``) may map one range together: the kernel keeps a mapped page's bytes, and
        ``mapped`` only grows, to the end of a range that began at or below it."""
        size, start_slot = self.block_bytes, self.mapped
        end = min(self.num_slots, end)
        if end <= start_slot:
            return
        base, page = self.slots.data_ptr(), os.sysconf("SC_PAGE_SIZE")
        start = base + start_slot * size
        start -= start % page
        done = populate(start, base + end * size - start)
        with self._mapping:
            self.mapped = max(self.mapped, end) if done else self.num_slots

    def _on_side_stream(self, copies: Callable[[], object]) -> None:
        """Run ``copies`` on the side stream after the default stream's queued work; wait for them."""
        stream = self.stream
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            copies()
            done = torch.cuda.Event()
            done.record(stream)
        # Complete before returning: the device block is reused, or read by another process, next.
        done.synchronize()


def flat_bytes(view: torch.Tensor) -> torch.Tensor:
    """A contiguous block as a flat uint8 view (no copy)."""
    if not view.is_contiguous():
        raise InvalidArgument(f"block view of shape {tuple(view.shape)} is not contiguous")
    return view.reshape(-1).view(torch.uint8)


def copy_block(dst: torch.Tensor, src) -> None:
    """Copy one block's bytes into ``dst`` (a flat uint8 tensor) from a uint8 tensor or a buffer.

    On CPU this is one numpy memcpy: torch's ``copy_`` splits a 128 KiB copy over its intra-op
    threads, which cost 5 ms instead of 0.1 ms a block on a machine whose cores are busy
    (bench/tiers.py). A CUDA ``dst`` is a host -> device copy on the current stream, complete
    when this returns (from pageable memory, ``copy_`` may return before the DMA has landed, and
    another process reads the block next).
    """
    if dst.device.type != "cpu":
        dst.copy_(src if isinstance(src, torch.Tensor) else torch.frombuffer(src, dtype=torch.uint8))
        torch.cuda.current_stream(dst.device).synchronize()
        return
    src_array = src.numpy() if isinstance(src, torch.Tensor) else np.frombuffer(src, dtype=np.uint8)
    np.copyto(dst.numpy(), src_array)
