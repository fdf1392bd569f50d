"""The scheduler side: which leading blocks of a request the cache service holds, and what to do
with vLLM's blocks this step.

vLLM's scheduler asks ``get_num_new_matched_tokens`` from its loop, which must not wait on a
network call for long. So the cache is asked as each request arrives (``on_new_request``, many
arriving prompts per call, on their own thread: ``kvtier.vllm.prefix_queries``); when the
scheduler asks, the answer is usually there. The scheduler waits for these answers at most
``lookup_wait_ms`` per step, all requests together, then answers "not yet" (None) and vLLM asks
again at its next step (and waits again). The waits matter twice: the request is scheduled in the
step that asks, and the calls' threads get the GIL (vLLM's busy loop holds it; a gRPC call that
waits a switch interval for each of its turns takes several steps). While an answer has been
awaited for more than a second (a slow or hung cache service), no step waits. Prompts whose every
loadable block vLLM's own prefix cache already holds (one block or less, or a local hit) are
never waited for.

Two sides share that (``SchedulerSide``). Both ask ``LookupPrefix`` on arrival when they load
(read-only, the hit over every tier: a miss is answered from it). An engine that saves (kv_both,
kv_producer: ``kvtier.vllm.saving``) also allocates a pool sequence for each arriving prompt, its
hit pinned and room for the rest; one that only loads (kv_consumer: ``Lookups`` here) pins a hit
longer than vLLM's own with an ``Allocate`` of the prompt up to one token past it, on a
background thread (which promotes host and disk blocks into the pool). With ``block_index`` on
(the default), a prompt whose first block the cache never announced is answered 0 on arrival
without a LookupPrefix (``kvtier.vllm.block_index``).

The hit is whole blocks, below the last prompt token (vLLM must compute that one). The loads are
synchronous in vLLM's sense (``load_kv_async`` False): the worker copies the hit before the
forward of the same step that computes the rest of the prompt (a local memory copy of a few
milliseconds costs less than the engine step an asynchronous load waits for), and the pool
sequence is freed when the worker reports the copy done (its ``KvtierWorkerMeta``). A single
thread makes every pin and Free of a consumer, so a Free always follows its Allocate.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor, wait

from kvtier.cache_errors import CacheCallError, NoFreeBlocks
from kvtier.cpu_plan import name_os_thread
from kvtier.sequence_types import AllocateItem
from kvtier.vllm import LOGGER
from kvtier.vllm.block_index import BlockIndex
from kvtier.vllm.cache_link import CacheDown, CacheLink
from kvtier.vllm.plan import KvtierMetadata
from kvtier.vllm.prefix_queries import PoolSequence, PrefixQueries
from kvtier.vllm.transfers import LoadItem

log = logging.getLogger(LOGGER)

STUCK_S = 1.0  # an answer awaited longer than this: the scheduler stops waiting for answers


def request_key(request) -> tuple[list[int], str, str] | None:
    """(prompt token ids, salt, adapter) of a request kvtier can key, else None (prompt embeddings or
    multimodal inputs: their KV depends on more than the token ids)."""
    if request.prompt_token_ids is None or getattr(request, "prompt_embeds", None) is not None:
        return None
    if getattr(request, "mm_features", None):
        return None
    lora = getattr(request, "lora_request", None)
    return list(request.prompt_token_ids), request.cache_salt or "", lora.lora_name if lora else ""


class SchedulerSide:
    """What both scheduler sides share: the requests' keys, and waiting for the cache's answers
    within ``lookup_wait_s`` per scheduler step (``_answered``), never while one is stuck."""

    def __init__(
        self, link: CacheLink, block_size: int, max_model_len: int, lookup_wait_s: float, *, loads: bool = True,
        block_index: bool = False,
    ):  # fmt: skip
        self.link = link
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.lookup_wait_s = lookup_wait_s
        self.loads = loads
        self._queries = PrefixQueries(link) if loads else None
        self._index = BlockIndex(link, block_size) if loads and block_index else None
        self._wait_left_s = lookup_wait_s  # of this scheduler step's
        self._in_flight: deque[tuple[float, Future]] = deque()  # (asked at, answer), oldest first
        self._pending_loads: list[LoadItem] = []
        # Logged at close: prompts looked up, answered by the block index, asked; "not yet" answers; waits.
        self.stats = {"looked_up": 0, "index_misses": 0, "asked": 0, "not_yet": 0, "waited_s": 0.0}

    def _key(self, request) -> tuple[list[int], str, str] | None:
        """The request's (tokens, salt, adapter), if the cache can hold it and is attached."""
        key = request_key(request)
        if key is None or not self.link.attached or len(key[0]) > self.max_model_len:
            return None
        return key

    def _loadable(self, tokens: list[int]) -> int:
        """The most leading tokens of a prompt a hit can give: whole blocks below its last token."""
        return (len(tokens) - 1) // self.block_size * self.block_size

    def _start_step(self) -> KvtierMetadata:
        """(build_meta) A scheduler step ends: its loads, and a fresh wait for the next one's."""
        self._wait_left_s = self.lookup_wait_s
        meta = KvtierMetadata(loads=self._pending_loads)
        self._pending_loads = []
        return meta

    def _plan_load(self, rid: str, seq: PoolSequence, block_ids: list[int], num_external_tokens: int) -> None:
        """Load the last ``num_external_tokens`` of ``seq``'s pinned hit into vLLM's ``block_ids``
        before this step's forward, trusted only within the lease that pins them."""
        start = (seq.num_cached_tokens - num_external_tokens) // self.block_size
        end = seq.num_cached_tokens // self.block_size
        valid_until = self.link.valid_until() if seq.generation == self.link.generation else 0.0
        self._pending_loads.append(
            LoadItem(rid, seq.pool_name, seq.block_table[start:end], block_ids[start:end], valid_until)
        )

    def _asked(self, future: Future) -> Future:
        self._in_flight.append((time.monotonic(), future))
        return future

    def _stuck(self) -> bool:
        """Whether an answer has been awaited for more than STUCK_S (the cache service is slow or hung)."""
        while self._in_flight and self._in_flight[0][1].done():
            self._in_flight.popleft()
        return bool(self._in_flight) and time.monotonic() - self._in_flight[0][0] > STUCK_S

    def _answered(self, future: Future) -> bool:
        """Whether ``future`` is answered, after waiting up to what is left of this scheduler step's
        ``lookup_wait_s`` (all lookups of a step together): answered within it, the request is
        scheduled in this step instead of the next. The wait also
        lets the calls' threads run: vLLM's busy loop holds the GIL, and a call that waits for it a
        switch interval (5 ms) at a time takes steps. While an answer is awaited for more than
        STUCK_S, no step waits (a hung cache service costs the scheduler a second of waits, not one
        per step for ever)."""
        self._wait_left_s -= self._waited(future, self._wait_left_s)
        return future.done()

    def _waited(self, future: Future, up_to_s: float) -> float:
        """Wait for ``future`` up to ``up_to_s`` (not while an answer is stuck); the seconds waited."""
        if future.done() or up_to_s <= 0 or self._stuck():
            return 0.0
        start = time.perf_counter()
        wait([future], timeout=up_to_s)
        waited = time.perf_counter() - start
        self.stats["waited_s"] += waited
        return waited

    def _not_yet(self) -> tuple[None, bool]:
        """vLLM's "ask me again next step"."""
        self.stats["not_yet"] += 1
        return None, False

    def _ask_held(self, key: tuple[list[int], str, str]) -> Future:
        """How much of the prompt the cache holds on any tier: 0 at once when the block index says
        none, else asked (``LookupPrefix``, many arriving prompts per call)."""
        self.stats["looked_up"] += 1
        if self._index is not None and self._index.surely_missed(*key):
            self.stats["index_misses"] += 1
            known: Future = Future()
            known.set_result(0)
            return known
        self.stats["asked"] += 1
        return self._asked(self._queries.submit(*key))

    def close(self) -> None:
        st = self.stats
        log.info(
            "kvtier scheduler: %d prompts looked up: %d answered by the block index, %d asked; %d \"not yet\" "
            "answers; %.0f ms waited for answers",
            st["looked_up"], st["index_misses"], st["asked"], st["not_yet"], st["waited_s"] * 1e3,
        )  # fmt: skip
        if self._index is not None:
            self._index.close()
        if self._queries is not None:
            self._queries.close()


