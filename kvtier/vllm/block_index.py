"""Which blocks the cache service holds, followed from its block events: misses answered locally.

Most prompts of a workload without reuse start with a block nobody computed before. The cache
announces every block that enters or leaves one of its media (``WatchEventBatches``: BlockStored,
BlockRemoved, per medium; the events ready a message, as runs of hashes: ``hashes_only``), so the
scheduler side can tell such a prompt is a miss without asking: one thread follows the stream and
keeps the hashes each medium holds. A prompt whose first block's hash (``kvtier.block_hash``: the
model's fingerprint, the request's salt and adapter at the chain's root) is on no medium is then
``surely_missed``: the scheduler answers 0 with no call, no wait and no thread woken. Anything
else is asked as before (``LookupPrefix``, and the pin's ``Allocate`` before any load): the index
only ever costs hits (a block stored a moment ago and not yet streamed), never serves one.

The stream begins with the blocks the cache holds (``start_with_held``: its held messages, as of
one event), then the events after it, so an engine that joins a long-running cache knows every
block without the log's whole history. The index answers only while it is complete: it has
applied the held blocks and the events up to one the service sent as its newest (``caught_up``),
and no medium is shared across nodes (another node's writes to the shared tier are announced by
that node's cache only). A broken stream is reopened (the held blocks again). Memory: about 100
bytes per block the cache holds on any medium, as the router's index
(``kvtier.gateway.index_follower``, which kvtier.vllm may not import: the router's runs on an
asyncio loop and scores whole chains per node; this one runs on a thread of vLLM's scheduler
process and reads first blocks only).

On by default (``block_index``). vLLM's CPU engine schedules synchronously: while its scheduler
waits for a LookupPrefix answer (a millisecond or more on a loaded machine, longer while the
cache is demoting blocks to its host tier), the worker waits with it. An index answers a miss
with no call and no wait, for about 0.05 ms of this thread's CPU per saved request (the events come
batched, one message carrying every event that is ready, as runs of hashes: a set update per run;
``bench/cache_cpu.py --follower``). bench/README.md, "where the no-reuse throughput goes", has
the measurements.
"""

from __future__ import annotations

import logging
import threading
import time

from kvtier.block_hash import BlockHash, extra_key, hash_block
from kvtier.cache_errors import CacheCallError
from kvtier.cpu_plan import name_os_thread
from kvtier.media import medium
from kvtier.sequence_types import BlockStored, HashRun, HeldBatch
from kvtier.vllm import LOGGER
from kvtier.vllm.cache_link import CacheLink

log = logging.getLogger(LOGGER)

RETRY_S = 1.0  # between attempts to reopen a stream that failed (the link re-attaches meanwhile)


class BlockIndex:
    def __init__(self, link: CacheLink, block_size: int):
        self.link = link
        self.block_size = block_size
        self.complete = False  # every event since the cache's first is applied; no shared medium
        self._held: dict[str, set[BlockHash]] = {}  # medium -> the hashes of the blocks it holds
        self._extra: dict[tuple[str, str, str], bytes] = {}
        self._stream = None
        self._closed = False
        self._thread = threading.Thread(target=self._follow_forever, name="kvtier-index", daemon=True)
        self._thread.start()

    def surely_missed(self, tokens: list[int], salt: str, adapter: str) -> bool:
        """Whether the cache holds no block of this prompt (False: it may; ask it)."""
        spec = self.link.client.pool if self.complete and self.link.client is not None else None
        if spec is None or len(tokens) < self.block_size:
            return False
        key = (spec.model_fingerprint, salt, adapter)
        extra = self._extra.get(key)
        if extra is None:
            extra = self._extra[key] = extra_key(*key)
        root = hash_block(None, tokens[: self.block_size], extra)
        return self.complete and not any(root in held for held in list(self._held.values()))

    def close(self) -> None:
        self._closed = True
        stream = self._stream
        if stream is not None:
            stream.cancel()

    def _follow_forever(self) -> None:
        name_os_thread("kvtier-index")
        while not self._closed:
            client = self.link.client
            if client is not None:
                try:
                    self._follow(client)
                except CacheCallError as e:
                    log.debug("kvtier: the block event stream ended (%s: %s); reopening", e.code, e.details)
                except Exception as e:  # e.g. the link closed this client as it re-attached
                    log.warning("kvtier: following the block events failed (%r); reopening", e)
            self.complete = False
            if not self._closed:
                time.sleep(RETRY_S)

    def _follow(self, client) -> None:
        """Apply the blocks the cache holds (the held messages), then its events; complete once
        they have reached its newest event. A cache that sends no held blocks (an older one)
        replays its log instead: complete only if that began at its very first event."""
        self.complete = False
        self._held = {}
        shared = [t.medium for t in client.get_stats().tiers if _across_nodes(t.medium)]
        self._stream = stream = client.watch_event_batches(start_with_held=True, hashes_only=True)
        if self._closed:
            return
        last, known, held = 0, False, False
        for batch in stream:
            if isinstance(batch, HeldBatch):
                apply_held(self._held, batch)
                if batch.end:
                    last, known, held = batch.as_of, not shared, True
                    if shared:
                        log.info("kvtier: every lookup is asked: medium %s is shared across nodes", shared[0])
            elif runs := batch.runs:
                first = runs[0].first_event_id
                if first <= last:
                    return  # ids went back: the cache restarted
                if not held and last == 0:  # no held blocks came (an older cache): the log's replay
                    known = first == 1 and not shared
                    if not known:
                        log.info(
                            "kvtier: every lookup is asked: %s",
                            f"medium {shared[0]} is shared across nodes" if shared
                            else f"the cache sent no held blocks and its events before {first} were dropped",
                        )  # fmt: skip
                apply_runs(self._held, runs)
                last = runs[-1].last_event_id
            if known and batch.caught_up:
                self.complete = True


def apply_held(held: dict[str, set[BlockHash]], batch: HeldBatch) -> None:
    """A held message (``HeldBatch``) on ``held`` (medium -> the hashes it holds): its hashes added."""
    for name, hashes in batch.held:
        held.setdefault(name, set()).update(hashes)


def apply_runs(held: dict[str, set[BlockHash]], runs: list[HashRun]) -> None:
    """``HashRun``s on ``held`` (medium -> the hashes it holds), in order: a stored run's hashes
    added to its medium's set, a removed run's dropped."""
    for medium_name, stored, hashes in ((r.medium, r.stored, r.hashes) for r in runs):
        on = held.get(medium_name)
        if on is None:
            on = held[medium_name] = set()
        if stored:
            on.update(hashes)
        else:
            on.difference_update(hashes)


def apply_events(held: dict[str, set[BlockHash]], events) -> None:
    """Numbered events (``CacheEvent``s) on ``held`` (medium -> the hashes it holds): BlockStored
    adds its hash to its medium's set, BlockRemoved drops it."""
    for _, event in events:
        hashes = held.get(event.medium)
        if hashes is None:
            hashes = held[event.medium] = set()
        if isinstance(event, BlockStored):
            hashes.add(event.block_hash)
        else:
            hashes.discard(event.block_hash)


def _across_nodes(name: str) -> bool:
    try:
        return medium(name).across_nodes
    except ValueError:
        return True  # a medium this connector does not know: do not answer for it
