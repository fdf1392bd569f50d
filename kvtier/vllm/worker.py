"""The worker side: the pool mapped beside vLLM's KV cache, loads into it and saves out of it.

At ``register_kv_caches`` the worker attaches (its own lease), maps the pool the cache service
owns (shared memory, or CUDA IPC on a GPU: no KV crosses a socket), refuses a pool that does not
match the engine (``engine_check``) and learns vLLM's block layout (``block_layout``).

Loads (``load``): the scheduler side pinned the hit's pool blocks; they are copied into vLLM's
blocks before the forward of the step that computes the rest of the prompt, straight from the
pool's memory, and the request is reported done (the scheduler side then frees its pin). A load whose pool is not the
one mapped, or whose pinning lease may have lapsed before the copy ended, is reported as failed
blocks: vLLM then recomputes them (``kv_load_failure_policy: recompute``), never uses them.

Saves (``stage``): at the end of the step that computed them, a request's new full prompt blocks
are copied out of vLLM's cache into a staging tensor (one batched copy per layer; the tensor of
an earlier save is reused once written: fresh memory costs a page fault per page), so vLLM keeps
no block for us and a preemption cannot race a save. A background thread then gathers the saves
staged within ``save_batch_ms`` (the cache service's cost is mostly per call), asks ``Allocate``
for their prompts up to those blocks in one call, writes the staged blocks into the new pool
blocks (those past what the cache already holds; relaid out on the way, ``block_layout``), and
``Free``s the sequences with a commit of them in one call: published for every engine, they go
down the host and disk tiers like any block. If the cache service is away,
or too much is staged already, the save is dropped with a WARNING: a later request recomputes.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import queue
import sys
import threading
import time

import torch

from kvtier.cache_errors import CacheCallError
from kvtier.pool import attach_pool
from kvtier.sequence_types import AllocateItem, CommitItem
from kvtier.vllm import LOGGER
from kvtier.vllm.block_layout import BlockCopier
from kvtier.vllm.cache_link import CacheDown, CacheLink, name_os_thread
from kvtier.vllm.transfers import LoadItem, SaveItem, pool_name

log = logging.getLogger(LOGGER)

WRITER_NICENESS = 10  # the save writer's OS priority (nice), below vLLM's threads
WARN_EVERY_S = 10.0  # a dropped save is logged at most this often (with the count since)
SAVE_BATCH_S = 0.05  # ConnectorConfig.save_batch_ms's default
MAX_SPARES = 8  # written staging tensors kept for reuse


def landed(tensor: torch.Tensor) -> None:
    """Wait until the copies this thread queued on ``tensor``'s GPU have run (nothing on CPU)."""
    if tensor.is_cuda:
        torch.cuda.current_stream(tensor.device).synchronize()


MADV_POPULATE_WRITE = 23  # Linux 5.14+


def map_pages(tensor: torch.Tensor) -> None:
    """Map every page of a CPU pool ``tensor`` into this process now (``MADV_POPULATE_WRITE``: its
    bytes unchanged), so the first save into each page does not pay a page fault (about 1 us per
    4 KiB in this process, a third of a copy's time; the kernel maps 512 MiB in ~25 ms). Linux
    only; where the kernel refuses, the pages are mapped on first touch as before."""
    if tensor.is_cuda or sys.platform != "linux":
        return
    page = os.sysconf("SC_PAGE_SIZE")
    start = tensor.data_ptr() - tensor.data_ptr() % page
    size = tensor.data_ptr() + tensor.untyped_storage().nbytes() - start
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        libc.madvise(start, size, MADV_POPULATE_WRITE)