class Lookups(SchedulerSide):
    """The scheduler side of an engine that only loads (vLLM's ``kv_consumer``): its lookups ask
    ``LookupPrefix`` on arrival and pin a hit longer than vLLM's own; nothing is saved.
    ``block_index``: answer sure misses from ``kvtier.vllm.block_index`` (the setting of that name)."""

    def __init__(
        self, link: CacheLink, block_size: int, max_model_len: int, lookup_wait_s: float = 0.0, *,
        block_index: bool = False,
    ):  # fmt: skip
        super().__init__(link, block_size, max_model_len, lookup_wait_s, block_index=block_index)
        self._executor = ThreadPoolExecutor(
            1, thread_name_prefix="kvtier-lookup", initializer=name_os_thread, initargs=("kvtier-lookup",)
        )
        self._lookups: dict[str, Future] = {}
        self._loading: dict[str, PoolSequence] = {}  # loads sent to the worker, until it reports them done
        self._held: dict[str, Future] = {}  # LookupPrefix asked on arrival, until the scheduler asks

    # ------------------------------------------------------------ vLLM's calls, in the order they come

    def on_new_request(self, request) -> None:
        """Ask the cache how much of the prompt it holds now, before the scheduler asks us."""
        key = self._key(request)
        if key is not None and self._loadable(key[0]) > 0:
            self._held[request.request_id] = self._ask_held(key)

    def num_new_matched_tokens(self, request, num_computed_tokens: int) -> tuple[int | None, bool]:
        future = self._lookups.get(request.request_id)
        if future is None:
            future = self._start_lookup(request, num_computed_tokens)
            if future is None:
                return 0, False
            self._lookups[request.request_id] = future
        if not self._answered(future):
            return self._not_yet()
        hit = future.result()
        if hit is None or hit.num_cached_tokens <= num_computed_tokens:
            return 0, False
        return hit.num_cached_tokens - num_computed_tokens, False

    def update_state_after_alloc(self, request, block_ids: list[int], num_external_tokens: int) -> None:
        rid = request.request_id
        future = self._lookups.pop(rid, None)
        if future is None:
            return
        if not future.done():  # vLLM allocated without our answer: drop it
            future.add_done_callback(lambda f: self._free(f.result()))
            return
        hit = future.result()
        if hit is not None and num_external_tokens > 0:
            self._plan_load(rid, hit, block_ids, num_external_tokens)
            self._loading[rid] = hit
        elif hit is not None:
            self._free(hit)

    def build_meta(self, scheduler_output) -> KvtierMetadata:
        """This step's loads (admitted since the last step)."""
        return self._start_step()

    def update_connector_output(self, loads_done, saves_done) -> None:
        """The worker copied these requests' hits: their pool sequences go."""
        for rid in loads_done or ():
            hit = self._loading.pop(rid, None)
            if hit is not None:
                self._free(hit)

    def request_finished(self, request) -> None:
        self._held.pop(request.request_id, None)
        future = self._lookups.pop(request.request_id, None)
        if future is not None:  # never admitted: its pinned blocks go (once the calls are done)
            future.add_done_callback(lambda f: self._free(f.result()))
        # A load already sent stays in _loading: the worker reports it done even for a finished request.

    def close(self) -> None:
        super().close()
        self._executor.shutdown(wait=False, cancel_futures=True)

    # ------------------------------------------------------------ helpers

    def _start_lookup(self, request, num_computed_tokens: int) -> Future | None:
        """The request's lookup (a Future of its pinned hit's PoolSequence, or None: a miss), or None:
        nothing to look up."""
        held = self._held.pop(request.request_id, None)
        key = self._key(request)
        if key is None or self._loadable(key[0]) <= num_computed_tokens:
            return None  # vLLM's own hit covers every block kvtier could load (or the prompt is one block)
        if held is None:  # not asked on arrival (preempted, or the cache was away then)
            held = self._ask_held(key)
        if self._answered(held) and min(held.result(), self._loadable(key[0])) <= num_computed_tokens:
            future: Future = Future()  # a miss (the common case): no pin to ask for
            future.set_result(None)
            return future
        future = self._asked(
            self._executor.submit(self._lookup, held, *key, request.request_id, num_computed_tokens)
        )
        self._answered(future)
        return future

    def _lookup(
        self, held: Future, tokens: list[int], salt: str, adapter: str, rid: str, num_computed: int
    ) -> PoolSequence | None:
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
        return None

    def _lookup_calls(
        self, held: int, tokens: list[int], salt: str, adapter: str, rid: str, num_computed: int
    ) -> PoolSequence | None:
        """Pin the hit LookupPrefix found (``held`` tokens) with an Allocate of the prompt up to it."""
        generation, spec = self.link.snapshot()
        if spec is None:
            raise CacheDown("not attached")
        want = min(held, self._loadable(tokens))
        if want <= num_computed:
            return None
        item = AllocateItem(tokens[: want + 1], tenant_salt=salt, adapter_id=adapter, request_id=rid)
        try:
            [seq] = self.link.call(lambda c: c.allocate([item]), expect_generation=generation)
        except NoFreeBlocks as e:
            log.info("kvtier lookup for %s: the pool has no room to pin its hit now (%s)", rid, e.details)
            return None
        hit = PoolSequence.of(seq, spec, generation)
        if hit.num_cached_tokens <= num_computed:
            self._free_now(hit)
            return None
        return hit

    def _free(self, hit: PoolSequence | None) -> None:
        if hit is not None:
            self._executor.submit(self._free_now, hit)

    def _free_now(self, hit: PoolSequence) -> None:
        if hit.generation != self.link.generation:
            return  # its lease is gone, and its sequences with it
        try:
            self.link.call(lambda c: c.free([hit.sequence_id]), expect_generation=hit.generation)
        except (CacheDown, CacheCallError) as e:
            log.debug("kvtier: Free of sequence %d failed (%s); the lease releases it", hit.sequence_id, e)
