"""The scheduler side's calls to the cache service, each made for many requests at once on a thread.

vLLM hands the connector every new request (``on_new_request``) before its scheduler first asks
how many of the request's tokens the cache holds, and requests often arrive in bursts. Each
arriving prompt is queued on a ``Batcher``; its thread takes every job queued since its last call
and makes one call for all of them. By the time the scheduler asks, the answer is usually there,
and the scheduler loop never waits on a call it did not need.

- ``PrefixQueries``: how much of each prompt the cache holds on any tier (``LookupPrefix``, one call
  per salt and adapter): what an engine that only loads asks first.
- ``PoolAllocations``: a pool sequence for each prompt (``Allocate``): its hit pinned, fresh pool
  blocks for the rest, which the worker then writes in vLLM's step (an engine that saves).
- ``Releases``: pool sequences freed, each with a commit of the blocks written into it (``Free``),
  gathered for ``batch_s`` (the cache's cost is mostly per call).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import defaultdict
from concurrent.futures import Future
from dataclasses import dataclass

from kvtier.cache_errors import CacheCallError, NoFreeBlocks
from kvtier.cpu_plan import name_os_thread
from kvtier.pool import PoolSpec
from kvtier.sequence_types import AllocateItem, CommitItem, SequenceBlocks
from kvtier.vllm import LOGGER
from kvtier.vllm.cache_link import CacheDown, CacheLink
from kvtier.vllm.transfers import pool_name

log = logging.getLogger(LOGGER)

MAX_PER_CALL = 64


class Batcher:
    """A thread making one call for the jobs queued since its last (``_answer``, up to
    ``MAX_PER_CALL`` at a time; jobs queued within ``batch_s`` of the first are taken too)."""

    def __init__(self, link: CacheLink, thread_name: str, batch_s: float = 0.0):
        self.link = link
        self.batch_s = batch_s
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, args=(thread_name,), name=thread_name, daemon=True)
        self._thread.start()

    def close(self) -> None:
        """Answer what is queued, then stop."""
        self._queue.put(None)

    def join(self, timeout_s: float) -> None:
        self._thread.join(timeout_s)

    def _run(self, thread_name: str) -> None:
        name_os_thread(thread_name)
        while True:
            jobs = [self._queue.get()]
            deadline = time.monotonic() + self.batch_s
            while jobs[-1] is not None and len(jobs) < MAX_PER_CALL:
                try:
                    left = deadline - time.monotonic()
                    jobs.append(self._queue.get(timeout=left) if left > 0 else self._queue.get_nowait())
                except queue.Empty:
                    break
            closing = jobs[-1] is None
            if closing:
                jobs.pop()
            if jobs:
                self._answer(jobs)
            if closing:
                return

    def _answer(self, jobs: list) -> None:
        raise NotImplementedError


class PrefixQueries(Batcher):
    """``submit(tokens, salt, adapter)`` -> a Future of the leading tokens the cache holds on any
    tier (whole blocks, uncapped); 0 when the cache could not answer (down, refused: no hit)."""

    def __init__(self, link: CacheLink):
        super().__init__(link, "kvtier-prefix")

    def submit(self, tokens: list[int], salt: str, adapter: str) -> Future:
        future: Future = Future()
        self._queue.put((tokens, salt, adapter, future))
        return future

    def _answer(self, jobs: list) -> None:
        groups = defaultdict(list)
        for job in jobs:
            groups[job[1], job[2]].append(job)
        for (salt, adapter), group in groups.items():
            self._ask(salt, adapter, group)

    def _ask(self, salt: str, adapter: str, group: list) -> None:
        held = [0] * len(group)
        try:
            hits = self.link.call(
                lambda c: c.lookup_prefix([job[0] for job in group], tenant_salt=salt, adapter_id=adapter)
            )
            held = [hit.total for hit in hits]
        except CacheDown as e:
            log.debug("kvtier: LookupPrefix of %d prompts: no answer (%s)", len(group), e)
        except CacheCallError as e:
            log.warning("kvtier: LookupPrefix of %d prompts refused: %s: %s", len(group), e.code, e.details)
        except Exception:
            log.exception("kvtier: LookupPrefix of %d prompts failed", len(group))
        for job, tokens in zip(group, held, strict=True):
            job[3].set_result(tokens)


@dataclass
class PoolSequence:
    """A pool sequence of this side's lease holding one prompt: its leading ``num_cached_tokens``
    (the hit: whole blocks, below the last token) pinned, fresh blocks for the rest."""

    sequence_id: int
    block_table: list[int]
    num_cached_tokens: int
    pool_name: str
    generation: int  # the link's attach it was made under (the sequence dies with that lease)

    @classmethod
    def of(cls, seq: SequenceBlocks, spec: PoolSpec, generation: int) -> PoolSequence:
        """An Allocate's answer for one prompt, in the pool ``spec`` of attach ``generation``."""
        return cls(seq.sequence_id, list(seq.block_table), seq.num_cached_tokens, pool_name(spec), generation)