class WorkerSide:
    def __init__(self, link: CacheLink, copier: BlockCopier, block_size: int, max_staged_bytes: int,
                 batch_s: float = SAVE_BATCH_S):  # fmt: skip
        self.link = link
        self.copier = copier
        self.block_size = block_size
        self.max_staged_bytes = max_staged_bytes
        self.batch_s = batch_s  # how long the writer gathers saves before it writes them together
        self.stats = {"loaded_blocks": 0, "failed_blocks": 0, "saved_blocks": 0, "dropped_blocks": 0,
                      "writes": 0, "staged_s": 0.0}  # fmt: skip
        self._pools: dict[str, object] = {}  # pool name -> mapping, the current attach's only
        self._pool_lock = threading.Lock()
        self._finished_loads: set[str] = set()
        self._failed_blocks: set[int] = set()
        self._queue: queue.Queue = queue.Queue()
        self._staged_bytes = 0
        self._staged_lock = threading.Lock()
        self._spares: list[torch.Tensor] = []  # staging tensors written and free again, smallest first
        self._dropped_since_warning = 0
        self._warned_at = 0.0
        self._idle = threading.Event()
        self._idle.set()
        self._writer = threading.Thread(target=self._write_forever, name="kvtier-save", daemon=True)
        self._writer.start()

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
        for item in loads:
            self._finished_loads.add(item.req_id)
            pool = self.pool(item.pool_name)
            ok = pool is not None and time.monotonic() < item.valid_until
            if ok:
                self.copier.load(pool.tensor, item.pool_block_ids, item.vllm_block_ids)
                landed(pool.tensor)
                # NOTE: checked after the read: bytes read while the lease pinned them are the hit's.
                ok = time.monotonic() < item.valid_until
            if ok:
                self.stats["loaded_blocks"] += len(item.vllm_block_ids)
            else:
                self._failed_blocks.update(item.vllm_block_ids)
                self.stats["failed_blocks"] += len(item.vllm_block_ids)
                log.warning(
                    "kvtier: request %s: %d blocks not loaded (%s); vLLM recomputes them",
                    item.req_id,
                    len(item.vllm_block_ids),
                    "pool not mapped" if pool is None else "its lease may have lapsed",
                )

    def take_finished_loads(self) -> set[str]:
        done, self._finished_loads = self._finished_loads, set()
        return done

    def take_failed_blocks(self) -> set[int]:
        failed, self._failed_blocks = self._failed_blocks, set()
        return failed

    # ------------------------------------------------------------ saves

    def stage(self, saves: list[SaveItem]) -> None:
        """Copy the saves' vLLM blocks out now (this step computed them); write them in the background."""
        if not saves:
            return
        ids = [i for item in saves for i in item.vllm_block_ids]
        size = len(ids) * self.copier.block_bytes
        if not self.link.attached:
            return self._dropped(len(ids), "the cache service is away")
        with self._staged_lock:
            if self._staged_bytes + size > self.max_staged_bytes:
                full = True
            else:
                full = False
                self._staged_bytes += size
                self._idle.clear()
        if full:
            return self._dropped(len(ids), "max_staged_save_mib of saves already wait for the cache service")
        with self._staged_lock:  # a written staging tensor is reused: fresh memory costs a page fault a page
            fits = [i for i, t in enumerate(self._spares) if len(t) >= len(ids)]
            spare = self._spares.pop(fits[0]) if fits else None
        start = time.perf_counter()
        staging = spare if spare is not None else self.copier.staging(len(ids))
        blocks, raw = self.copier.stage(ids, into=staging)
        # On a GPU the copy is queued on vLLM's stream: the writer waits for this event, not vLLM.
        ready = torch.cuda.Event() if staging.is_cuda else None
        if ready is not None:
            ready.record()
        self._queue.put((saves, blocks, raw, staging, size, ready))
        self.stats["staged_s"] += time.perf_counter() - start

    def wait_idle(self, timeout_s: float) -> bool:
        """Wait until every staged save is written or dropped (tests, benchmarks, shutdown)."""
        return self._idle.wait(timeout_s)

    def _dropped(self, num_blocks: int, why: str) -> None:
        self.stats["dropped_blocks"] += num_blocks
        self._dropped_since_warning += num_blocks
        now = time.monotonic()
        if now - self._warned_at >= WARN_EVERY_S:
            log.warning("kvtier: %d blocks not saved (%s)", self._dropped_since_warning, why)
            self._warned_at, self._dropped_since_warning = now, 0

    def _write_forever(self) -> None:
        name_os_thread("kvtier-save")
        # Saves are background work: on a busy box the OS runs vLLM's threads first (a save that
        # waits is staged; past max_staged_save_mib it is dropped, never the engine slowed).
        with contextlib.suppress(OSError):
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), WRITER_NICENESS)
        while True:
            jobs = [self._queue.get()]
            # Saves staged meanwhile, and those staged within batch_s, go in the same two calls.
            deadline = time.monotonic() + self.batch_s
            while jobs[-1] is not None:
                try:
                    jobs.append(self._queue.get(timeout=max(0.0, deadline - time.monotonic())))
                except queue.Empty:
                    break
            closing = jobs[-1] is None
            if closing:
                jobs.pop()
            if jobs:
                self._write_jobs(jobs)
            if closing:
                return

    def _write_jobs(self, jobs: list[tuple]) -> None:
        """Write the staged saves ``jobs`` (``stage``'s), dropping them if the cache cannot take them."""
        num_blocks = sum(len(job[1]) for job in jobs)
        try:
            self._write(jobs)
        except CacheDown as e:
            self._dropped(num_blocks, f"the cache service is away: {e}")
        except CacheCallError as e:
            self._dropped(num_blocks, f"{e.code}: {e.details}")
        except Exception:
            log.exception("kvtier: a save failed")
            self._dropped(num_blocks, "an error (logged above)")
        finally:
            with self._staged_lock:
                for _, _, _, staging, size, _ in jobs:
                    self._spares.append(staging)
                    self._staged_bytes -= size
                self._spares = sorted(self._spares, key=len)[-MAX_SPARES:]
                if self._staged_bytes == 0 and self._queue.empty():
                    self._idle.set()

    def _write(self, jobs: list[tuple]) -> None:
        """Allocate the saves' prompts (one call for every job), write each job's staged blocks past
        each hit, commit and free them (one call)."""
        generation, spec = self.link.snapshot()
        pool = self.pool(pool_name(spec)) if spec is not None else None
        if pool is None:
            raise CacheDown("no pool mapped")
        items = [AllocateItem(s.token_ids, tenant_salt=s.tenant_salt, adapter_id=s.adapter_id)
                 for job in jobs for s in job[0]]  # fmt: skip
        seqs = self.link.call(lambda c: c.allocate(items), expect_generation=generation)
        replies, writes, commits = iter(seqs), [], []
        for saves, blocks, raw, _, _, ready in jobs:
            if ready is not None:
                ready.synchronize()
            pool_ids, rows, offset = [], [], 0
            for save in saves:
                seq = next(replies)
                hit, full = seq.num_cached_tokens // self.block_size, len(save.token_ids) // self.block_size
                # Blocks between the cache's hit and ours would be unwritten: publish only a gapless chain.
                if hit >= save.first_block:
                    pool_ids += seq.block_table[hit:full]
                    rows += range(offset + hit - save.first_block, offset + full - save.first_block)
                    commits.append(CommitItem(seq.sequence_id, [], full * self.block_size))
                offset += full - save.first_block
            if pool_ids:
                writes.append((pool_ids, blocks, rows, raw))
        lease_ttl = self.link.client.lease_ttl_s if self.link.client is not None else 0.0
        if writes and time.monotonic() < self.link.valid_until() - lease_ttl / 4:
            for pool_ids, blocks, rows, raw in writes:
                self.copier.write_staged(pool.tensor, pool_ids, blocks, list(rows), raw)
            landed(pool.tensor)  # written before they are published (and their staging reused)
        else:
            commits = []  # not written: nothing to publish
        self.link.call(lambda c: c.free([s.sequence_id for s in seqs], commits), expect_generation=generation)
        self.stats["saved_blocks"] += sum(len(w[0]) for w in writes) if commits else 0
        self.stats["writes"] += 1

    def close(self) -> None:
        st = self.stats
        log.info(
            "kvtier worker: %d blocks loaded, %d failed; %d saved in %d writes (%.0f ms staging them in vLLM's "
            "steps), %d dropped",
            st["loaded_blocks"], st["failed_blocks"], st["saved_blocks"], st["writes"], st["staged_s"] * 1e3,
            st["dropped_blocks"],
        )  # fmt: skip
        self._queue.put(None)
        self._writer.join(timeout=5)
        with self._pool_lock:
            pools, self._pools = self._pools, {}
        for pool in pools.values():
            pool.close()
