"""The scheduler side of an engine that saves (vLLM's ``kv_both`` and ``kv_producer``).

Each arriving prompt gets a pool sequence of this side's lease (``Allocate``, many arriving prompts
per call on a thread: ``prefix_queries.PoolAllocations``): the cache's hit pinned (and promoted from
its host and disk tiers), fresh pool blocks for the rest. The fresh blocks are where the worker
writes the request's full prompt blocks in the step that computed them, straight from vLLM's
blocks (``worker.save``): one copy, no staging, no call in the step. The hit is what a kv_both
engine loads. Its scheduler does not wait for the Allocate to tell a miss: once the pool is full
every Allocate evicts (and demotes to the host tier), which is slower than vLLM's step should
wait for. A ``LookupPrefix`` asked on arrival too (read-only, batched; or the block index's sure
miss) answers a miss at once; only a hit waits for its pinned blocks (``lookups.SchedulerSide``'s
bounded wait, as any lookup).
The worker reports each save; once the prompt's full blocks are written (or the request ends, or
a save could not be written), the pool sequence is freed with a commit of the blocks written
(``prefix_queries.Releases``: the frees of ``save_batch_ms`` in one call), which publishes them
for every engine. Blocks are published only as a gapless chain from the prompt's first block.

A prompt waiting in vLLM's queue holds its pool blocks until it is computed, so an engine holds at
most ``max_reserved_share`` of the pool for prompts that arrived: past it, a prompt is allocated
when vLLM's scheduler first asks about it (about to schedule it). A prompt whose allocation is
answered after its prefill step is saved in a later step (its full prompt blocks do not change
while it runs), and the step that generates its last token by ``max_tokens`` (for a prefill-only
request, ``max_tokens`` 1, the step that computes its prompt) waits for it up to
``LAST_STEP_WAIT_S``: no later step runs it. One that finished before its answer anyway (a stop
string or EOS, or a wait that ran out), or that the cache could not allocate, is not saved.
The engine's lease holds every pool sequence: an engine that dies leaks nothing, and blocks it did
not report written are never published.
"""

from __future__ import annotations

import logging
from concurrent.futures import Future
from dataclasses import dataclass, field

from kvtier.sequence_types import AllocateItem
from kvtier.vllm import LOGGER
from kvtier.vllm.cache_link import CacheLink
from kvtier.vllm.lookups import SchedulerSide
from kvtier.vllm.plan import KvtierMetadata
from kvtier.vllm.prefix_queries import PoolAllocations, PoolSequence, Releases
from kvtier.vllm.transfers import SaveItem

log = logging.getLogger(LOGGER)

WRITE_MARGIN = 0.25  # of the lease's TTL: a save is written only this long before the lease could lapse
# A step waits at most this long, all together, for the pool sequences of requests it ends by max_tokens
# (no later step could save them; a prefill-only request's is its first); others are saved in a later step.
LAST_STEP_WAIT_S = 0.1


@dataclass
class Track:
    """A request this side saves (and loads, from the same pool sequence, when it hits)."""

    token_ids: list[int]
    allocation: Future  # of its PoolSequence, or None (the cache could not give one)
    blocks: int  # pool blocks it holds (counted against max_reserved_share until released)
    held: Future | None = None  # kv_both: the leading tokens the cache holds on any tier (LookupPrefix)
    max_tokens: int | None = None  # the request's: the step that generates its last token is its last
    block_ids: list[int] = field(default_factory=list)  # vLLM's, in token order
    computed: int = 0  # prompt tokens vLLM has computed once its latest scheduled step has run
    saved_blocks: int | None = None  # leading blocks in the pool or planned (None: not yet known)
    written_blocks: int = 0  # leading blocks in the pool (the hit, then what the worker reported)
    in_flight: int = 0  # saves planned and not yet reported
    loading: bool = False
    finished: bool = False
    broken: bool = False  # a save was not written: nothing past written_blocks is published
    released: bool = False