class PoolAllocations(Batcher):
    """``submit(item)`` -> a Future of the prompt's ``PoolSequence``, or None when the cache could
    not give one (down, refused, no room: the request is then neither loaded nor saved)."""

    def __init__(self, link: CacheLink):
        super().__init__(link, "kvtier-alloc")

    def submit(self, item: AllocateItem) -> Future:
        future: Future = Future()
        self._queue.put((item, future))
        return future

    def _answer(self, jobs: list) -> None:
        items = [job[0] for job in jobs]
        try:
            answers = self._allocate(items)
        except NoFreeBlocks as e:  # all or nothing: when the burst does not fit, the ones that do, alone
            log.info("kvtier: the pool has no room for %d prompts now (%s)", len(items), e.details)
            answers = [self._alone(item) for item in items] if len(items) > 1 else [None]
        for (_, future), answer in zip(jobs, answers, strict=True):
            future.set_result(answer)

    def _alone(self, item: AllocateItem) -> PoolSequence | None:
        try:
            return self._allocate([item])[0]
        except NoFreeBlocks:
            return None

    def _allocate(self, items: list[AllocateItem]) -> list[PoolSequence | None]:
        """The items' pool sequences (None each when the cache cannot answer); NoFreeBlocks propagates."""
        generation, spec = self.link.snapshot()
        try:
            if spec is None:
                raise CacheDown("not attached")
            seqs = self.link.call(lambda c: c.allocate(items), expect_generation=generation)
        except NoFreeBlocks:
            raise
        except CacheDown as e:
            log.debug("kvtier: Allocate of %d prompts: no answer (%s)", len(items), e)
            return [None] * len(items)
        except CacheCallError as e:
            log.warning("kvtier: Allocate of %d prompts refused: %s: %s", len(items), e.code, e.details)
            return [None] * len(items)
        except Exception:
            log.exception("kvtier: Allocate of %d prompts failed", len(items))
            return [None] * len(items)
        return [PoolSequence.of(seq, spec, generation) for seq in seqs]


class Releases(Batcher):
    """``release(sequence, written_tokens)``: free a ``PoolSequence``, publishing its leading
    ``written_tokens`` (whole blocks the worker wrote past the hit; 0: nothing to publish). The
    releases of ``batch_s`` go in one Free."""

    def __init__(self, link: CacheLink, batch_s: float):
        super().__init__(link, "kvtier-free", batch_s)
        self.stats = {"frees": 0, "committed_tokens": 0}

    def release(self, seq: PoolSequence, written_tokens: int) -> None:
        self._queue.put((seq, written_tokens))

    def _answer(self, jobs: list) -> None:
        generation = self.link.generation
        live = [
            (seq, n) for seq, n in jobs if seq.generation == generation
        ]  # the others died with their lease
        if not live:
            return
        commits = [CommitItem(seq.sequence_id, [], n) for seq, n in live if n > seq.num_cached_tokens]
        ids = [seq.sequence_id for seq, _ in live]
        try:
            self.link.call(lambda c: c.free(ids, commits), expect_generation=generation)
        except CacheCallError as e:  # the commits refused (all or nothing): the sequences still go
            log.warning("kvtier: %d saves not published: %s: %s", len(commits), e.code, e.details)
            commits = []
            self._free_only(ids, generation)
        except CacheDown as e:
            log.info("kvtier: Free of %d pool sequences: no answer (%s); unpublished", len(ids), e)
            return
        self.stats["frees"] += 1
        self.stats["committed_tokens"] += sum(c.num_computed_tokens for c in commits)

    def _free_only(self, ids: list[int], generation: int) -> None:
        try:
            self.link.call(lambda c: c.free(ids), expect_generation=generation)
        except (CacheDown, CacheCallError) as e:
            log.warning(
                "kvtier: Free of %d pool sequences failed (%s): held until this engine's lease ends",
                len(ids),
                e,
            )
