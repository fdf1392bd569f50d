"""The worker side: the pool mapped beside vLLM's KV cache, loads into it and saves out of it.

At ``register_kv_caches`` the worker attaches (its own lease), maps the pool the cache service
owns (shared memory, or CUDA IPC on a GPU: no KV crosses a socket), refuses a pool that does not
match the engine (``engine_check``) and learns vLLM's block layout (``block_layout``).

Loads (``load``): the scheduler side pinned the hit's pool blocks; they are copied into vLLM's
blocks before the forward of the step that computes the rest of the prompt, straight from the
pool's memory, and the request is reported done (the scheduler side then releases its pin). A
load whose pool is not the one mapped, or whose pinning lease may have lapsed before the copy
ended, is reported as failed blocks: vLLM then recomputes them (``kv_load_failure_policy:
recompute``), never uses them.

Saves (``save``): at the end of the step that computed them (or a later one: a running request's
full prompt blocks do not change), a request's new full prompt blocks are copied from vLLM's
blocks straight into the pool blocks the scheduler side allocated for them when the request
arrived (relaid out on the way, ``block_layout``; on a GPU device to device, landed before the
step's report). Nothing is staged and no call is made in the step: the worker reports each save
(``saves_done``) and the scheduler side publishes the written blocks with the Free of the pool
sequence (``prefix_queries.Releases``): published for every engine, they go down the host and
disk tiers like any block. A save is written only well before the lease that holds its pool
blocks could lapse (``SaveItem.write_by``): after it, the blocks could be another sequence's; one
not written is reported so, and its blocks are never published.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time

import torch

from kvtier.pool import attach_pool, populate
from kvtier.vllm import LOGGER
from kvtier.vllm.block_layout import BlockCopier
from kvtier.vllm.transfers import LoadItem, SaveItem, pool_name

log = logging.getLogger(LOGGER)

WARN_EVERY_S = 10.0  # a dropped save is logged at most this often (with the count since)


def landed(tensor: torch.Tensor) -> None:
    """Wait until the copies this thread queued on ``tensor``'s GPU have run (nothing on CPU)."""
    if tensor.is_cuda:
        torch.cuda.current_stream(tensor.device).synchronize()


def map_pages(tensor: torch.Tensor) -> None:
    """Map every page of a CPU pool ``tensor`` into this process now (``kvtier.pool.populate``: its
    bytes unchanged), so the first save into each page does not pay a page fault (about 1 us per
    4 KiB in this process, a third of a copy's time; the kernel maps 512 MiB in ~25 ms). Linux
    only; where the kernel refuses, the pages are mapped on first touch as before."""
    if tensor.is_cuda or sys.platform != "linux":
        return
    page = os.sysconf("SC_PAGE_SIZE")
    start = tensor.data_ptr() - tensor.data_ptr() % page
    populate(start, tensor.data_ptr() + tensor.untyped_storage().nbytes() - start)


