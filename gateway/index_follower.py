"""One node as the router sees it: its cached block hashes, followed from the cache's events,
and its live figures, read from GetStats.

The index is the set of block hashes the node's cache holds per medium (``kvtier.media``: the
device, then each medium below it), fed by its ``WatchEventBatches`` stream: first the blocks the
node holds (``start_with_held``: as of one event, on each of its media), then every event ready in
one message, as runs of hashes (``hashes_only``: BlockStored adds to its medium's set, BlockRemoved
drops from it; a block may be on several tiers at once). A stream that fails, drops events
(OUT_OF_RANGE) or restarts (a new cache: event ids start over) is reopened with an empty index,
which the held blocks fill again; until they have arrived (not synced) a hit is asked with
``LookupPrefix`` (one RPC, bounded by ``LOOKUP_TIMEOUT_S``). GetStats is read every
``STATS_PERIOD_S``; a node that does not answer is down for ``DOWN_S`` and polled until it answers.
Every call goes through ``kvtier.cache_client.CacheClient`` (the node credential, TLS when a CA is
given).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from kvtier.block_hash import BlockHash
from kvtier.cache_client import CacheClient
from kvtier.cache_errors import CacheCallError
from kvtier.gateway.discovery import Node
from kvtier.gateway.node_load import NodeLoad
from kvtier.media import LOWER_MEDIA, Medium
from kvtier.sequence_types import HashRun, HeldBatch

log = logging.getLogger("kvtier.gateway.router")

DOWN_S = 5.0  # a node that failed is passed over this long
STATS_PERIOD_S = 1.0  # how often each node's GetStats is read (load, block size, replicas)
DOWN_POLL_S = 0.25  # how often a node that does not answer is asked again (back within ~1 s)
STATS_TIMEOUT_S = 2.0
LOOKUP_TIMEOUT_S = 0.5
RESYNC_BACKOFF_S = (0.1, 1.0)  # first and largest wait between attempts to reopen an event stream


@dataclass
class NodeState:
    """What the router knows about one node, and the client it asks the node's cache with."""

    node: Node
    cache: CacheClient  # aio; deadline STATS_TIMEOUT_S (the event stream has none)
    hashes: set[BlockHash] = field(default_factory=set)  # on the device (the pool)
    # Per medium below the device (kvtier.media, rank order): the hashes held there. A medium a
    # newer cache names that this table lacks gets a set too, followed but not priced.
    below: dict[str, set[BlockHash]] = field(default_factory=lambda: {m.name: set() for m in LOWER_MEDIA})
    synced: bool = False  # the index follows the node's event stream
    last_event_id: int = 0
    block_size: int = 0  # from GetStats; 0 until the first answer
    usage: float = 0.0  # pool usage, 0..1
    num_sequences: int = 0
    load: NodeLoad = field(default_factory=NodeLoad)  # this gateway's requests on the node
    down_until: float = 0.0
    tasks: list[asyncio.Task] = field(default_factory=list)
    # The router's nodes, this one included: a medium every node reads (kvtier.media's
    # across_nodes, the shared tier) holds for this node what any node's cache wrote there.
    peers: list[NodeState] = field(default_factory=list, repr=False, compare=False)

    @property
    def name(self) -> str:
        return self.node.name

    @property
    def inflight(self) -> int:
        """Requests this gateway has open on the node."""
        return self.load.inflight

    @inflight.setter
    def inflight(self, value: int) -> None:
        self.load.inflight = value

    def up(self, now: float) -> bool:
        return self.down_until <= now

    def index(self, medium: str) -> set[BlockHash]:
        """The hashes held on ``medium`` (a name in kvtier.media; "device", or "" from a cache that
        predates tiers, is the device)."""
        if medium in ("device", ""):
            return self.hashes
        return self.below.setdefault(medium, set())


