"""One node as the router sees it: its cached block hashes, followed from the cache's events,
and its live figures, read from GetStats.

The index is the set of block hashes the node's cache holds, fed by its ``WatchEvents`` stream
(BlockStored adds, BlockRemoved drops). A stream that fails, drops events (OUT_OF_RANGE) or
restarts (a new cache: event ids start over) is reopened from 0 with an empty index, so the kept
events are replayed; while it is not synced a hit is asked with ``LookupPrefix`` (one RPC,
bounded by ``LOOKUP_TIMEOUT_S``). GetStats is read every ``STATS_PERIOD_S``; a node that does not
answer is down for ``DOWN_S`` and polled until it answers. Every call goes through
``kvtier.cache_client.CacheClient`` (the node credential, TLS when a CA is given).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import grpc

from gateway.discovery import Node
from gateway.node_load import NodeLoad
from kvtier.block_hash import BlockHash
from kvtier.cache_client import CacheClient

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
    cache: CacheClient  # aio; deadline STATS_TIMEOUT_S (WatchEvents has none)
    hashes: set[BlockHash] = field(default_factory=set)
    synced: bool = False  # the index follows the node's event stream
    last_event_id: int = 0
    block_size: int = 0  # from GetStats; 0 until the first answer
    usage: float = 0.0  # pool usage, 0..1
    num_sequences: int = 0
    load: NodeLoad = field(default_factory=NodeLoad)  # this gateway's requests on the node
    down_until: float = 0.0
    tasks: list[asyncio.Task] = field(default_factory=list)

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


def predicted_tokens(
    held: set[BlockHash], hashes: Sequence[BlockHash], prompt_len: int, block_size: int
) -> int:
    """Leading prompt tokens whose blocks are all in ``held``, capped as the cache caps a hit
    (the last prompt token is always computed); 0 while the block size is unknown."""
    n = 0
    for h in hashes:
        if h not in held:
            break
        n += 1
    bs = block_size
    return min(n * bs, (prompt_len - 1) // bs * bs) if bs else 0


async def looked_up(state: NodeState, prompt_ids: list[int], tenant_salt: str) -> int:
    """A node's hit asked directly (its index is not synced); 0 if it does not answer in time."""
    try:
        reply = await asyncio.wait_for(
            state.cache.lookup_prefix([prompt_ids], tenant_salt=tenant_salt), LOOKUP_TIMEOUT_S
        )
    except (TimeoutError, grpc.aio.AioRpcError):
        return 0
    bs = state.block_size or 1
    return min(reply.num_cached_tokens[0], (len(prompt_ids) - 1) // bs * bs)


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
    """Keep ``state.hashes`` equal to the node's cached blocks, from its WatchEvents stream."""
    backoff = RESYNC_BACKOFF_S[0]
    while True:
        # (Re)start from 0 with an empty index: after a gap, a broken stream or a restarted
        # cache, the kept events are the only truth we can replay.
        state.hashes.clear()
        state.last_event_id = 0
        state.synced = False
        try:
            call = state.cache.watch_events(since_event_id=0)
            state.synced = True
            async for event in call:
                backoff = RESYNC_BACKOFF_S[0]
                if event.event_id <= state.last_event_id:
                    break  # ids went back: the cache restarted; resync
                state.last_event_id = event.event_id
                kind = event.WhichOneof("event")
                if kind == "block_stored":
                    state.hashes.add(event.block_stored.block_hash)
                elif kind == "block_removed":
                    state.hashes.discard(event.block_removed.block_hash)
            log.warning("router: node %s ended its event stream; resyncing", state.name)
        except grpc.aio.AioRpcError as e:
            state.synced = False
            if e.code() == grpc.StatusCode.OUT_OF_RANGE:
                log.warning("router: node %s: events were dropped (%s); resyncing", state.name, e.details())
            else:
                log.warning(
                    "router: node %s: event stream failed (%s: %s); retrying in %.1fs",
                    state.name,
                    e.code().name,
                    e.details(),
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
        except grpc.aio.AioRpcError as e:
            if not was_down:
                log.warning(
                    "router: node %s does not answer (%s); routing around it", state.name, e.code().name
                )
            was_down = True
            state.down_until = time.monotonic() + DOWN_S
        await asyncio.sleep(DOWN_POLL_S if was_down else STATS_PERIOD_S)


def _assign_replicas(state: NodeState, lease_names: list[str]) -> None:
    """DNS discovery: the node's replicas are the candidates its cache holds a lease for."""
    own = [c for c in state.node.candidates or () if c in lease_names]
    if own and own != state.node.compute:
        log.info("router: node %s serves through %s", state.name, " ".join(own))
        state.node.compute = own
