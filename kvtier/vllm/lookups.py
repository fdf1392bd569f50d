"""The scheduler side: which leading blocks of a request the cache service holds, and what to do
with vLLM's blocks this step.

vLLM's scheduler asks ``get_num_new_matched_tokens`` from its loop, which must not wait on a
network call for long. So the cache is asked as each request arrives (``on_new_request``:
``LookupPrefix``, read-only, the hit over every tier, many arriving prompts per call, on their own
thread: ``kvtier.vllm.prefix_queries``); when the scheduler asks, the answer is usually there. A
miss (nothing past vLLM's own hit) is answered at once. A hit longer than vLLM's own is pinned:
``Allocate`` of the prompt up to one token past it, on a background thread, pins the hit's pool
blocks under this engine's lease (and promotes host and disk blocks into the pool). The scheduler
waits for these answers at most ``lookup_wait_ms`` per step, all requests together, then answers
"not yet" (None) and vLLM asks again at its next step (and waits again). The waits matter twice:
the request is scheduled in the step that asks, and the calls' threads get the GIL (vLLM's busy
loop holds it; a gRPC call that waits a switch interval for each of its turns takes several
steps). While an answer has been awaited for more than a second (a slow or hung cache service),
no step waits. Prompts
whose every loadable block vLLM's own prefix cache already holds (one block or less, or a local
hit) are never looked up.
With ``block_index`` on, a prompt whose first block the cache never announced is answered 0 on
arrival without a call (``kvtier.vllm.block_index``).

The hit is whole blocks, below the last prompt token (vLLM must compute that one). The loads are
synchronous in vLLM's sense (``load_kv_async`` False): the worker copies the hit before the
forward of the same step that computes the rest of the prompt (a local memory copy of a few
milliseconds costs less than the engine step an asynchronous load waits for), and the pool
sequence is freed when the worker reports the copy done (its ``KvtierWorkerMeta``). A single
thread makes every Allocate and Free of this side, so a Free always follows its Allocate.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass

from kvtier.cache_errors import CacheCallError, NoFreeBlocks
from kvtier.sequence_types import AllocateItem
from kvtier.vllm import LOGGER
from kvtier.vllm.block_index import BlockIndex
from kvtier.vllm.cache_link import CacheDown, CacheLink, name_os_thread
from kvtier.vllm.plan import KvtierMetadata
from kvtier.vllm.prefix_queries import PrefixQueries
from kvtier.vllm.transfers import LoadItem, SaveItem, pool_name

log = logging.getLogger(LOGGER)

STUCK_S = 1.0  # an answer awaited longer than this: the scheduler stops waiting for answers


@dataclass
class Hit:
    """Pool blocks that hold a request's leading tokens, pinned by a sequence of this side's lease."""

    sequence_id: int
    pool_block_ids: list[int]
    num_tokens: int
    pool_name: str
    generation: int  # the link's attach it was made under (the sequence dies with that lease)


@dataclass
class Lookup:
    """What the cache service answered for one request."""

    held_tokens: int  # leading tokens the cache holds on any tier, whole blocks, uncapped
    hit: Hit | None  # pinned blocks beyond vLLM's own hit, or None


@dataclass
class Track:
    """A request this side saves: its prompt, key and vLLM blocks."""

    token_ids: list[int]
    tenant_salt: str
    adapter_id: str
    saved_blocks: int | None  # leading prompt blocks kvtier holds or was sent; None = from vLLM's first step
    block_ids: list[int]


def request_key(request) -> tuple[list[int], str, str] | None:
    """(prompt token ids, salt, adapter) of a request kvtier can key, else None (prompt embeddings or
    multimodal inputs: their KV depends on more than the token ids)."""
    if request.prompt_token_ids is None or getattr(request, "prompt_embeds", None) is not None:
        return None
    if getattr(request, "mm_features", None):
        return None
    lora = getattr(request, "lora_request", None)
    return list(request.prompt_token_ids), request.cache_salt or "", lora.lora_name if lora else ""


class Lookups:
    """``loads``/``saves``: vLLM's ``kv_role`` (a ``kv_producer`` only saves: no request is looked
    up; a ``kv_consumer`` only loads: no block is saved). ``block_index``: answer sure misses from
    ``kvtier.vllm.block_index`` (the setting of that name)."""

    def __init__(
        self,
        link: CacheLink,
        block_size: int,
        max_model_len: int,
        lookup_wait_s: float = 0.0,
        *,
        loads: bool = True,
        saves: bool = True,
        block_index: bool = False,
    ):
        self.link = link
        self.loads, self.saves = loads, saves
        self.block_size = block_size
        self.max_model_len = max_model_len
        self._executor = ThreadPoolExecutor(
            1, thread_name_prefix="kvtier-lookup", initializer=name_os_thread, initargs=("kvtier-lookup",)
        )
        self._lookups: dict[str, Future] = {}
        self._loading: dict[str, Hit] = {}  # loads sent to the worker, until it reports them done
        self._pending_loads: list[LoadItem] = []
        self._tracks: dict[str, Track] = {}
        self._queries = PrefixQueries(link)
        self._index = BlockIndex(link, block_size) if loads and block_index else None
        self._held: dict[str, Future] = {}  # LookupPrefix asked on arrival, until the scheduler asks
        self.lookup_wait_s = lookup_wait_s
        self._wait_left_s = lookup_wait_s  # of this scheduler step's
        self._in_flight: deque[tuple[float, Future]] = deque()  # (asked at, answer), oldest first
        # Logged at close: prompts looked up, answered by the block index, asked; "not yet" answers; waits.
        self.stats = {"looked_up": 0, "index_misses": 0, "asked": 0, "not_yet": 0, "waited_s": 0.0}

    # ------------------------------------------------------------ vLLM's calls, in the order they come

    def on_new_request(self, request) -> None:
        """Ask the cache how much of the prompt it holds now, before the scheduler asks us."""
        key = self._lookup_key(request, 0) if self.loads else None
        if key is not None:
            self._held[request.request_id] = self._ask_held(key)

    def num_new_matched_tokens(self, request, num_computed_tokens: int) -> tuple[int | None, bool]:
        future = self._lookups.get(request.request_id)
        if future is None:
            if not self.loads:
                return 0, False
            future = self._start_lookup(request, num_computed_tokens)
            if future is None:
                return 0, False
            self._lookups[request.request_id] = future
        if not future.done():
            self._wait(future)
            if not future.done():
                self.stats["not_yet"] += 1
                return None, False
        hit = future.result().hit
        if hit is None or hit.num_tokens <= num_computed_tokens:
            return 0, False
        return hit.num_tokens - num_computed_tokens, False

    def update_state_after_alloc(self, request, block_ids: list[int], num_external_tokens: int) -> None:
        rid = request.request_id
        future = self._lookups.pop(rid, None)
        if future is not None and not future.done():  # vLLM allocated without our answer: drop it
            future.add_done_callback(lambda f: self._free(f.result().hit))
            future = None
        lookup = future.result() if future is not None else None
        hit = lookup.hit if lookup is not None else None
        if hit is not None and num_external_tokens > 0:
            start = (hit.num_tokens - num_external_tokens) // self.block_size
            end = hit.num_tokens // self.block_size
            valid_until = self.link.valid_until() if hit.generation == self.link.generation else 0.0
            self._pending_loads.append(
                LoadItem(rid, hit.pool_name, hit.pool_block_ids[start:end], block_ids[start:end], valid_until)
            )
            self._loading[rid] = hit
        elif hit is not None:
            self._free(hit)
        if self.saves and (future is not None or rid not in self._tracks):
            key = request_key(request)
            if key is not None and len(key[0]) <= self.max_model_len:
                held = lookup.held_tokens // self.block_size if lookup is not None else None
                self._tracks[rid] = Track(*key, saved_blocks=held, block_ids=[])

    def build_meta(self, scheduler_output) -> KvtierMetadata:
        """This step's loads (admitted since the last step) and saves (prompt blocks it completes)."""
        self._wait_left_s = self.lookup_wait_s  # build_meta ends a scheduler step
        meta = KvtierMetadata(loads=self._pending_loads)
        self._pending_loads = []
        scheduled = scheduler_output.num_scheduled_tokens
        for new in scheduler_output.scheduled_new_reqs:
            track = self._tracks.get(new.req_id)
            if track is not None:
                track.block_ids = list(new.block_ids[0])
                if track.saved_blocks is None:
                    track.saved_blocks = new.num_computed_tokens // self.block_size
                self._plan_save(track, new.num_computed_tokens + scheduled[new.req_id], meta.saves)
        cached = scheduler_output.scheduled_cached_reqs
        for i, rid in enumerate(cached.req_ids):
            track = self._tracks.get(rid)
            if track is None:
                continue
            new_ids = cached.new_block_ids[i]
            if rid in cached.resumed_req_ids:
                track.block_ids = list(new_ids[0]) if new_ids else []
            elif new_ids:
                track.block_ids.extend(new_ids[0])
            self._plan_save(track, cached.num_computed_tokens[i] + scheduled[rid], meta.saves)
        return meta

    def loads_finished(self, req_ids) -> None:
        """The worker copied these requests' hits: their pool sequences go."""
        for rid in req_ids or ():
            hit = self._loading.pop(rid, None)
            if hit is not None:
                self._free(hit)

    def request_finished(self, request) -> None:
        self._held.pop(request.request_id, None)
        future = self._lookups.pop(request.request_id, None)
        if future is not None:  # never admitted: its pinned blocks go (once the calls are done)
            future.add_done_callback(lambda f: self._free(f.result().hit))
        self._tracks.pop(request.request_id, None)
        # A load already sent stays in _loading: the worker reports it done even for a finished request.

    def close(self) -> None:
        st = self.stats
        log.info(
            "kvtier scheduler: %d prompts looked up: %d answered by the block index, %d asked; %d \"not yet\" "
            "answers; %.0f ms waited for answers",
            st["looked_up"], st["index_misses"], st["asked"], st["not_yet"], st["waited_s"] * 1e3,
        )  # fmt: skip
        if self._index is not None:
            self._index.close()
        self._queries.close()
        self._executor.shutdown(wait=False, cancel_futures=True)

    # ------------------------------------------------------------ helpers

    def _lookup_key(self, request, num_computed_tokens: int) -> tuple[list[int], str, str] | None:
        """The request's (tokens, salt, adapter) if the cache could hold blocks past vLLM's own hit."""
        key = request_key(request)
        if key is None or not self.link.attached or len(key[0]) > self.max_model_len:
            return None
        if self._loadable(key[0]) <= num_computed_tokens:
            return None  # vLLM's own hit covers every block kvtier could load (or the prompt is one block)
        return key

    def _loadable(self, tokens: list[int]) -> int:
        """The most leading tokens of a prompt a hit can give: whole blocks below its last token."""
        return (len(tokens) - 1) // self.block_size * self.block_size

    def _start_lookup(self, request, num_computed_tokens: int) -> Future | None:
        """The request's lookup (a Future of its Lookup), or None: nothing to look up."""
        held = self._held.pop(request.request_id, None)
        key = self._lookup_key(request, num_computed_tokens)
        if key is None:
            return None
        if held is None:  # not asked on arrival (preempted, or the cache was away then)
            held = self._ask_held(key)
        self._wait(held)
        if held.done() and min(held.result(), self._loadable(key[0])) <= num_computed_tokens:
            future: Future = Future()  # a miss (the common case): no pin to ask for
            future.set_result(Lookup(held.result(), None))
            return future
        future = self._asked(
            self._executor.submit(self._lookup, held, *key, request.request_id, num_computed_tokens)
        )
        self._wait(future)
        return future

    def _ask_held(self, key: tuple[list[int], str, str]) -> Future:
        """How much of the prompt the cache holds: 0 at once when the block index says none, else asked."""
        self.stats["looked_up"] += 1
        if self._index is not None and self._index.surely_missed(*key):
            self.stats["index_misses"] += 1
            known: Future = Future()
            known.set_result(0)
            return known
        self.stats["asked"] += 1
        return self._asked(self._queries.submit(*key))

    def _asked(self, future: Future) -> Future:
        self._in_flight.append((time.monotonic(), future))
        return future

    def _stuck(self) -> bool:
        """Whether an answer has been awaited for more than STUCK_S (the cache service is slow or hung)."""
        while self._in_flight and self._in_flight[0][1].done():
            self._in_flight.popleft()
        return bool(self._in_flight) and time.monotonic() - self._in_flight[0][0] > STUCK_S

    def _wait(self, future: Future) -> None:
        """Wait for an answer, up to what is left of this scheduler step's ``lookup_wait_s`` (all
        lookups of a step together): answered within it, the request is scheduled in this step
        instead of the next. The wait also lets the calls' threads run: vLLM's busy loop holds the
        GIL, and a call that waits for it a switch interval (5 ms) at a time takes steps. While an
        answer is awaited for more than STUCK_S, no step waits (a hung cache service costs the
        scheduler a second of waits, not one per step for ever)."""
        if self._wait_left_s <= 0 or future.done() or self._stuck():
            return
        start = time.perf_counter()
        wait([future], timeout=self._wait_left_s)
        waited = time.perf_counter() - start
        self._wait_left_s -= waited
        self.stats["waited_s"] += waited

    def _plan_save(self, track: Track, computed_after_step: int, saves: list[SaveItem]) -> None:
        full = min(computed_after_step, len(track.token_ids)) // self.block_size
        if full <= track.saved_blocks or not self.link.attached:
            return  # nothing new, or no cache to take it now (the blocks are sent once it is back)
        saves.append(
            SaveItem(
                track.token_ids[: full * self.block_size],
                track.tenant_salt,
                track.adapter_id,
                track.saved_blocks,
                track.block_ids[track.saved_blocks : full],
            )
        )
        track.saved_blocks = full

    def _lookup(
        self, held: Future, tokens: list[int], salt: str, adapter: str, rid: str, num_computed: int
    ) -> Lookup:
        """On the lookup thread: never raises (a failed call is no hit)."""
        try:
            held_tokens = held.result(timeout=2 * self.link.cfg.rpc_timeout_s)
            return self._lookup_calls(held_tokens, tokens, salt, adapter, rid, num_computed)
        except (CacheDown, TimeoutError) as e:
            log.debug("kvtier lookup for %s: no answer (%s)", rid, e)
        except CacheCallError as e:
            log.warning("kvtier lookup for %s refused: %s: %s", rid, e.code, e.details)
        except Exception:
            log.exception("kvtier lookup for %s failed", rid)
        return Lookup(0, None)

    def _lookup_calls(
        self, held: int, tokens: list[int], salt: str, adapter: str, rid: str, num_computed: int
    ) -> Lookup:
        """Pin the hit LookupPrefix found (``held`` tokens) with an Allocate of the prompt up to it."""
        bs = self.block_size
        generation, spec = self.link.snapshot()
        if spec is None:
            raise CacheDown("not attached")
        want = min(held, self._loadable(tokens))
        if want <= num_computed:
            return Lookup(held, None)
        item = AllocateItem(tokens[: want + 1], tenant_salt=salt, adapter_id=adapter, request_id=rid)
        try:
            [seq] = self.link.call(lambda c: c.allocate([item]), expect_generation=generation)
        except NoFreeBlocks as e:
            log.info("kvtier lookup for %s: the pool has no room to pin its hit now (%s)", rid, e.details)
            return Lookup(held, None)
        hit = Hit(seq.sequence_id, list(seq.block_table[: seq.num_cached_tokens // bs]), seq.num_cached_tokens,
                  pool_name(spec), generation)  # fmt: skip
        if hit.num_tokens <= num_computed:
            self._free_now(hit)
            return Lookup(held, None)
        return Lookup(held, hit)

    def _free(self, hit: Hit | None) -> None:
        if hit is not None:
            self._executor.submit(self._free_now, hit)

    def _free_now(self, hit: Hit) -> None:
        if hit.generation != self.link.generation:
            return  # its lease is gone, and its sequences with it
        try:
            self.link.call(lambda c: c.free([hit.sequence_id]), expect_generation=hit.generation)
        except (CacheDown, CacheCallError) as e:
            log.debug("kvtier: Free of sequence %d failed (%s); the lease releases it", hit.sequence_id, e)