class SavingSide(SchedulerSide):
    """``loads``: also load hits (kv_both); ``block_index``: answer sure misses from
    ``kvtier.vllm.block_index``; ``max_reserved_share``: of the pool's blocks, what prompts not yet
    scheduled may hold; ``batch_s``: how long frees are gathered into one call."""

    def __init__(
        self, link: CacheLink, block_size: int, max_model_len: int, lookup_wait_s: float = 0.0, *,
        loads: bool = True, block_index: bool = False, max_reserved_share: float = 0.25, batch_s: float = 0.05,
    ):  # fmt: skip
        super().__init__(link, block_size, max_model_len, lookup_wait_s, loads=loads, block_index=block_index)
        self.max_reserved_share = max_reserved_share
        self._allocations = PoolAllocations(link)
        self._releases = Releases(link, batch_s)
        self._tracks: dict[str, Track] = {}
        self._reserved = 0  # blocks of the tracks not released
        self._last_step_wait_left_s = LAST_STEP_WAIT_S  # of this step's
        self.stats["allocated"] = self.stats["deferred"] = 0

    # ------------------------------------------------------------ vLLM's calls, in the order they come

    def on_new_request(self, request) -> None:
        """Allocate the prompt's pool sequence now, before the scheduler asks (within the share)."""
        key = self._key(request)
        if key is None:
            return
        spec = self.link.client.pool if self.link.client is not None else None
        if spec is None or self._reserved + self._blocks(key[0]) > self.max_reserved_share * spec.num_blocks:
            self.stats["deferred"] += 1  # allocated when the scheduler asks
            return
        self._track(request, key)

    def num_new_matched_tokens(self, request, num_computed_tokens: int) -> tuple[int | None, bool]:
        track = self._tracks.get(request.request_id)
        if track is None:
            key = self._key(request)
            if key is None:
                return 0, False
            track = self._track(request, key)
        if not self.loads or track.released or self._loadable(track.token_ids) <= num_computed_tokens:
            return 0, False  # nothing to load (the allocation is still waited for by the saves)
        if not track.allocation.done() and track.held is not None:
            # A miss is told by the cheap read-only answer; only a hit waits for its pinned blocks
            # (an Allocate into a full pool evicts: slower, and off vLLM's path for misses).
            if not self._answered(track.held):
                return self._not_yet()
            if min(track.held.result(), self._loadable(track.token_ids)) <= num_computed_tokens:
                return 0, False
        if not self._answered(track.allocation):
            return self._not_yet()
        seq = self._live(track)
        if seq is None or seq.num_cached_tokens <= num_computed_tokens:
            return 0, False
        return seq.num_cached_tokens - num_computed_tokens, False

    def update_state_after_alloc(self, request, block_ids: list[int], num_external_tokens: int) -> None:
        track = self._tracks.get(request.request_id)
        if track is None or num_external_tokens <= 0 or not track.allocation.done():
            return
        seq = self._live(track)
        if seq is None:
            return
        self._plan_load(request.request_id, seq, block_ids, num_external_tokens)
        track.loading = True

    def build_meta(self, scheduler_output) -> KvtierMetadata:
        """This step's loads (admitted since the last step) and saves (full prompt blocks computed by
        the end of this step, of the requests it runs, whose pool sequences are known)."""
        meta = self._start_step()
        self._last_step_wait_left_s = LAST_STEP_WAIT_S
        scheduled = scheduler_output.num_scheduled_tokens
        for new in scheduler_output.scheduled_new_reqs:
            track = self._tracks.get(new.req_id)
            if track is not None:
                track.block_ids = list(new.block_ids[0])
                track.computed = new.num_computed_tokens + scheduled[new.req_id]
                self._plan_save(new.req_id, track, meta.saves)
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
            track.computed = cached.num_computed_tokens[i] + scheduled[rid]
            self._plan_save(rid, track, meta.saves)
        return meta

    def update_connector_output(self, loads_done, saves_done) -> None:
        """The worker's report of a step: loads copied, saves written (or not)."""
        for rid in loads_done or ():
            track = self._tracks.get(rid)
            if track is not None:
                track.loading = False
                self._maybe_release(rid, track)
        for rid, end_block, written in saves_done or ():
            track = self._tracks.get(rid)
            if track is None:
                continue
            track.in_flight -= 1
            if written and not track.broken:
                track.written_blocks = max(track.written_blocks, end_block)
            else:
                track.broken = True
            self._maybe_release(rid, track)

    def request_finished(self, request) -> None:
        track = self._tracks.get(request.request_id)
        if track is not None:
            track.finished = True
            self._maybe_release(request.request_id, track)

    def close(self) -> None:
        """Publish what is reported written (the frees queued go out), then stop."""
        super().close()
        self._allocations.close()
        self._releases.close()
        self._releases.join(self.link.cfg.rpc_timeout_s)  # the counts below include these last frees
        log.info("kvtier scheduler: %d prompts allocated, %d of them when the scheduler asked (past "
                 "max_reserved_share); %d frees published %d tokens", self.stats["allocated"], self.stats["deferred"],
                 self._releases.stats["frees"], self._releases.stats["committed_tokens"])  # fmt: skip

    # ------------------------------------------------------------ helpers

    def _blocks(self, tokens: list[int]) -> int:
        """The pool blocks a prompt's sequence holds."""
        return -(-len(tokens) // self.block_size)

    def _track(self, request, key: tuple[list[int], str, str]) -> Track:
        tokens, salt, adapter = key
        blocks = self._blocks(tokens)
        rid = request.request_id
        self.stats["allocated"] += 1
        item = AllocateItem(tokens, tenant_salt=salt, adapter_id=adapter, request_id=rid)
        held = self._ask_held(key) if self.loads and self._loadable(tokens) > 0 else None
        track = Track(tokens, self._asked(self._allocations.submit(item)), blocks, held,
                      max_tokens=getattr(request, "max_tokens", None))  # fmt: skip
        self._tracks[rid] = track
        self._reserved += blocks
        return track

    def _live(self, track: Track) -> PoolSequence | None:
        """The track's answered pool sequence, if the cache gave one and it lives (its lease does)."""
        seq = track.allocation.result()
        return seq if seq is not None and seq.generation == self.link.generation else None

    def _plan_save(self, rid: str, track: Track, saves: list[SaveItem]) -> None:
        if _last_step(track):  # no later step will run it: its blocks are saved now or never
            self._last_step_wait_left_s -= self._waited(track.allocation, self._last_step_wait_left_s)
        if track.released or track.broken or not track.allocation.done():
            return
        seq, client = self._live(track), self.link.client
        if seq is None or client is None:
            track.broken = True  # no pool sequence (now): nothing more of it is saved
            return self._maybe_release(rid, track)
        if track.saved_blocks is None:
            track.saved_blocks = track.written_blocks = seq.num_cached_tokens // self.block_size
        full = min(track.computed, len(track.token_ids)) // self.block_size
        if full > track.saved_blocks:
            start, track.saved_blocks = track.saved_blocks, full
            write_by = self.link.valid_until() - WRITE_MARGIN * client.lease_ttl_s
            saves.append(SaveItem(rid, seq.pool_name, seq.block_table[start:full], track.block_ids[start:full],
                                  full, write_by))  # fmt: skip
            track.in_flight += 1
        self._maybe_release(rid, track)

    def _maybe_release(self, rid: str, track: Track) -> None:
        """Free the track's pool sequence (publishing the blocks written) once nothing more will use
        it: no load or save in flight, and the request ended, a save failed or every full prompt
        block is in the pool. A finished request's track goes with it."""
        if not track.released and not track.loading and not track.in_flight:
            saved_all = (
                track.saved_blocks is not None
                and track.written_blocks >= len(track.token_ids) // self.block_size
            )
            if track.finished or track.broken or saved_all:
                track.released = True
                self._reserved -= track.blocks
                written = track.written_blocks * self.block_size if track.saved_blocks is not None else 0
                track.allocation.add_done_callback(
                    lambda f: f.result() and self._releases.release(f.result(), written)
                )
        if track.released and track.finished:
            self._tracks.pop(rid, None)


def _last_step(track: Track) -> bool:
    """Whether the step being planned generates the request's last token (by ``max_tokens``: a
    stop string or EOS may end it sooner). After it, ``computed - prompt + 1`` tokens are out: a
    prefill-only request's (max_tokens 1) is the step that computes its prompt."""
    return track.max_tokens is not None and track.computed - len(track.token_ids) + 1 >= track.max_tokens