class WorkerSide:
    def __init__(self, copier: BlockCopier):
        self.copier = copier
        self.stats = {
            "loaded_blocks": 0,
            "failed_blocks": 0,
            "saved_blocks": 0,
            "dropped_blocks": 0,
            "save_s": 0.0,
        }
        self._pools: dict[str, object] = {}  # pool name -> mapping, the current attach's only
        self._pool_lock = threading.Lock()
        self._finished_loads: set[str] = set()
        self._failed_blocks: set[int] = set()
        self._saves_done: list[tuple[str, int, bool]] = []
        self._dropped_since_warning = 0
        self._warned_at = 0.0

    # ------------------------------------------------------------ the pool

    def map_pool(self, client) -> None:
        """(The link's on_attached hook.) Map the attached service's pool; drop the one before."""
        name = pool_name(client.pool)
        with self._pool_lock:
            if name in self._pools:
                return
            pool = attach_pool(client.pool)
            old, self._pools = self._pools, {name: pool}
        # In the background: the pages of a large pool take a while (the thread holds a view: mapped).
        threading.Thread(target=map_pages, args=(pool.tensor,), name="kvtier-map", daemon=True).start()
        for previous in old.values():
            previous.close()  # unmapped once no tensor view of it is left (kvtier.pool)

    def pool(self, name: str):
        with self._pool_lock:
            return self._pools.get(name)

    # ------------------------------------------------------------ loads

    def load(self, loads: list[LoadItem]) -> None:
        """Copy each request's hit into its vLLM blocks; report it loaded (failed blocks, if any, too)."""
        copied, target = [], None
        for item in loads:
            self._finished_loads.add(item.req_id)
            pool = self.pool(item.pool_name)
            if pool is None or time.monotonic() >= item.valid_until:
                self._load_failed(item, "pool not mapped" if pool is None else "its lease may have lapsed")
                continue
            self.copier.load(pool.tensor, item.pool_block_ids, item.vllm_block_ids)
            copied.append(item)
            target = pool.tensor
        if target is None:
            return
        landed(target)  # once for the step's loads
        # NOTE: checked after the reads: bytes read while the lease pinned them are the hit's.
        now = time.monotonic()
        for item in copied:
            if now < item.valid_until:
                self.stats["loaded_blocks"] += len(item.vllm_block_ids)
            else:
                self._load_failed(item, "its lease may have lapsed")

    def _load_failed(self, item: LoadItem, why: str) -> None:
        self._failed_blocks.update(item.vllm_block_ids)
        self.stats["failed_blocks"] += len(item.vllm_block_ids)
        log.warning("kvtier: request %s: %d blocks not loaded (%s); vLLM recomputes them",
                    item.req_id, len(item.vllm_block_ids), why)  # fmt: skip

    def take_finished_loads(self) -> set[str]:
        done, self._finished_loads = self._finished_loads, set()
        return done

    def take_failed_blocks(self) -> set[int]:
        failed, self._failed_blocks = self._failed_blocks, set()
        return failed

    # ------------------------------------------------------------ saves

    def save(self, saves: list[SaveItem]) -> None:
        """Copy the saves' vLLM blocks into their pool blocks now (all in one copier call); report each."""
        now = time.monotonic()
        written = [item for item in saves if now < item.write_by and self.pool(item.pool_name) is not None]
        if written:
            start = time.perf_counter()
            pool = self.pool(written[0].pool_name).tensor  # one pool is mapped: every save's
            self.copier.save(
                pool,
                [i for item in written for i in item.pool_block_ids],
                [i for item in written for i in item.vllm_block_ids],
            )
            landed(pool)  # in the pool before the scheduler side publishes it
            self.stats["save_s"] += time.perf_counter() - start
            self.stats["saved_blocks"] += sum(len(item.pool_block_ids) for item in written)
        for item in saves:
            ok = any(item is w for w in written)
            self._saves_done.append((item.req_id, item.end_block, ok))
            if not ok:
                self._dropped(len(item.pool_block_ids), "its pool is not mapped or its lease may lapse")

    def take_saves_done(self) -> list[tuple[str, int, bool]]:
        done, self._saves_done = self._saves_done, []
        return done

    def _dropped(self, num_blocks: int, why: str) -> None:
        self.stats["dropped_blocks"] += num_blocks
        self._dropped_since_warning += num_blocks
        now = time.monotonic()
        if now - self._warned_at >= WARN_EVERY_S:
            log.warning("kvtier: %d blocks not saved (%s)", self._dropped_since_warning, why)
            self._warned_at, self._dropped_since_warning = now, 0

    def close(self) -> None:
        st = self.stats
        log.info(
            "kvtier worker: %d blocks loaded, %d failed; %d saved (%.0f ms in vLLM's steps), %d not saved",
            st["loaded_blocks"], st["failed_blocks"], st["saved_blocks"], st["save_s"] * 1e3, st["dropped_blocks"],
        )  # fmt: skip
        with self._pool_lock:
            pools, self._pools = self._pools, {}
        for pool in pools.values():
            pool.close()