@dataclass(frozen=True)
class PredictedHit:
    """A prompt's predicted hit on a node, in tokens, per medium it would be served from: the
    device's leading run, then the blocks after it, each counted on the first medium below the
    device (rank order) that holds it, as the cache's Allocate follows a chain. ``below``: medium
    name -> tokens, media with none left out. Capped as the cache caps a hit."""

    device: int = 0
    below: dict[str, int] = field(default_factory=dict)

    @property
    def total(self) -> int:
        """The prompt tokens the hit would cache (what Allocate's num_cached_tokens counts)."""
        return self.device + sum(self.below.values())


def predicted_hit(state: NodeState, hashes: Sequence[BlockHash], prompt_len: int) -> PredictedHit:
    """The hit of a prompt whose full blocks are ``hashes`` on ``state``'s indexes; nothing
    while the block size is unknown."""
    bs = state.block_size
    if not bs:
        return PredictedHit()
    hashes = hashes[: (prompt_len - 1) // bs]  # the cap: the last prompt token is always computed
    device = 0
    while device < len(hashes) and hashes[device] in state.hashes:
        device += 1
    below: dict[str, int] = {}
    media = [(m.name, _held_on(state, m)) for m in LOWER_MEDIA]
    for h in hashes[device:]:
        name = next((name for name, held in media if h in held), None)
        if name is None:
            break
        below[name] = below.get(name, 0) + bs
    return PredictedHit(device * bs, below)


class _AnyOf:
    """``h in view``: in any of ``sets``."""

    __slots__ = ("sets",)

    def __init__(self, sets: list[set[BlockHash]]) -> None:
        self.sets = sets

    def __contains__(self, h: object) -> bool:
        return any(h in s for s in self.sets)


def _held_on(state: NodeState, m: Medium):
    """What ``state``'s node can load from medium ``m``: its own index, or for a medium every node
    reads (the shared tier) what any of the router's nodes reported writing there."""
    if m.across_nodes and state.peers:
        return _AnyOf([peer.index(m.name) for peer in state.peers])
    return state.index(m.name)


ACROSS_NODES = {m.name for m in LOWER_MEDIA if m.across_nodes}


def apply_run(state: NodeState, run: HashRun) -> None:
    """A run of block events on ``state``'s index: BlockStored adds the hashes to their medium's
    set, BlockRemoved drops them. A removal from a medium every node reads (the shared tier: a
    node reports what the store lost or what it forgot, its own view bounded) drops them from every
    peer's set: the union ``_held_on`` reads shrinks with it."""
    if run.stored:
        state.index(run.medium).update(run.hashes)
        return
    holders = state.peers if run.medium in ACROSS_NODES and state.peers else (state,)
    for holder in holders:
        holder.index(run.medium).difference_update(run.hashes)


def capped(device: int, below: dict[str, int], prompt_len: int, block_size: int) -> PredictedHit:
    """A hit of ``device`` tokens plus ``below`` (medium -> tokens: LookupPrefix's counts), cut to
    the cache's cap (whole blocks, the last prompt token always computed) from the media below
    first, the lowest ranked first: the counts do not say which medium's blocks come last."""
    over = max(0, device + sum(below.values()) - (prompt_len - 1) // block_size * block_size)
    kept = dict(below)
    for m in reversed(LOWER_MEDIA):
        cut = min(kept.get(m.name, 0), over)
        over -= cut
        if m.name in kept:
            kept[m.name] -= cut
    return PredictedHit(device - over, {name: n for name, n in kept.items() if n})


async def looked_up(state: NodeState, prompt_ids: list[int], tenant_salt: str) -> PredictedHit:
    """A node's hit asked directly (its index is not synced); nothing if it does not answer in time."""
    try:
        [hit] = await asyncio.wait_for(
            state.cache.lookup_prefix([prompt_ids], tenant_salt=tenant_salt), LOOKUP_TIMEOUT_S
        )
    except (TimeoutError, CacheCallError):
        return PredictedHit()
    known = {m.name for m in LOWER_MEDIA}  # a medium this table lacks is not priced
    below = {medium: n for medium, n in hit.below.items() if medium in known}
    return capped(hit.num_cached_tokens, below, len(prompt_ids), state.block_size or 1)


def follow(state: NodeState, count: Callable[[str], None]) -> None:
    """Start following ``state``'s node (events and stats) on the running loop; ``count(reason)``
    is told of each event stream restarted after a failure ("resync")."""
    state.tasks = [
        asyncio.create_task(_follow_events(state, count), name=f"router-events-{state.name}"),
        asyncio.create_task(_poll_stats(state), name=f"router-stats-{state.name}"),
    ]


async def stop(state: NodeState) -> None:
    """Cancel ``state``'s tasks and close its channel."""
    for task in state.tasks:
        task.cancel()
    for task in state.tasks:
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await task
    await state.cache.close()


async def _follow_events(state: NodeState, count: Callable[[str], None]) -> None:
    """Keep ``state.hashes`` equal to the node's cached blocks, from its WatchEventBatches stream."""
    backoff = RESYNC_BACKOFF_S[0]
    while True:
        # (Re)start with an empty index: after a gap, a broken stream or a restarted cache, the
        # held blocks and the events after them are the truth.
        for held in (state.hashes, *state.below.values()):
            held.clear()
        state.last_event_id = 0
        state.synced = False
        try:
            # Batched (every event ready in one message, as runs of hashes): a message per event
            # cost the cache service more CPU than the calls it indexes (bench/cache_cpu.py
            # --follower). It begins with the blocks the node holds (as of one event), then the
            # events after.
            stream = state.cache.watch_event_batches(start_with_held=True, hashes_only=True)
            async for batch in stream:
                backoff = RESYNC_BACKOFF_S[0]
                if isinstance(batch, HeldBatch):
                    for medium_name, hashes in batch.held:
                        state.index(medium_name).update(hashes)
                    if batch.end:
                        state.last_event_id, state.synced = batch.as_of, True
                    continue
                runs = batch.runs
                if not runs:
                    continue
                if runs[0].first_event_id <= state.last_event_id:
                    break  # ids went back: the cache restarted; resync
                state.synced = True  # (a cache that sends no held blocks replays its kept events)
                for run in runs:
                    apply_run(state, run)
                state.last_event_id = runs[-1].last_event_id
            log.warning("router: node %s ended its event stream; resyncing", state.name)
        except CacheCallError as e:
            state.synced = False
            if e.code == "OUT_OF_RANGE":
                log.warning("router: node %s: events were dropped (%s); resyncing", state.name, e.details)
            else:
                log.warning(
                    "router: node %s: event stream failed (%s: %s); retrying in %.1fs",
                    state.name,
                    e.code,
                    e.details,
                    backoff,
                )
                count("resync")
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, RESYNC_BACKOFF_S[1])
        state.synced = False


async def _poll_stats(state: NodeState) -> None:
    """Load and block size of a node, every STATS_PERIOD_S; a node that fails is marked down."""
    was_down = False
    while True:
        try:
            stats = await state.cache.get_stats()
            state.block_size = stats.block_size
            state.usage = stats.usage_percent / 100.0
            state.num_sequences = stats.num_sequences
            if state.node.candidates is not None:
                _assign_replicas(state, [lease.client_name for lease in stats.leases])
            if was_down:
                log.info("router: node %s answers again", state.name)
                state.down_until = 0.0
            was_down = False
        except CacheCallError as e:
            if not was_down:
                log.warning("router: node %s does not answer (%s); routing around it", state.name, e.code)
            was_down = True
            state.down_until = time.monotonic() + DOWN_S
        await asyncio.sleep(DOWN_POLL_S if was_down else STATS_PERIOD_S)


def _assign_replicas(state: NodeState, lease_names: list[str]) -> None:
    """DNS discovery: the node's replicas are the candidates its cache holds a lease for."""
    own = [c for c in state.node.candidates or () if c in lease_names]
    if own and own != state.node.compute:
        log.info("router: node %s serves through %s", state.name, " ".join(own))
        state.node.compute = own
