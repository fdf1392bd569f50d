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
arrived (relaid out on the way, ``block_layout``). Nothing is staged and no call is made in the
step: the worker reports each save once copied (``saves_done``) and the scheduler side publishes
the written blocks with the Free of the pool sequence (``prefix_queries.Releases``): published
for every engine, they go down the host and disk tiers like any block. A save is written only
well before the lease that holds its pool blocks could lapse (``SaveItem.write_by``): after it,
the blocks could be another sequence's; one not written is reported so, and its blocks are never
published.

On CPU the copy runs on its own thread (``kvtier-save``), beside vLLM's next steps, not in the
step (on a 2-core machine it was 1.3% of a no-reuse run, all of it on the worker's path; on a GPU
a save is a device copy of about 0.1 ms and stays in the step, landed before its report). vLLM
writes KV only in a forward, and only into the blocks of the requests it runs: a block being
saved is a running request's full prompt block (never written again while it runs) or a finished
request's, whose blocks the scheduler side holds (``request_finished`` True) until the worker
reports its copies done (``finished_sending``, for the requests each step's metadata names in
``release``). Only a preempted request's blocks go back to vLLM unasked: a step whose metadata
says ``flush`` (a request it preempted had saves in flight) waits for every copy before its
forward (``handle_preemptions``), as vLLM's own offloading connector does.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from kvtier.pool import attach_pool, populate
from kvtier.vllm import LOGGER
from kvtier.vllm.block_layout import BlockCopier
from kvtier.vllm.cache_link import name_os_thread
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
        self._copies: deque[tuple[Future, list[SaveItem]]] = deque()  # saves being copied, oldest first
        self._releasing: set[str] = set()  # finished requests vLLM holds until their copies are done
        self._copier_thread: ThreadPoolExecutor | None = None  # started with the first save off the step
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
        """Copy the saves' vLLM blocks into their pool blocks (all in one copier call): on CPU on the
        copy thread, on a GPU now; each is reported once copied (``take_saves_done``)."""
        pool = self.pool(saves[0].pool_name) if saves else None
        if pool is not None and not pool.tensor.is_cuda:
            self._copies.append((self.copy_thread().submit(self._copy, saves), saves))
        else:
            self._report(saves, self._copy(saves))

    def copy_thread(self) -> ThreadPoolExecutor:
        """The thread CPU saves are copied on (one: copies run in the order of vLLM's steps)."""
        if self._copier_thread is None:
            self._copier_thread = ThreadPoolExecutor(
                1, thread_name_prefix="kvtier-save", initializer=name_os_thread, initargs=("kvtier-save",)
            )
        return self._copier_thread

    def _copy(self, saves: list[SaveItem]) -> list[bool]:
        """Write the saves still well within their lease (one copier call); which were written."""
        now = time.monotonic()
        written = [now < item.write_by and self.pool(item.pool_name) is not None for item in saves]
        items = [item for item, ok in zip(saves, written, strict=True) if ok]
        if items:
            start = time.perf_counter()
            pool = self.pool(items[0].pool_name).tensor  # one pool is mapped: every save's
            self.copier.save(
                pool,
                [i for item in items for i in item.pool_block_ids],
                [i for item in items for i in item.vllm_block_ids],
            )
            landed(pool)  # in the pool before the scheduler side publishes it
            self.stats["save_s"] += time.perf_counter() - start
        return written

    def _report(self, saves: list[SaveItem], written: list[bool]) -> None:
        for item, ok in zip(saves, written, strict=True):
            self._saves_done.append((item.req_id, item.end_block, ok))
            if ok:
                self.stats["saved_blocks"] += len(item.pool_block_ids)
            else:
                self._dropped(len(item.pool_block_ids), "its pool is not mapped or its lease may lapse")

    def _collect(self, wait: bool) -> None:
        """Report the copies done, oldest first (``wait``: every copy, waited for)."""
        while self._copies and (wait or self._copies[0][0].done()):
            future, saves = self._copies.popleft()
            try:
                written = future.result()
            except Exception:
                log.exception("kvtier: a copy of %d saves failed; they are not published", len(saves))
                written = [False] * len(saves)
            self._report(saves, written)

    def flush(self) -> None:
        """Wait for every copy in flight (before a forward that may write a preempted request's blocks)."""
        self._collect(wait=True)

    def take_saves_done(self) -> list[tuple[str, int, bool]]:
        self._collect(wait=False)
        done, self._saves_done = self._saves_done, []
        return done

    def finished_sending(self, release: list[str]) -> set[str]:
        """Of the finished requests whose blocks vLLM holds for this side (``release``: named once,
        in a step's metadata), those with no copy in flight now: vLLM may free their blocks."""
        self._collect(wait=False)
        self._releasing.update(release)
        if not self._releasing:
            return set()
        copying = {item.req_id for _, saves in self._copies for item in saves}
        done = self._releasing - copying
        self._releasing -= done
        return done

    def _dropped(self, num_blocks: int, why: str) -> None:
        self.stats["dropped_blocks"] += num_blocks
        self._dropped_since_warning += num_blocks
        now = time.monotonic()
        if now - self._warned_at >= WARN_EVERY_S:
            log.warning("kvtier: %d blocks not saved (%s)", self._dropped_since_warning, why)
            self._warned_at, self._dropped_since_warning = now, 0

    def close(self) -> None:
        self.flush()  # no copy into a pool being unmapped
        if self._copier_thread is not None:
            self._copier_thread.shutdown(wait=True)
        st = self.stats
        log.info(
            "kvtier worker: %d blocks loaded, %d failed; %d saved (%.0f ms copying), %d not saved",
            st["loaded_blocks"], st["failed_blocks"], st["saved_blocks"], st["save_s"] * 1e3, st["dropped_blocks"],
        )  # fmt: skip
        with self._pool_lock:
            pools, self._pools = self._pools, {}
        for pool in pools.values():
            pool.close()
